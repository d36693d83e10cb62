"""How a launcher stops, whatever stops it, leaving no party process and no key behind.

Ctrl-C unwinds it (its parties run in sessions of their own, so it alone gets it); SIGTERM
and SIGHUP are made to unwind the same (:func:`catch_term`); after a SIGKILL its parties die
with it (PDEATHSIG) and the next launcher sweeps its directory, once the lock the dead one
held on `launcher.pid` is free (docs/security.md, threat 50).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from gputravel.errors import Terminated

__all__ = ["LAUNCHER_PID", "catch_term", "claim", "delete", "release", "remove_tree", "sweep", "uninterrupted"]

LAUNCHER_PID = "launcher.pid"  # in a launcher's directory: whose it is, locked while it lives
KEYS_FIRST = ("pki", "trust", "state")  # where the parties' keys and trust material lie
_UNWINDING = (signal.SIGTERM, signal.SIGHUP)
_RM_TIMEOUT_S = 120.0
_RM = shutil.which("rm", path="/usr/bin:/bin") or "/bin/rm"  # never one a PATH entry put first

# ----------------------------------------------------------------------------- signals
_lock = threading.Lock()
_whats: list[str] = []  # what each launcher open in this process says it stopped, the latest last
_ours: set[signal.Signals] = set()  # the signals whose handler is _term


def _term(signum: int, frame: object) -> None:
    if not _whats:  # every launcher closed (one off the main thread): as if unset
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise Terminated(f"stopped by {signal.Signals(signum).name}; {_whats[-1]}")


def catch_term(what: str) -> Callable[[], None]:
    """While a launcher runs, SIGTERM and SIGHUP raise Terminated(`what`) in the main thread; the
    undo it returns puts them back once every launcher has undone. A signal someone else handles
    or ignores (`nohup`) is left to them."""
    with _lock:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        for sig in _UNWINDING:
            if signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, _term)
                _ours.add(sig)
        if not _ours:
            return lambda: None
        _whats.append(what)
    done = threading.Event()

    def undo() -> None:
        with _lock:
            if done.is_set():
                return
            done.set()
            del _whats[len(_whats) - 1 - _whats[::-1].index(what)]  # its text, the latest so said
            if not _whats and threading.current_thread() is threading.main_thread():
                for sig in _ours:
                    signal.signal(sig, signal.SIG_DFL)
                _ours.clear()

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
    """Claim a new launcher directory: `launcher.pid`, locked before it is named, so no sweep finds it unlocked."""
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
    """Delete the directories (`prefix`*) of launchers killed outright, keys and all: only a real
    directory of this user whose `launcher.pid` no live launcher holds locked; never a link."""
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


def delete(d: Path, wait: float = 0.0) -> bool:
    """Delete a launcher's directory (retrying for `wait` s; if not, said on stderr), release its lock."""
    deadline = time.monotonic() + wait
    while not (gone := remove_tree(d)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not gone:
        left = len(os.listdir(d)) if os.path.isdir(d) else 0
        print(f"gputravel: could not delete all of {d} ({left} entries left); the next launch deletes it",
              file=sys.stderr)
    release(d)
    return gone


def remove_tree(d: Path) -> bool:
    """Delete `d` whatever its depth (`rm`: a party may nest deeper than rmtree survives), keys
    first and the lock file last, so what is left is swept later. Whether it is gone; never raises."""
    try:
        entries = os.listdir(d)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    keys = [e for e in entries if e in KEYS_FIRST]
    rest = [e for e in entries if e not in KEYS_FIRST and e != LAUNCHER_PID]
    for batch in (keys, rest):
        if batch and not _rm([str(d / e) for e in batch]):
            return False
    try:
        if any(e != LAUNCHER_PID for e in os.listdir(d)):
            return False
    except OSError:
        return False
    return _rm([str(d)]) and not os.path.lexists(d)


def _rm(paths: list[str]) -> bool:
    # "--one-file-system": a mount a party made under its own directory is not descended into.
    try:
        done = subprocess.run([_RM, "-rf", "--one-file-system", "--", *paths], stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=_RM_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0
