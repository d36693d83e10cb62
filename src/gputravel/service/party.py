"""What every `gputravel serve ...` shares: logs, waiting for peers, and the one party process
a service launches, as the supervisor would for that party alone; it holds no other's secret.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from gputravel.cohort import isolation
from gputravel.cohort.client import error_from
from gputravel.cohort.entry import jsonable
from gputravel.crypto.pki import MAX_PEM_BYTES
from gputravel.files import atomic_write_bytes, read_plain
from gputravel.errors import BadInput, GputravelError, RemoteError
from gputravel.processes import stop_process
from gputravel.protocol.control import Enroll, Failed, Ready, Shutdown
from gputravel.transport.stream import StreamTransport

ENTRY = "gputravel.cohort.entry"
BOOT_TIMEOUT = 120.0  # a party's process started and ready (its first words: PartyChild.ready)


def log(party: str, event: str, **fields: object) -> None:
    """One JSON line on stderr per event. Callers pass names, paths and counts, never a key."""
    line = {"ts": round(time.time(), 3), "party": party, "event": event, **fields}
    # One write of the line and its newline: print() writes them apart, so two threads or processes
    # sharing stderr could put two events on one line (seen under load: a JSON line that would not parse).
    sys.stderr.write(json.dumps(line, default=str) + "\n")
    sys.stderr.flush()


def wait_for(party: str, what: str, ready: Callable[[], bool], stop: Callable[[], bool],
             every: float = 0.2, say_every: float = 5.0) -> None:
    """Poll ``ready`` until it holds, saying now and then what we wait for; BadInput if stopped."""
    said = 0.0
    while not ready():
        if stop():
            raise BadInput(f"stopped while waiting for {what}")
        if time.monotonic() - said >= say_every:
            log(party, "waiting", waiting_for=what)
            said = time.monotonic()
        time.sleep(every)


def unix_listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False
    return True


class Stopping:
    """SIGTERM and SIGINT set a flag the service reads between steps (a clean shutdown)."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "requested", True))

    def __call__(self) -> bool:
        return self.requested


STOP_BY = ("shutdown", "close", "terminate")  # how a party is told to stop (PartyChild)


class PartyChild:
    """The party's process (cohort/entry.py), its output on this service's stderr."""

    def __init__(self, role: str, config: dict, *, extra: socket.socket | None = None,
                 stop_by: str = "shutdown", uid: int = -1, home: Path | None = None) -> None:
        if stop_by not in STOP_BY:
            raise BadInput(f"stop_by is one of {', '.join(STOP_BY)}, not {stop_by!r}")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds = [theirs.fileno()] + ([extra.fileno()] if extra is not None else [])
        payload = json.dumps(config, default=jsonable)
        argv = [sys.executable, "-m", ENTRY, role, payload, *map(str, fds)]
        popen = _as_account(uid, home)
        popen["env"] = isolation.party_env(role, popen.get("env"))
        self.proc = subprocess.Popen(argv, pass_fds=fds, stdin=subprocess.DEVNULL, **popen)
        theirs.close()
        self.role = role
        self.control = StreamTransport(ours, role)
        # "shutdown": a member reads Shutdown; "close": the TDX module ends with its link;
        # "terminate": the host and device never read theirs after Ready, so SIGTERM at once.
        self._stop_by = stop_by

    def ready(self, timeout: float, certify: Callable[[Enroll], None] | None = None) -> Ready:
        """Its first words: an enrolment (``certify`` answers it), then Ready or Failed."""
        try:
            msg = self.control.recv(timeout=timeout).message
            if isinstance(msg, Enroll):
                if certify is None:
                    raise RemoteError(f"the {self.role} asked to be certified; nothing here certifies it")
                certify(msg)
                msg = self.control.recv(timeout=timeout).message
        except GputravelError as exc:
            raise RemoteError(f"the {self.role} failed to start: {exc}") from None
        if isinstance(msg, Failed):
            raise error_from(msg, f"the {self.role} failed to start")  # typed, as the supervisor raises it
        if not isinstance(msg, Ready):
            raise RemoteError(f"the {self.role} sent {type(msg).__name__} instead of ready")
        return msg

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 5.0) -> int:
        """Shutdown, then terminate, then kill: it never outlives its service."""
        with contextlib.suppress(GputravelError):
            if self._stop_by == "shutdown":
                self.control.send(Shutdown())
            else:
                self.control.close()
        return stop_process(self.proc, grace, asked=self._stop_by != "terminate")

    def close(self) -> None:
        if self.alive():
            self.stop()
        self.control.close()


def _as_account(uid: int, home: Path | None) -> dict:
    """Popen arguments: the party under its own uid, non-dumpable, its own HOME (-1: as we run)."""
    if uid < 0:
        return {"preexec_fn": isolation.die_with_parent}
    if os.geteuid() != 0:
        raise BadInput(f"the config names uid {uid} for this party: start its service as root")
    assert home is not None
    env = {**os.environ, **isolation.private_env(str(home)), "GPUTRAVEL_NONDUMPABLE": "1"}
    return {"preexec_fn": isolation.dropper(uid, netns=None, reach=isolation.interpreter_reach()), "env": env,
            "cwd": str(home)}


def own_state(state: Path, uid: int) -> Path:
    """A party's state directory is all its account's (0700): nothing of root's lies in it."""
    if uid >= 0:
        isolation.give(state, uid, 0o700)
    return state


def refuse_planted(state: Path, uid: int) -> None:
    """As root, before a holder's or the key broker's state is handed to it: nothing in it that its own
    account did not make, so it never adopts a key someone else made and kept a copy of (the review of
    per-party identities planted both before their first start). One account for all: nothing to tell."""
    if uid < 0 or os.geteuid() != 0:
        return
    fd = os.open(state, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for root, dirs, files, dirfd in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
            for name in dirs + files:
                if os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_uid != uid:
                    found = Path(state) / root / name
                    raise BadInput(f"{os.path.normpath(found)} was not made by this party's account (uid {uid}): a "
                                   "party's state starts empty and holds only what it made; remove it and start again")
    finally:
        os.close(fd)


@contextlib.contextmanager
def as_party(uid: int) -> Iterator[None]:
    """Root acts inside a party's tree as that party (effective ids, no groups), so a link the
    party planted reaches only what the party may (issue 30's review: root wrote through such links)."""
    if uid < 0 or os.geteuid() != 0:
        yield
        return
    groups, death, parent = os.getgroups(), isolation.parent_death_signal(), os.getppid()
    try:  # inside the try: an interrupt between two of these still restores all three
        os.setgroups([])
        os.setegid(uid)
        os.seteuid(uid)
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
        os.setgroups(groups)
        # A change of effective ids clears the parent-death signal (test_service_launch's SIGKILL case).
        isolation.rearm_parent_death(death, parent)


def private_dir(path: str | Path) -> Path:
    """A state directory only its party reads (0700); a link the party left in its place is refused."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise BadInput(f"{p} is not a directory of its own ({exc.strerror}): remove it and start again") from None
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return p


MAX_PUBLISHED_BYTES = 256 << 20  # a travel log of a long job; a certificate is about 1 KiB


def publish(src: Path, dest: Path, uid: int = -1, limit: int = MAX_PUBLISHED_BYTES) -> bytes:
    """Publish `src` (read as the party, a plain file within `limit`) whole or not at all; its bytes."""
    with as_party(uid):
        data = read_plain(src, limit + 1)
    if len(data) > limit:
        raise BadInput(f"{src} is larger than the {limit} bytes such a file may be")
    atomic_write_bytes(dest, data)
    return data


def one_certificate(pem: bytes, name: str, where: Path) -> bytes:
    """`pem` as exactly one certificate of `name`, written anew: a member appending another's
    certificate to its own had the orchestrator pin both (issue 30's second review)."""
    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError:
        raise BadInput(f"{where} holds no certificate") from None
    names = [c.subject.get_attributes_for_oid(NameOID.COMMON_NAME) for c in certs]
    if len(certs) != 1 or len(names[0]) != 1 or names[0][0].value != name:
        raise BadInput(f"{where}: expected one certificate, of {name!r}; it holds {len(certs)}")
    return certs[0].public_bytes(serialization.Encoding.PEM)


def publish_certificate(src: Path, dest: Path, name: str, uid: int = -1) -> None:
    with as_party(uid):
        pem = read_plain(src, MAX_PEM_BYTES)
    atomic_write_bytes(dest, one_certificate(pem, name, src))


def wait_for_sockets(party: str, sockets: dict[str, str], stop: Callable[[], bool]) -> None:
    for what, path in sockets.items():
        wait_for(party, f"{what} at {path}", lambda p=path: unix_listening(p), stop)
