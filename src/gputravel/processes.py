"""The one way a child process is stopped: asked, then SIGTERM, then SIGKILL, and always reaped.

Every launcher (the local supervisor, the services and their parties, the Flower deployment,
the ranks, the benchmarks' helpers) goes through :func:`stop_processes`, so a child never
outlives its launcher and none is left a zombie, whatever state it is in.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess
import time
from collections.abc import Iterable
from typing import Union

__all__ = ["Child", "stop_process", "stop_processes"]

Child = Union[subprocess.Popen, multiprocessing.process.BaseProcess]


def _alive(proc: Child) -> bool:
    if isinstance(proc, subprocess.Popen):
        return proc.poll() is None
    return proc.pid is not None and proc.is_alive()  # a Process never started has no pid


def _wait(proc: Child, timeout: float | None) -> None:
    if isinstance(proc, subprocess.Popen):
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    elif proc.pid is not None:
        proc.join(timeout=timeout)


def _wait_all(procs: list[Child], grace: float) -> list[Child]:
    """Wait for all of them within one `grace`; those still alive."""
    deadline = time.monotonic() + grace
    for proc in procs:
        _wait(proc, max(0.0, deadline - time.monotonic()))
    return [p for p in procs if _alive(p)]


def stop_processes(procs: Iterable[Child], grace: float, *, asked: bool = False) -> None:
    """Stop every process of `procs` and reap it; never raises. `asked`: the caller has already
    told them to stop (a Shutdown message, a closed link), so each first gets `grace` to end by
    itself; then SIGTERM and `grace` more; then SIGKILL."""
    alive = [p for p in procs if _alive(p)]
    if asked:
        alive = _wait_all(alive, grace)
    for proc in alive:
        proc.terminate()
    for proc in _wait_all(alive, grace):
        proc.kill()
        _wait(proc, None)


def stop_process(proc: Child, grace: float, *, asked: bool = False) -> int | None:
    """:func:`stop_processes` for one; its exit status."""
    stop_processes([proc], grace, asked=asked)
    _wait(proc, None)
    return proc.returncode if isinstance(proc, subprocess.Popen) else proc.exitcode
