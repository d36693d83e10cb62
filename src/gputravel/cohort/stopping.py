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
  cohort/isolation.die_with_parent) and the next launcher deletes what it left. A launcher
  holds a lock on its directory's `launcher.pid` for as long as it lives (:func:`claim`); the
  kernel lets go of it when the process dies, however it dies, so :func:`sweep` deletes a
  directory only when it can take that lock: never a live launcher's, in whatever pid
  namespace it runs, and always a dead one's, whatever became of its pid.

Deleting (:func:`remove_tree`) goes through `rm`, which walks a tree of any depth without
following links: a party can nest directories in its own deeper than Python's recursion
limit, which `shutil.rmtree` of Python 3.11 does not survive. The keys go first and the lock
file last, so a deletion cut short is still a directory the next sweep finds.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from gputravel.errors import Terminated

__all__ = ["LAUNCHER_PID", "catch_term", "claim", "release", "remove_tree", "sweep", "uninterrupted"]

LAUNCHER_PID = "launcher.pid"  # in a launcher's directory: whose it is, locked while it lives
KEYS_FIRST = ("pki", "trust", "state")  # where the parties' keys and trust material lie
_UNWINDING = (signal.SIGTERM, signal.SIGHUP)
_RM_TIMEOUT_S = 120.0

# ----------------------------------------------------------------------------- signals
_lock = threading.Lock()
_catching = {"launchers": 0, "what": ""}  # launchers open in this process that unwind on a signal


def _term(signum: int, frame: object) -> None:
    if not _catching["launchers"]:  # every launcher closed (one off the main thread): as if unset
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise Terminated(f"stopped by {signal.Signals(signum).name}; {_catching['what']}")


def catch_term(what: str) -> Callable[[], None]:
    """While a launcher runs, SIGTERM and SIGHUP raise Terminated(`what`) in the main thread,
    which unwinds it as Ctrl-C does. Returns what ends that for this launcher: once every
    launcher that asked has ended it, the signals act as before. A handler someone else set
    (the caller, an outer deployment) is left to them."""
    with _lock:
        main = threading.current_thread() is threading.main_thread()
        ours = main and all(signal.getsignal(sig) in (signal.SIG_DFL, _term) for sig in _UNWINDING)
        if not ours:
            return lambda: None
        for sig in _UNWINDING:
            signal.signal(sig, _term)
        _catching["launchers"] += 1
        _catching["what"] = what
    done = threading.Event()

    def undo() -> None:
        with _lock:
            if done.is_set():
                return
            done.set()
            _catching["launchers"] -= 1
            if not _catching["launchers"] and threading.current_thread() is threading.main_thread():
                for sig in _UNWINDING:
                    signal.signal(sig, signal.SIG_DFL)

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


# ----------------------------------------------------------------------------- directories
_held: dict[Path, int] = {}  # directory -> the locked descriptor of its launcher.pid


def claim(directory: Path) -> None:
    """Mark a launcher's new directory as this process's for as long as it lives: its pid in
    `launcher.pid`, locked. The file is locked before it takes its name, so no sweep ever
    finds it unlocked while this process lives."""
    staging = directory / f".{LAUNCHER_PID}.new"
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{os.getpid()}\n".encode())
    os.rename(staging, directory / LAUNCHER_PID)
    _held[directory] = fd


def release(directory: Path) -> None:
    """Let go of a directory's lock (after it is deleted, or to leave it to the sweep)."""
    fd = _held.pop(directory, None)
    if fd is not None:
        os.close(fd)


def sweep(workdir: str | None, prefix: str) -> None:
    """Delete the directories (named `prefix`*) of launchers that are gone: killed outright,
    nothing of theirs ran to delete them, with the keys in them. Only a real directory of this
    user, whose `launcher.pid` is a plain file no live launcher holds locked; never what a
    link points to. Whatever one directory does, the others are still looked at."""
    for d in Path(workdir or tempfile.gettempdir()).glob(prefix + "*"):
        try:
            st = d.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or d in _held:
                continue
            fd = os.open(d / LAUNCHER_PID, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue  # not a launcher's, or not claimed yet
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: its launcher lives
            remove_tree(d)
        except Exception:  # noqa: BLE001 - one directory we cannot judge or delete stops no launch
            continue
        finally:
            os.close(fd)


def remove_tree(d: Path) -> bool:
    """Delete `d` and everything in it, of any depth, following no link: the keys first, the
    lock file last. Whether it is gone; what could not be deleted is said on stderr. Never
    raises."""
    try:
        entries = sorted(os.listdir(d), key=lambda name: (name not in KEYS_FIRST, name == LAUNCHER_PID))
    except FileNotFoundError:
        return True
    except OSError as exc:
        entries = []
        print(f"gputravel: could not list {d}: {exc.strerror or exc}", file=sys.stderr)
    for batch in ([e for e in entries if e in KEYS_FIRST], [e for e in entries if e not in KEYS_FIRST], ["."]):
        if not batch:
            continue
        # "--one-file-system": a mount a party made under its directory is not descended into.
        argv = ["rm", "-rf", "--one-file-system", "--", *(str(d / e) for e in batch)] if batch != ["."] \
            else ["rm", "-rf", "--one-file-system", "--", str(d)]
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=_RM_TIMEOUT_S, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            print(f"gputravel: could not delete {d}: {exc}", file=sys.stderr)
            return False
        if done.returncode and batch == ["."]:
            print(f"gputravel: could not delete all of {d}: {done.stderr.strip()[-500:]}", file=sys.stderr)
    return not os.path.lexists(d)
