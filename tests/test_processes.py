"""The one way a child is stopped (gputravel/processes.py): asked, SIGTERM, SIGKILL, reaped."""

from __future__ import annotations

import multiprocessing
import signal
import subprocess
import sys
import time

import pytest

from gputravel.processes import stop_process, stop_processes

pytestmark = pytest.mark.usefixtures("processes")

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
POLITE = "import time; print('up', flush=True); time.sleep(60)"


def _start(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"  # its handler is in place
    return proc


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_and_reaped() -> None:
    polite, stubborn = _start(POLITE), _start(STUBBORN)
    began = time.monotonic()
    stop_processes([polite, stubborn], 0.5)
    assert polite.returncode == -signal.SIGTERM and stubborn.returncode == -signal.SIGKILL
    assert time.monotonic() - began < 10


def test_a_child_asked_to_stop_is_given_the_grace_before_any_signal() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    assert stop_process(proc, 10, asked=True) == 0  # ended by itself: no signal reached it


def test_processes_of_multiprocessing_the_dead_and_the_never_started_are_all_fine() -> None:
    ctx = multiprocessing.get_context("spawn")
    running, never = ctx.Process(target=time.sleep, args=(60,)), ctx.Process(target=time.sleep, args=(60,))
    running.start()
    done = _start("print('up', flush=True)")
    done.wait()
    stop_processes([running, never, done], 2)
    assert running.exitcode == -signal.SIGTERM and never.pid is None and done.returncode == 0
