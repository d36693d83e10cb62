"""The one way a child process is started and owned (:class:`Children`), and the one way it is
stopped: asked, then SIGTERM, then SIGKILL, and always reaped, so none outlives its launcher.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Union

__all__ = ["Child", "Children", "stop_process", "stop_processes"]

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
    deadline = time.monotonic() + grace
    for proc in procs:
        _wait(proc, max(0.0, deadline - time.monotonic()))
    return [p for p in procs if _alive(p)]


def stop_processes(procs: Iterable[Child], grace: float, *, asked: bool = False) -> None:
    """Stop and reap every one of `procs`; never raises. `asked`: they were told to stop (a Shutdown,
    a closed link), so first get `grace` to end by themselves; then SIGTERM, `grace`, SIGKILL."""
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


class Children:
    """The child processes one launcher owns, by key, all stopped and reaped at :meth:`close`, last
    started first (a context manager), all sharing one grace; a launcher that needs one stopped
    before the others (a service that checkpoints) stops it first with :meth:`stop`."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self._procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}  # where each child started with a log writes

    def start(self, key: str, argv: Sequence[str], *, log: Path | None = None, **popen: Any) -> subprocess.Popen:
        """Start `argv` as `key` (stdin /dev/null unless `popen` says; with `log`, its stdout and stderr
        go to that file, made anew). Other Popen arguments pass as given: isolation is the caller's."""
        if key in self._procs:
            raise ValueError(f"a child {key!r} was already started")
        popen.setdefault("stdin", subprocess.DEVNULL)
        if log is None:
            proc = subprocess.Popen(argv, **popen)
        else:
            with open(log, "wb") as out:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, **popen)
            self.logs[key] = log
        self._procs[key] = proc
        return proc

    def __getitem__(self, key: str) -> subprocess.Popen:
        return self._procs[key]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._procs))

    def stop(self, keys: Iterable[str], *, asked: bool = False) -> None:
        """Stop these children together; they stay known, ended."""
        stop_processes([self._procs[k] for k in keys if k in self._procs], self.grace, asked=asked)

    def forget(self, key: str) -> None:
        """Stop `key` if it still runs, and drop it (it may be started again)."""
        proc = self._procs.pop(key)
        self.logs.pop(key, None)
        stop_process(proc, self.grace)

    def close(self, *, asked: bool = False) -> None:
        """Stop every child and forget them all; never raises; a second call does nothing."""
        stop_processes(list(reversed(self._procs.values())), self.grace, asked=asked)
        self._procs.clear()
        self.logs.clear()

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
