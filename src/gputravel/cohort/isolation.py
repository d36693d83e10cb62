"""Each party of a local cohort under its own unprivileged uid, non-dumpable (what stands for TDX
here): no party can ptrace or read through /proc another's memory, descriptors or files. Without
root the cohort runs as one user and says so. Children reach the cohort directory through a
descriptor (/proc/self/fd/N), and an interpreter under a closed directory through a tmpfs of binds.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import gputravel
from gputravel.device.memory import COPY_ENGINE_TUNABLES
from gputravel.errors import BadInput

# far above any distribution's users; a block of 1024 uids per cohort: up to 1023 parties
UID_LOW, UID_HIGH, BLOCK = 0x4000_0000, 0x7FFF_0000, 1024
_PR_SET_PDEATHSIG, _PR_GET_PDEATHSIG, _PR_SET_DUMPABLE = 1, 2, 4
_CLONE_NEWNS, _CLONE_NEWNET = 0x20000, 0x40000000
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 1 << 14, 1 << 18


@dataclass(frozen=True)
class PartyIsolation:
    uid: int
    gid: int
    groups: tuple[int, ...]
    dumpable: bool | None  # None: a root process, whose /proc files do not tell


@dataclass
class Isolation:
    on: bool
    reason: str = ""
    parties: dict[str, PartyIsolation] = field(default_factory=dict)

    @property
    def uids(self) -> dict[str, int]:
        return {k: p.uid for k, p in self.parties.items()}

    def summary(self) -> dict:
        return {"on": self.on, "reason": self.reason,
                "parties": {k: {"uid": p.uid, "dumpable": p.dumpable} for k, p in self.parties.items()}}


def make_nondumpable() -> None:
    """Each child's first step: its /proc/PID/mem, maps and fd become root-only, even to its own uid."""
    _check(_libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE, 0) failed")


def decide(isolate: bool | None) -> tuple[bool, str]:
    """Whether to isolate (auto: whenever root), and if not, why."""
    if isolate is False:
        return False, "turned off by CohortConfig.isolate=False"
    if os.geteuid() != 0:
        if isolate:
            raise BadInput("CohortConfig.isolate=True needs root: the launcher gives each party its own uid")
        return False, f"the launcher is not root (uid {os.geteuid()}), so every party runs as that one user"
    return True, ""


def read_party(pid: int) -> PartyIsolation:
    """A child's real ids and dumpability from /proc (a non-dumpable process's files belong to root)."""
    status = Path(f"/proc/{pid}/status")
    fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
    uid, gid = int(fields["Uid"].split()[0]), int(fields["Gid"].split()[0])
    groups = tuple(int(g) for g in fields["Groups"].split())
    return PartyIsolation(uid, gid, groups, dumpable=None if uid == 0 else status.stat().st_uid == uid)


def unavailable() -> str:
    """Why a cohort started now in auto mode would run without isolation ("": it would not)."""
    on, reason = decide(None)
    if not on:
        return reason
    try:
        interpreter_reach()
    except BadInput as exc:
        return f"this Python cannot run under another uid: {exc}"
    return ""


# ----------------------------------------------------------------------------- uids
def allocate_block() -> int:
    """The first uid of a random block of BLOCK ids no process uses (another cohort's shows as its uids)."""
    used = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            for line in status.read_text().splitlines():
                if line.startswith(("Uid:", "Gid:")):
                    used.update(int(v) for v in line.split()[1:])
        except (OSError, ValueError):
            continue  # the process ended while we looked
    for _ in range(100):
        base = secrets.randbelow((UID_HIGH - UID_LOW) // BLOCK) * BLOCK + UID_LOW
        if not used.intersection(range(base, base + BLOCK)):
            return base
    raise BadInput("no free uid block for the cohort's parties")


# ----------------------------------------------------------------------------- reaching the interpreter
def _closed(path: str | Path) -> list[Path]:
    """The directories on the way to `path` (and `path`, if one) that others cannot search, top down."""
    p = Path(path)
    walk = [*list(reversed(p.parents))[1:], *([p] if p.is_dir() else [])]
    return [d for d in walk if not os.stat(d).st_mode & stat.S_IXOTH]


def _needed_paths() -> list[str]:
    paths = [sys.executable, sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(gputravel.__file__),
             *(p for p in sys.path if p and os.path.isdir(p)),
             *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.isdir(p))]
    return paths + [os.path.realpath(p) for p in paths]


def interpreter_reach() -> dict[str, tuple[str, ...]]:
    """Closed directories on the way to this interpreter and its packages, with the entries under
    each a child needs; BadInput where a tmpfs cannot help (a second closed one further down)."""
    cover: dict[str, set[str]] = {}
    for path in _needed_paths():
        closed = _closed(path)
        if not closed:
            continue
        top = closed[0]
        if len(closed) > 1:
            raise BadInput(f"other users cannot reach {path} (closed: {', '.join(map(str, closed))})")
        entries = os.listdir(top) if top == Path(path) else [Path(path).relative_to(top).parts[0]]
        cover.setdefault(str(top), set()).update(entries)
    return {d: tuple(sorted(e)) for d, e in cover.items()}


# ----------------------------------------------------------------------------- dropping privileges
_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise OSError(ctypes.get_errno(), what)


def _cover(reach: dict[str, tuple[str, ...]]) -> None:
    """In a private mount namespace: a tmpfs over each closed directory, binding only what Python needs."""
    _check(_libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(_libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    for top, entries in reach.items():
        # Opened in the new namespace: a bind's source must be a mount of our own namespace.
        keep = {e: os.open(os.path.join(top, e), os.O_PATH) for e in entries}
        _check(_libc.mount(b"tmpfs", top.encode(), b"tmpfs", 0, b"mode=0711"), f"mount tmpfs on {top}")
        for entry, fd in keep.items():
            target = os.path.join(top, entry)
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.mkdir(target)
            else:
                os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o600))
            src = f"/proc/self/fd/{fd}".encode()
            _check(_libc.mount(src, target.encode(), None, _MS_BIND | _MS_REC, None), f"bind {target}")
            os.close(fd)


def dropper(uid: int, *, netns: str | None, reach: dict[str, tuple[str, ...]]) -> Callable[[], None]:
    """A Popen preexec_fn: while root, enter the namespace and cover closed directories; drop to
    `uid` (no groups); then ask to die with the launcher (a change of credentials clears that)."""

    def run() -> None:
        if netns is not None:
            fd = os.open(netns, os.O_RDONLY)
            _check(_libc.setns(fd, _CLONE_NEWNET), f"setns {netns}")
            os.close(fd)
        if reach:
            _cover(reach)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        die_with_parent()

    return run


def die_with_parent() -> None:
    """A Popen preexec_fn step: the child is killed if the launcher dies, even outright."""
    _check(_libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def parent_death_signal() -> int:
    sig = ctypes.c_int(0)
    _check(_libc.prctl(_PR_GET_PDEATHSIG, ctypes.byref(sig), 0, 0, 0), "prctl(PR_GET_PDEATHSIG)")
    return sig.value


def rearm_parent_death(sig: int, parent: int) -> None:
    """Changing ids clears the parent-death signal: set `sig` again, and act on it now if `parent` died meanwhile."""
    if sig:
        _check(_libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)


def private_env(home: str) -> dict[str, str]:
    return {"HOME": home, "XDG_CACHE_HOME": f"{home}/.cache", "XDG_CONFIG_HOME": f"{home}/.config",
            "MPLCONFIGDIR": f"{home}/.config/matplotlib", "TORCHINDUCTOR_CACHE_DIR": f"{home}/.cache/torchinductor",
            "TRITON_CACHE_DIR": f"{home}/.cache/triton"}


def party_env(role: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default ours), plus the device's copy-engine glibc tunables, read only at its start. Safe
    path: `python -m` would put the working directory first on sys.path, where a module planted there
    would run as the party (root's children included)."""
    out = dict(os.environ if env is None else env)
    out["PYTHONSAFEPATH"] = "1"
    if role == "device":
        out["GLIBC_TUNABLES"] = ":".join(filter(None, (out.get("GLIBC_TUNABLES"), COPY_ENGINE_TUNABLES)))
    return out


# ----------------------------------------------------------------------------- files
def give(path: Path, uid: int, mode: int | None = None) -> None:
    """Hand a tree to `uid`, following no link: one at `path` is refused, one inside is handed itself."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)  # ELOOP for a link
    try:
        os.fchown(fd, uid, uid)
        if mode is not None:
            os.fchmod(fd, mode)
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            # By descriptor (fwalk): a party that swaps a directory for a link mid-walk must not
            # send root's chown through it, as a path walk would.
            for _, dirs, files, dirfd in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
                for name in dirs + files:
                    os.chown(name, uid, uid, dir_fd=dirfd, follow_symlinks=False)
    finally:
        os.close(fd)


def readable_by_others(path: Path) -> Path | None:
    """The first item of a dataset another uid cannot read (its ancestors do not count), or None."""
    items = [path, *(path.iterdir() if path.is_dir() else ())]
    for item in items:
        st = item.stat()
        need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(st.st_mode) else 0)
        if st.st_mode & need != need:
            return item
    return None


def unreachable(path: Path) -> Path | None:
    """The first directory on the way to `path` other uids cannot search, or None."""
    closed = _closed(Path(path).resolve())
    return closed[0] if closed else None
