"""The emulated TDX module and quoting enclave as its own OS process: a TD cannot choose its own
measurement. It makes its quoting key itself (the launcher certifies it, then drops its root
key), learns from the launcher alone which CVM it launched and that CVM's measurement, and
quotes only for the connection whose SO_PEERCRED pid and uid are that very process's (a pidfd
and its start time, so a recycled pid is not it). A CVM sends report data only, or a digest to
extend one of its runtime measurement registers with (RTMR 2 or 3, as TDX's TDG.MR.RTMR.EXTEND).
"""

from __future__ import annotations

import os
import select
import selectors
import socket
import struct
import time
from pathlib import Path
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.crypto.certs import new_key, own_key_request
from gputravel.files import atomic_write_bytes
from gputravel.errors import BadInput, GputravelError, PeerTimeout, ProtocolError, RemoteError, TransportClosed
from gputravel.transport.stream import StreamTransport
from gputravel.transport.unix import connect_unix, listen_unix
from gputravel.protocol.codec import Message
from gputravel.protocol.control import Ready
from gputravel.attest.quote import (MEASUREMENT_BYTES, REPORT_DATA_BYTES, ZERO_RTMRS, EmulatedQuotingEnclave,
                                    rtmr_extend)

__all__ = ["CvmRegistered", "ExtendRtmr", "GUEST_RTMRS", "Launch", "LaunchedCvm", "PendingExtend", "Peer",
           "QuoteRefused", "QuoteReply", "QuoteRequest", "QuotingKey", "QuotingKeyCertified", "QuotingRefused",
           "RtmrExtended", "TdxModule", "TdxModuleConfig", "extend_rtmr", "request_quote", "serve"]

QUOTING_KEY_CN = "EMULATED TDX quoting key (not Intel)"
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux >= 6.5: a pidfd of the process that connected
# RTMR 0 and 1 hold what the virtual firmware and boot loader measured before the guest ran: a running
# guest may add only to 2 and 3 (as Linux's TSM interface lets user space), so it cannot rewrite its boot.
GUEST_RTMRS = frozenset({2, 3})


def process_start(pid: int) -> int | None:
    """When ``pid`` started (/proc/PID/stat field 22), or None: pids are reused, a start is not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2 :].split()[19])  # fields after "(comm)", from field 3


# ----------------------------------------------------------------------------- messages
class QuoteRequest(Message, tag="attest.tdx.quote_request"):
    """CVM -> module: quote me with this report data (nothing else can be asked)."""

    report_data: bytes


class QuoteReply(Message, tag="attest.tdx.quote_reply"):
    quote: bytes


class QuoteRefused(Message, tag="attest.tdx.quote_refused"):
    """Module -> CVM: a quote or an extend refused, and why."""

    reason: str


class ExtendRtmr(Message, tag="attest.tdx.extend_rtmr"):
    """CVM -> module: extend my RTMR `index` with this 48-byte digest (TDX: new = SHA-384(old || digest))."""

    index: int
    digest: bytes


class RtmrExtended(Message, tag="attest.tdx.rtmr_extended"):
    index: int
    value: bytes  # the register after the extend


class QuotingKey(Message, tag="attest.tdx.quoting_key"):
    """Module -> launcher: the public quoting key it made (SubjectPublicKeyInfo DER)."""

    public_key: bytes


class QuotingKeyCertified(Message, tag="attest.tdx.quoting_key_certified"):
    cert_chain: tuple[bytes, ...]  # quoting-key certificate, CPU-TEE root


class LaunchedCvm(Message, tag="attest.tdx.launched"):
    """Launcher -> module: the CVM it started, as the kernel names it, and its measurement."""

    pid: int
    uid: int
    measurement: bytes


class CvmRegistered(Message, tag="attest.tdx.registered"):
    pid: int


class QuotingRefused(RemoteError):
    """The TDX module would not quote for this caller."""


# ----------------------------------------------------------------------------- the core (sans-IO)
@dataclass(frozen=True)
class Peer:
    """A caller as the kernel reports it (SO_PEERCRED at connect time)."""

    pid: int
    uid: int
    started: int | None = None  # its start time, read when the connection was accepted


@dataclass(frozen=True)
class Launch:
    pid: int
    uid: int
    measurement: bytes
    started: int | None = None  # the launched process's start time, read at registration


@dataclass
class TdxModule:
    """The sans-IO core: `decide` quotes for the one launched CVM, holds (None) or raises QuotingRefused."""

    key: ec.EllipticCurvePrivateKey = field(default_factory=new_key, repr=False)
    cert_chain: tuple[bytes, ...] | None = None
    launch: Launch | None = None
    ended: bool = False  # the launched CVM's process is gone: nobody is quoted any more
    rtmr: list[bytes] = field(default_factory=lambda: list(ZERO_RTMRS))  # the launched CVM's four RTMRs

    def public_key_der(self) -> bytes:
        return _spki(self.key.public_key())

    def certified(self, chain: tuple[bytes, ...]) -> None:
        if self.cert_chain is not None:
            raise ProtocolError("the quoting key is certified once")
        if not chain or _spki(x509.load_der_x509_certificate(chain[0]).public_key()) != self.public_key_der():
            raise ProtocolError("the certificate is not for this module's quoting key")
        self.cert_chain = tuple(chain)

    def register(self, launch: Launch) -> None:
        if self.launch is not None:
            raise ProtocolError("this TDX module already quotes for a launched CVM (one CVM per module)")
        if len(launch.measurement) != MEASUREMENT_BYTES or launch.pid <= 0:
            raise ProtocolError("a launch needs a pid and a 48-byte measurement")
        self.launch = launch

    def decide(self, peer: Peer, report_data: bytes) -> bytes | None:
        launch = self._launched(peer)
        if launch is None:
            return None  # not ready: held
        if len(report_data) != REPORT_DATA_BYTES:
            raise QuotingRefused(f"report data must be {REPORT_DATA_BYTES} bytes")
        assert self.cert_chain is not None
        rtmr = (self.rtmr[0], self.rtmr[1], self.rtmr[2], self.rtmr[3])
        return EmulatedQuotingEnclave(self.key, self.cert_chain).quote(launch.measurement, report_data, rtmr)

    def extend(self, peer: Peer, index: int, digest: bytes) -> bytes | None:
        """The launched CVM's RTMR `index` after extending it with `digest`; None: held."""
        if self._launched(peer) is None:
            return None
        if type(index) is not int or index not in GUEST_RTMRS:
            raise QuotingRefused(f"RTMR {index} cannot be extended by the guest (only {sorted(GUEST_RTMRS)})")
        if len(digest) != MEASUREMENT_BYTES:
            raise QuotingRefused(f"an RTMR is extended with a {MEASUREMENT_BYTES}-byte digest")
        self.rtmr[index] = rtmr_extend(self.rtmr[index], digest)
        return self.rtmr[index]

    def _launched(self, peer: Peer) -> Launch | None:
        """The launch, if `peer` is its process (QuotingRefused if not); None while not ready."""
        if self.ended:
            raise QuotingRefused("the CVM this module launched has ended")
        launch = self.launch
        if self.cert_chain is None or launch is None:
            return None
        if peer.pid != launch.pid or peer.uid != launch.uid:
            raise QuotingRefused(f"pid {peer.pid} (uid {peer.uid}) is not the CVM this module launched")
        if peer.started is None or peer.started != launch.started:
            # A reused pid: a connection made before the launch, held open, is not the launched CVM.
            raise QuotingRefused(f"pid {peer.pid} connected as another process than the CVM this module launched")
        return launch


def _spki(key: object) -> bytes:
    return key.public_bytes(serialization.Encoding.DER,  # type: ignore[attr-defined]
                            serialization.PublicFormat.SubjectPublicKeyInfo)


# ----------------------------------------------------------------------------- the CVM's side
def request_quote(socket_path: str, report_data: bytes, timeout: float = 30.0) -> bytes:
    """Ask the TDX module for a quote over `report_data`; QuotingRefused if it will not."""
    if not socket_path:
        raise QuotingRefused("this CVM was launched without a TDX module: it cannot be quoted")
    with connect_unix(socket_path, "tdx-module", timeout=timeout) as conn:
        conn.send(QuoteRequest(report_data))
        reply = conn.recv(timeout=timeout, expect=(QuoteReply, QuoteRefused)).message
    if isinstance(reply, QuoteRefused):
        raise QuotingRefused(f"the TDX module refused to quote: {reply.reason}")
    assert isinstance(reply, QuoteReply)
    return reply.quote


class PendingExtend:
    """An extend sent, its reply awaited later: a CVM launched before its registration (cohort/supervisor.py
    registers it once it is up) sends it at boot and waits before its first quote, so nothing is quoted before."""

    def __init__(self, socket_path: str, index: int, digest: bytes, timeout: float = 30.0) -> None:
        if not socket_path:
            raise QuotingRefused("this CVM was launched without a TDX module: it cannot extend an RTMR")
        self.index, self.digest, self._value = index, digest, b""
        self._conn: StreamTransport | None = connect_unix(socket_path, "tdx-module", timeout=timeout)
        try:
            self._conn.send(ExtendRtmr(index, digest))
        except BaseException:
            self.close()
            raise

    def result(self, timeout: float = 30.0) -> bytes:
        """The register's new value (waited for once); QuotingRefused if the module refused."""
        if self._value:
            return self._value
        if self._conn is None:
            raise QuotingRefused(f"the extend of RTMR[{self.index}] failed before")
        try:
            reply = self._conn.recv(timeout=timeout, expect=(RtmrExtended, QuoteRefused)).message
        finally:
            self.close()
        if isinstance(reply, QuoteRefused):
            raise QuotingRefused(f"the TDX module refused to extend RTMR[{self.index}]: {reply.reason}")
        assert isinstance(reply, RtmrExtended)
        if reply.index != self.index or len(reply.value) != MEASUREMENT_BYTES:
            raise ProtocolError("the TDX module answered the extend for another register")
        self._value = reply.value
        return reply.value

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def extend_rtmr(socket_path: str, index: int, digest: bytes, timeout: float = 30.0) -> bytes:
    """Ask the TDX module to extend this CVM's RTMR `index` with `digest`; its new value, or QuotingRefused."""
    return PendingExtend(socket_path, index, digest, timeout).result(timeout)


# ----------------------------------------------------------------------------- the process
@dataclass(frozen=True)
class TdxModuleConfig:
    socket_path: str
    hold_s: float = 30.0  # how long a request may wait for the launch to be registered
    # A deployed module (service/) keeps its quoting key and chain here, so the platform's
    # provisioning key certifies it once and is then gone; "": a fresh key per start.
    key_dir: str = ""


@dataclass
class _Pending:
    conn: StreamTransport
    peer: Peer
    request: QuoteRequest | ExtendRtmr
    deadline: float


class _Server:
    def __init__(self, core: TdxModule, listener: socket.socket, control: StreamTransport, hold_s: float,
                 key_dir: Path | None) -> None:
        self.core, self.listener, self.control, self.hold_s = core, listener, control, hold_s
        self.key_dir = key_dir  # where a deployed module keeps its certified chain
        self.pending: list[_Pending] = []
        self.pidfd = -1
        self.sel = selectors.DefaultSelector()
        self.sel.register(control.fileno(), selectors.EVENT_READ, "control")
        self.sel.register(listener.fileno(), selectors.EVENT_READ, "listener")

    def run(self) -> None:
        while True:
            deadlines = [p.deadline for p in self.pending]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            for key, _ in self.sel.select(timeout):
                if key.data == "control" and not self._from_launcher():
                    return
                if key.data == "listener":
                    self._accept()
                elif isinstance(key.data, tuple):
                    self._request(*key.data)
            self._settle()

    def _from_launcher(self) -> bool:
        try:
            msg = self.control.recv(timeout=5).message
        except TransportClosed:
            return False  # the launcher is gone: so is the module
        if isinstance(msg, QuotingKeyCertified):
            self.core.certified(msg.cert_chain)
            if self.key_dir is not None:  # kept: the next start needs no certifier
                atomic_write_bytes(self.key_dir / CHAIN_FILE, b"".join(
                    x509.load_der_x509_certificate(c).public_bytes(serialization.Encoding.PEM) for c in msg.cert_chain))
        elif isinstance(msg, LaunchedCvm):
            self._register(msg)
        else:
            raise ProtocolError(f"the launcher sent {type(msg).__name__}")
        return True

    def _register(self, msg: LaunchedCvm) -> None:
        try:
            self.pidfd = os.pidfd_open(msg.pid)  # this process, not whoever gets its pid later
        except OSError:
            self.core.ended = True
        self.core.register(Launch(msg.pid, msg.uid, msg.measurement, process_start(msg.pid)))
        self.control.send(CvmRegistered(pid=msg.pid))

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:  # nobody there after all, or out of descriptors: drop this caller, keep serving
            return
        pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        conn = StreamTransport(sock, f"cvm-{pid}")
        peer = Peer(pid, uid, None if _exited(sock) else process_start(pid))
        self.sel.register(conn.fileno(), selectors.EVENT_READ, (conn, peer, sock))

    def _request(self, conn: StreamTransport, peer: Peer, sock: socket.socket) -> None:
        self.sel.unregister(conn.fileno())  # one request per connection
        try:
            got = conn.recv(timeout=2, expect=(QuoteRequest, ExtendRtmr)).message
        except GputravelError:  # garbage, another message (a measurement asked for), a hang-up
            conn.close()
            return
        assert isinstance(got, (QuoteRequest, ExtendRtmr))
        if _exited(sock):  # the process that connected is gone, whatever now has its pid
            peer = Peer(peer.pid, peer.uid, None)
        self.pending.append(_Pending(conn, peer, got, time.monotonic() + self.hold_s))

    def _settle(self) -> None:
        if self.pidfd >= 0 and select.select([self.pidfd], [], [], 0)[0]:
            self.core.ended = True  # a pidfd turns readable when its process exits
        now, waiting = time.monotonic(), []
        for p in self.pending:  # in arrival order: an extend sent before a quote is in that quote
            try:
                reply = self._decide(p)
                if reply is None and now >= p.deadline:
                    raise QuotingRefused("no CVM launch was registered in time")
            except QuotingRefused as exc:
                self._reply(p.conn, QuoteRefused(reason=str(exc)))
                continue
            if reply is None:
                waiting.append(p)
            else:
                self._reply(p.conn, reply)
        self.pending = waiting

    def _decide(self, p: _Pending) -> Message | None:
        req = p.request
        if isinstance(req, ExtendRtmr):
            value = self.core.extend(p.peer, req.index, req.digest)
            return None if value is None else RtmrExtended(index=req.index, value=value)
        quote = self.core.decide(p.peer, req.report_data)
        return None if quote is None else QuoteReply(quote=quote)

    @staticmethod
    def _reply(conn: StreamTransport, msg: object) -> None:
        try:
            conn.send(msg)
        except (TransportClosed, PeerTimeout, ProtocolError):
            pass
        conn.close()


def _exited(sock: socket.socket) -> bool:
    """Whether the process that connected ``sock`` has exited, by its SO_PEERPIDFD (exact, where a
    pid may name a newer process); False without one (the start-time check still applies)."""
    try:
        pidfd = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
    except OSError:
        return False
    try:
        return bool(select.select([pidfd], [], [], 0)[0])  # a pidfd turns readable when its process exits
    finally:
        os.close(pidfd)


KEY_FILE, CHAIN_FILE = "quoting.key", "quoting-chain.pem"


def _kept_module(directory: Path) -> TdxModule:
    """The module with the quoting key kept in `directory`, certified if its stored chain is for it."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    own_key_request(directory / KEY_FILE, QUOTING_KEY_CN)  # makes the key once
    key = serialization.load_pem_private_key((directory / KEY_FILE).read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise BadInput(f"{directory / KEY_FILE} is not an EC private key")
    core = TdxModule(key=key)
    chain_path = directory / CHAIN_FILE
    if chain_path.exists():
        chain = tuple(c.public_bytes(serialization.Encoding.DER)
                      for c in x509.load_pem_x509_certificates(chain_path.read_bytes()))
        core.certified(chain)  # ProtocolError if it is not for this key
    return core


def serve(config: TdxModuleConfig, control: StreamTransport) -> None:
    """Make the quoting key, listen, hand the launcher the public key, serve until it hangs up."""
    if not config.socket_path:
        raise BadInput("the TDX module needs a socket path")
    core = _kept_module(Path(config.key_dir)) if config.key_dir else TdxModule()
    listener = listen_unix(config.socket_path)
    os.chmod(config.socket_path, 0o666)  # any local process may ask; SO_PEERCRED decides who is quoted
    listener.setblocking(False)
    try:
        control.send(Ready(role="tdx-module", detail={"certified": int(core.cert_chain is not None)}))
        if core.cert_chain is None:
            control.send(QuotingKey(public_key=core.public_key_der()))
        _Server(core, listener, control, config.hold_s, Path(config.key_dir) if config.key_dir else None).run()
    finally:
        listener.close()
