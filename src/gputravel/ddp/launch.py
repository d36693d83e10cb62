"""Start data-parallel ranks (or any few processes) and collect one result from each: the
one launcher the benchmark, the red team and the tests share. It names a process that raised,
died without a word or stayed silent, and ends every process it started, whatever happens.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Sequence

from gputravel.processes import stop_processes
from gputravel.errors import PeerTimeout, RemoteError

POLL_S = 0.5  # how often the parent looks for a process that died without a word


class ProcessFailed(RemoteError):
    """A process raised: `error` is ``Type: message``, `details` its traceback (kept out of the message)."""

    def __init__(self, name: str, error: str, details: str = "") -> None:
        super().__init__(f"{name} failed: {error}")
        self.name, self.error, self.details = name, error, details


class ProcessesSilent(PeerTimeout):
    """Processes gave no answer: they died without one, or said nothing before the deadline."""

    def __init__(self, what: str, names: Sequence[str]) -> None:
        super().__init__(what)
        self.names = tuple(names)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(targets: Sequence[tuple[Callable, tuple]], timeout: float, *, names: Sequence[str] | None = None,
                  method: str = "spawn", preload: Sequence[str] = (), grace: float = 10.0) -> list:
    """Run each `(target, args)` (a module-level function) in a process of its own; return what
    each returned, in order. `preload`: the modules a forkserver imports once. Raises ProcessFailed
    or ProcessesSilent; every process gets `grace` seconds to end, then is killed."""
    names = list(names) if names is not None else [f"process {i}" for i in range(len(targets))]
    if len(names) != len(targets):
        raise ValueError("run_processes needs one name per target")
    ctx = multiprocessing.get_context(method)
    if preload:
        ctx.set_forkserver_preload(list(preload))
    with _safe_path():  # the queue starts the resource tracker; the first start, a forkserver
        results = ctx.Queue()
        procs = [ctx.Process(target=_child, args=(i, target, args, results), daemon=True)
                 for i, (target, args) in enumerate(targets)]
    try:
        with _safe_path():
            for p in procs:
                p.start()
        got = _collect(procs, results, names, timeout)
    finally:
        stop_processes(procs, grace, asked=True)  # each has sent its result, or the job failed
        results.close()
    return [got[i] for i in range(len(procs))]


@contextlib.contextmanager
def _safe_path() -> Iterator[None]:
    """Children started meanwhile never put the working directory on sys.path: multiprocessing starts
    them with `python -c`, which would, and they import multiprocessing before it sets their path."""
    before = os.environ.get("PYTHONSAFEPATH")
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONSAFEPATH"]
        else:
            os.environ["PYTHONSAFEPATH"] = before


def _collect(procs: list, results, names: Sequence[str], timeout: float) -> dict[int, object]:
    got: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(procs):
        # Who had ended before this drain: whatever they sent is already in the pipe.
        ended = [i for i, p in enumerate(procs) if i not in got and p.exitcode is not None]
        _drain(results, got, names, min(POLL_S, max(0.0, deadline - time.monotonic())))
        dead = [i for i in ended if i not in got]
        if dead:
            said = ", ".join(f"{names[i]} (exit code {procs[i].exitcode})" for i in dead)
            raise ProcessesSilent(f"{said} died without a word", [names[i] for i in dead])
        if len(got) < len(procs) and time.monotonic() >= deadline:
            silent = [names[i] for i in range(len(procs)) if i not in got]
            raise ProcessesSilent(f"{', '.join(silent)} of {len(procs)} said nothing within {timeout:g} s (hung)",
                                  silent)
    return got


def _drain(results, got: dict[int, object], names: Sequence[str], wait: float) -> None:
    """Take every answer waiting (the first for up to `wait` seconds); raise at a failure."""
    while True:
        try:
            index, status, value, details = results.get(timeout=wait) if wait > 0 else results.get_nowait()
        except queue.Empty:
            return
        if status == "error":
            raise ProcessFailed(names[index], value, details)
        got[index] = value
        wait = 0.0


def _child(index: int, target: Callable, args: tuple, results) -> None:
    try:
        answer = (index, "ok", target(*args), "")
    except BaseException as err:  # reported to the parent, which raises ProcessFailed
        answer = (index, "error", f"{type(err).__name__}: {err}", traceback.format_exc())
    results.put(answer)
    # A broken ring can leave threads on receives that never complete: the parent has the answer, go.
    results.close()
    results.join_thread()
    os._exit(0)
