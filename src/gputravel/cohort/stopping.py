"""How a launcher stops, whatever stops it, leaving no party process and no key behind.

A launcher (cohort/supervisor.py for a local cohort, service/launch.py for the deployed
services) owns a directory with its parties' keys in it and a process per party. Three ways
it can be stopped, and what each needs:

- **Ctrl-C** (SIGINT) raises KeyboardInterrupt in the launcher, which unwinds and stops its
  parties in order. The parties run in sessions of their own (`start_new_session`), so a
  terminal's Ctrl-C, or a `timeout` signalling its process group, reaches the launcher alone:
  otherwise every party got it at once and none was stopped in order.
- **SIGTERM or SIGHUP** would end the launcher without unwinding (their default), leaving its
  directory, keys and all. While it runs, :func:`catch_term` makes them unwind like Ctrl-C.
- **SIGKILL** runs nothing of the launcher: its parties die with it (PDEATHSIG,
  cohort/isolation.die_with_parent) and the next launcher deletes what it left
  (:func:`claim`, :func:`sweep`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from gputravel.errors import Terminated
from gputravel.files import read_plain

__all__ = ["LAUNCHER_PID", "catch_term", "claim", "sweep", "uninterrupted"]

LAUNCHER_PID = "launcher.pid"  # in a launcher's directory: whose it is
_UNWINDING = (signal.SIGTERM, signal.SIGHUP)


def catch_term(what: str) -> Callable[[], None]:
    """While a launcher runs, SIGTERM and SIGHUP raise Terminated(`what`) in its main thread,
    which unwinds it as Ctrl-C does. Returns what puts the handlers back. A signal someone
    already handles (an outer launcher, the caller) is left to them."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def term(signum: int, frame: object) -> None:
        raise Terminated(f"stopped by {signal.Signals(signum).name}; {what}")

    ours = [sig for sig in _UNWINDING if signal.getsignal(sig) is signal.SIG_DFL]
    for sig in ours:
        signal.signal(sig, term)

    def undo() -> None:
        for sig in ours:
            signal.signal(sig, signal.SIG_DFL)
        ours.clear()

    return undo


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """A launcher's teardown: a second Ctrl-C or a SIGTERM meanwhile cannot cut it short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, *_UNWINDING)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def claim(directory: Path) -> None:
    """Mark a launcher's new directory as this process's, for :func:`sweep`."""
    (directory / LAUNCHER_PID).write_text(f"{os.getpid()}\n")


def sweep(workdir: str | None, prefix: str) -> None:
    """Delete the directories (named `prefix`*) of launchers that are gone: killed outright,
    nothing of theirs ran to delete them, with the keys in them. Only directories of this
    user, claimed by a process that no longer exists; never what a link points to (another
    user's link in /tmp to a directory of ours)."""
    for d in Path(workdir or tempfile.gettempdir()).glob(prefix + "*"):
        with contextlib.suppress(OSError, ValueError):
            st = d.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            pid = int(read_plain(d / LAUNCHER_PID, 32))
            if not Path(f"/proc/{pid}").exists():
                shutil.rmtree(d, ignore_errors=True)
