"""The one way a child is stopped (gputravel/processes.py): asked, SIGTERM, SIGKILL, reaped; and
the one owner of a launcher's children (Children), which stops them all, last started first."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from gputravel.processes import Children, stop_process, stop_processes

slow = pytest.mark.usefixtures("processes")

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
POLITE = "import time; print('up', flush=True); time.sleep(60)"


def _start(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"  # its handler is in place
    return proc


@slow
def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_and_reaped() -> None:
    polite, stubborn = _start(POLITE), _start(STUBBORN)
    began = time.monotonic()
    stop_processes([polite, stubborn], 0.5)
    assert polite.returncode == -signal.SIGTERM and stubborn.returncode == -signal.SIGKILL
    assert time.monotonic() - began < 10


@slow
def test_a_child_asked_to_stop_is_given_the_grace_before_any_signal() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    assert stop_process(proc, 10, asked=True) == 0  # ended by itself: no signal reached it


@slow
def test_processes_of_multiprocessing_the_dead_and_the_never_started_are_all_fine() -> None:
    ctx = multiprocessing.get_context("spawn")
    running, never = ctx.Process(target=time.sleep, args=(60,)), ctx.Process(target=time.sleep, args=(60,))
    running.start()
    done = _start("print('up', flush=True)")
    done.wait()
    stop_processes([running, never, done], 2)
    assert running.exitcode == -signal.SIGTERM and never.pid is None and done.returncode == 0


@slow
def test_children_log_both_streams_read_nothing_and_are_all_reaped_on_close(tmp_path) -> None:
    log = tmp_path / "a.log"
    talker = ("import sys, time; print('out', flush=True); print('err', file=sys.stderr, flush=True); "
              "print(repr(sys.stdin.read()), flush=True); time.sleep(60)")
    with Children(5) as children:
        a = children.start("a", [sys.executable, "-c", talker], log=log, start_new_session=True)
        b = children.start("b", [sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE)
        assert b.stdout is not None and b.stdout.readline() == b"up\n"
        deadline = time.monotonic() + 30
        while "''" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert children.logs == {"a": log} and list(children) == ["a", "b"] and children["a"] is a
        assert os.getsid(a.pid) == a.pid  # in a session of its own, as asked
    assert log.read_text().split() == ["out", "err", "''"]
    assert a.returncode == -signal.SIGTERM and b.returncode == -signal.SIGKILL and list(children) == []


# ----------------------------------------------------------------------------- the owner, with stand-ins
class _Stub(subprocess.Popen):
    """A child that only records what is done to it (the fast tier starts no process)."""

    events: list[str] = []

    def __init__(self, argv, **popen) -> None:
        if argv[0] == "fail":
            raise FileNotFoundError(argv[0])
        self.args, self.popen, self.returncode = argv, popen, None

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is not None:
            self.events.append(f"reaped {self.args[0]}")
        return self.returncode

    def terminate(self) -> None:
        self.events.append(f"term {self.args[0]}")
        self.returncode = -signal.SIGTERM

    def kill(self) -> None:  # pragma: no cover - every stand-in ends on SIGTERM
        self.returncode = -signal.SIGKILL


@pytest.fixture
def stub(monkeypatch) -> list[str]:
    _Stub.events = []
    monkeypatch.setattr(subprocess, "Popen", _Stub)
    return _Stub.events


def test_children_are_stopped_last_started_first_and_close_twice_does_nothing(stub) -> None:
    children = Children(1.0)
    procs = [children.start(k, [k]) for k in ("host", "device", "orchestrator")]
    assert all(p.popen["stdin"] is subprocess.DEVNULL for p in procs)
    children.close()
    terms = [e for e in stub if e.startswith("term")]
    assert terms == ["term orchestrator", "term device", "term host"]
    # All signalled before any is waited for: one grace for them all.
    assert max(stub.index(t) for t in terms) < min(i for i, e in enumerate(stub) if e.startswith("reaped"))
    stub.clear()
    children.close()
    assert stub == [] and list(children) == []


def test_a_failure_starting_the_third_stops_the_first_two(stub) -> None:
    with pytest.raises(FileNotFoundError):
        with Children(1.0) as children:
            first, second = children.start("a", ["a"]), children.start("b", ["b"])
            children.start("c", ["fail"])
    assert [e for e in stub if e.startswith("term")] == ["term b", "term a"]
    assert first.returncode == second.returncode == -signal.SIGTERM and "c" not in children


def test_a_key_is_started_once_until_it_is_forgotten_and_stop_leaves_the_others(stub) -> None:
    children = Children(1.0)
    children.start("a", ["a"])
    children.start("b", ["b"])
    with pytest.raises(ValueError, match="already started"):
        children.start("a", ["a"])
    children.stop(["a"], asked=False)
    assert children["a"].returncode == -signal.SIGTERM and children["b"].poll() is None and "a" in children
    children.forget("a")
    assert "a" not in children and list(children) == ["b"]
    children.start("a", ["a"])  # again, under the same key
    children.close()
    assert [e for e in stub if e.startswith("term")] == ["term a", "term a", "term b"]
