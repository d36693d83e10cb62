"""Start data-parallel ranks (or any few processes) and collect one result from each.

The benchmark, the red team's all-reduce row and the tests each run ranks as child
processes; this is the one launcher they share. Each process runs `target(*args)` and sends
back what it returns, or what it raised; the parent waits for every answer, names a process
that raised, died without a word or stayed silent past the deadline, and ends every process
it started, whatever happens.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence

from gputravel.processes import stop_processes
from gputravel.errors import PeerTimeout, RemoteError

POLL_S = 0.5  # how often the parent looks for a process that died without a word


class ProcessFailed(RemoteError):
    """A process raised: `name` says which, `error` is its exception as ``Type: message``, and
    `details` its traceback (kept out of the message: the caller decides whether to show it)."""

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
    """Run each `(target, args)` in a process of its own; return what each returned, in order.

    `target` must be importable by name (a module-level function). `method` is the start
    method; `preload` the modules a forkserver imports once, so that each start is a fork.
    Raises ProcessFailed at the first process that raised, ProcessesSilent when some died
    without a word or were silent for `timeout` seconds; every process is joined for up to
    `grace` seconds, then killed."""
    names = list(names) if names is not None else [f"process {i}" for i in range(len(targets))]
    if len(names) != len(targets):
        raise ValueError("run_processes needs one name per target")
    ctx = multiprocessing.get_context(method)
    if preload:
        ctx.set_forkserver_preload(list(preload))
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(i, target, args, results), daemon=True)
             for i, (target, args) in enumerate(targets)]
    try:
        for p in procs:
            p.start()
        got = _collect(procs, results, names, timeout)
    finally:
        _end(procs, grace)
        results.close()
    return [got[i] for i in range(len(procs))]


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


def _end(procs: list, grace: float) -> None:
    """Each has ended or been told to (a result sent, or the job failed): `grace` to end by
    itself, then SIGTERM, then SIGKILL."""
    stop_processes(procs, grace, asked=True)


def _child(index: int, target: Callable, args: tuple, results) -> None:
    """In the process: run the target and send what it returned or raised."""
    try:
        answer = (index, "ok", target(*args), "")
    except BaseException as err:  # reported to the parent, which raises ProcessFailed
        answer = (index, "error", f"{type(err).__name__}: {err}", traceback.format_exc())
    results.put(answer)
    # A rank whose ring broke can leave threads waiting on receives that never complete, and
    # tearing the process down under them can wait for them. The parent has the answer: go.
    results.close()
    results.join_thread()
    os._exit(0)
