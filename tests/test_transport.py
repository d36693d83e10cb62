"""Transports: one conformance suite over every implementation, then stream/TLS specifics."""

from __future__ import annotations

import datetime
import os
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gputravel.protocol import codec as wire
from gputravel.errors import BadInput, PeerTimeout, ProtocolError, TransportClosed
from gputravel.transport import (
    Received,
    StreamTransport,
    TlsListener,
    Transport,
    accept_unix,
    connect_tls,
    connect_unix,
    listen_unix,
    memory_pair,
    socketpair_transports,
)
from gputravel.transport.stream import HEADER
from gputravel.protocol.codec import Message


class Ping(Message, tag="test.transport.ping"):
    seq: int


class Blob(Message, tag="test.transport.blob"):
    data: bytes


# ----------------------------------------------------------------------------- throwaway PKI
@dataclass(frozen=True)
class Pki:
    ca_pem: str
    files: dict[str, str]  # commonName -> PEM file holding cert + key

    def server(self, cn: str = "holder") -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=self.ca_pem)
        ctx.load_cert_chain(self.files[cn])
        return ctx

    def client(self, cn: str = "worker") -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_verify_locations(cadata=self.ca_pem)
        ctx.load_cert_chain(self.files[cn])
        return ctx


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_pki(directory: Path, ca_cn: str, leaves: list[str]) -> Pki:
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_cert = (
        x509.CertificateBuilder().subject_name(_name(ca_cn)).issuer_name(_name(ca_cn))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                       critical=True)
        .sign(ca_key, hashes.SHA384())
    )
    files = {}
    for cn in leaves:
        key = ec.generate_private_key(ec.SECP384R1())
        cert = (
            x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(cn)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA384())
        )
        path = directory / f"{ca_cn}-{cn}.pem"
        path.write_bytes(
            cert.public_bytes(serialization.Encoding.PEM)
            + key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()))
        files[cn] = str(path)
    return Pki(ca_cert.public_bytes(serialization.Encoding.PEM).decode(), files)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), "test-ca", ["holder", "worker", "worker2"])


@pytest.fixture(scope="module")
def foreign_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("foreign"), "evil-ca", ["worker"])


def tls_pair(pki: Pki) -> tuple[StreamTransport, StreamTransport]:
    with TlsListener("127.0.0.1", 0, pki.server()) as listener:
        result: dict[str, object] = {}
        t = threading.Thread(target=lambda: result.update(
            c=connect_tls("127.0.0.1", listener.port, pki.client(), "holder", timeout=5)))
        t.start()
        server, cn = listener.accept(timeout=5)
        t.join(5)
    assert cn == "worker"
    return result["c"], server  # type: ignore[return-value]


def unix_pair() -> tuple[StreamTransport, StreamTransport]:
    # A short private directory: AF_UNIX paths are limited to 107 bytes.
    with tempfile.TemporaryDirectory(prefix="gt") as d:
        listener = listen_unix(os.path.join(d, "s"))
        try:
            client = connect_unix(os.path.join(d, "s"), "client")
            server = accept_unix(listener, "server", timeout=5)
        finally:
            listener.close()
    return client, server


KINDS = ["memory", "socketpair", "unix", "tls"]


@pytest.fixture(params=KINDS)
def pair(request: pytest.FixtureRequest, pki: Pki) -> Iterator[tuple[Transport, Transport]]:
    factories: dict[str, Callable[[], tuple[Transport, Transport]]] = {
        "memory": memory_pair, "socketpair": socketpair_transports,
        "unix": unix_pair, "tls": lambda: tls_pair(pki),
    }
    a, b = factories[request.param]()
    yield a, b
    a.close()
    b.close()


def in_thread(fn: Callable[[], object]) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


# ----------------------------------------------------------------------------- conformance
def test_order_is_preserved_both_ways(pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    for i in range(50):
        a.send(Ping(i))
        b.send(Ping(1000 + i))
    assert [b.recv(timeout=5).message for _ in range(50)] == [Ping(i) for i in range(50)]
    assert [a.recv(timeout=5).message.seq for _ in range(50)] == list(range(1000, 1050))


def test_large_message(pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    payload = os.urandom(1024) * (8 * 1024)  # 8 MiB
    sender = in_thread(lambda: a.send(Blob(payload)))  # sockets block until b reads
    got = b.recv(timeout=10)
    sender.join(10)
    assert got.message == Blob(payload) and got.fds == ()


def test_timeout_then_next_recv_works(pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    start = time.monotonic()
    with pytest.raises(PeerTimeout):
        b.recv(timeout=0.05)
    assert 0.04 < time.monotonic() - start < 1.0
    with pytest.raises(PeerTimeout):
        b.recv(timeout=0)
    a.send(Ping(1))
    assert b.recv(timeout=5) == Received(Ping(1))


def test_close_drains_then_raises_transport_closed(pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    a.send(Ping(1))
    a.send(Ping(2))
    a.close()
    a.close()  # idempotent
    assert b.recv(timeout=5).message == Ping(1)
    assert b.recv(timeout=5).message == Ping(2)
    for _ in range(2):
        with pytest.raises(TransportClosed):
            b.recv(timeout=5)
    with pytest.raises(TransportClosed):
        a.recv(timeout=0.1)
    with pytest.raises(TransportClosed):
        a.send(Ping(3))


def test_close_wakes_a_blocked_receiver(pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            b.recv()
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            errors.append(e)

    t = in_thread(blocked)
    time.sleep(0.05)
    b.close()
    t.join(5)
    assert not t.is_alive() and isinstance(errors[0], TransportClosed)


def test_context_manager_closes(pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    with a:
        a.send(Ping(1))
    assert b.recv(timeout=5).message == Ping(1)
    with pytest.raises(TransportClosed):
        b.recv(timeout=5)


def test_fd_passing(request: pytest.FixtureRequest, pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    fd = os.memfd_create("gputravel-test")
    try:
        os.write(fd, b"shared memory says hi")
        if request.node.callspec.params["pair"] == "tls":
            with pytest.raises(BadInput):
                a.send(Ping(1), fds=[fd])
            return
        a.send(Ping(7), fds=[fd, fd])
    finally:
        os.close(fd)  # the receiver's copies must outlive the sender's
    got = b.recv(timeout=5)
    assert got.message == Ping(7) and len(got.fds) == 2
    try:
        assert fd not in got.fds or len(set(got.fds)) == 2
        assert os.pread(got.fds[0], 100, 0) == b"shared memory says hi"
        assert not os.get_inheritable(got.fds[0])
    finally:
        for f in got.fds:
            os.close(f)


def test_expect_rejects_other_types_and_stays_usable(pair: tuple[Transport, Transport]) -> None:
    a, b = pair
    a.send(Ping(1))
    a.send(Blob(b"x"))
    with pytest.raises(ProtocolError, match=r"test\.transport\.ping"):
        b.recv(timeout=5, expect=Blob)
    assert b.recv(timeout=5, expect=(Ping, Blob)).message == Blob(b"x")


def test_bad_fds_argument(pair: tuple[Transport, Transport]) -> None:
    a, _ = pair
    with pytest.raises(BadInput):
        a.send(Ping(1), fds=[-1])
    with pytest.raises(BadInput):
        a.send(Ping(1), fds=["3"])  # type: ignore[list-item]


def test_oversized_message_is_refused_on_send(pair: tuple[Transport, Transport],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = pair
    monkeypatch.setattr(wire, "MAX_FRAME_BYTES", 1024)
    with pytest.raises(ProtocolError, match="exceeds"):
        a.send(Blob(bytes(2048)))
    a.send(Blob(bytes(100)))  # nothing half-sent: the link still works
    assert b.recv(timeout=5).message == Blob(bytes(100))


# ----------------------------------------------------------------------------- stream framing
@pytest.fixture
def raw_and_transport() -> Iterator[tuple[socket.socket, StreamTransport]]:
    raw, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t = StreamTransport(other, "victim")
    yield raw, t
    raw.close()
    t.close()


def frame(payload: bytes, nfds: int = 0) -> bytes:
    return HEADER.pack(len(payload), nfds) + payload


def test_oversized_length_header_is_protocol_error(raw_and_transport) -> None:
    raw, t = raw_and_transport
    raw.sendall(HEADER.pack(wire.MAX_FRAME_BYTES + 1, 0))
    with pytest.raises(ProtocolError, match="exceeds"):
        t.recv(timeout=5)
    with pytest.raises(TransportClosed):  # the stream cannot be resynchronised
        t.recv(timeout=5)


def test_raw_garbage_is_protocol_error(raw_and_transport) -> None:
    raw, t = raw_and_transport
    raw.sendall(b"\xff" * 64)
    with pytest.raises(ProtocolError):
        t.recv(timeout=5)


def test_garbage_payload_is_protocol_error_and_framing_survives(raw_and_transport) -> None:
    raw, t = raw_and_transport
    raw.sendall(frame(b"\xc1 not msgpack") + frame(wire.encode(Ping(5))))
    with pytest.raises(ProtocolError, match="malformed"):
        t.recv(timeout=5)
    assert t.recv(timeout=5).message == Ping(5)


def test_missing_announced_fds_is_protocol_error(raw_and_transport) -> None:
    raw, t = raw_and_transport
    raw.sendall(frame(wire.encode(Ping(1)), nfds=2) + frame(wire.encode(Ping(2))))
    with pytest.raises(ProtocolError, match="descriptor"):
        t.recv(timeout=5)
    assert t.recv(timeout=5).message == Ping(2)


def test_unannounced_fds_are_closed_and_rejected(raw_and_transport) -> None:
    raw, t = raw_and_transport
    r, w = os.pipe()
    try:
        socket.send_fds(raw, [frame(wire.encode(Ping(1)))], [w])
    finally:
        os.close(w)
    with pytest.raises(ProtocolError, match="descriptor"):
        t.recv(timeout=5)
    assert os.read(r, 1) == b""  # our copy of the write end was closed: EOF
    os.close(r)


def test_timeout_mid_frame_keeps_partial_state(raw_and_transport) -> None:
    raw, t = raw_and_transport
    data = frame(wire.encode(Blob(b"y" * 5000)))
    raw.sendall(data[:3])  # mid-header
    with pytest.raises(PeerTimeout):
        t.recv(timeout=0.02)
    raw.sendall(data[3:2000])  # mid-payload
    with pytest.raises(PeerTimeout):
        t.recv(timeout=0.02)
    raw.sendall(data[2000:] + frame(wire.encode(Ping(9))))
    assert t.recv(timeout=5).message == Blob(b"y" * 5000)
    assert t.recv(timeout=5).message == Ping(9)
    assert t.bytes_received == len(data) + HEADER.size + len(wire.encode(Ping(9)))


def test_peer_closing_mid_frame_is_transport_closed(raw_and_transport) -> None:
    raw, t = raw_and_transport
    raw.sendall(frame(wire.encode(Ping(1)))[:-1])
    raw.close()
    with pytest.raises(TransportClosed, match="mid-frame"):
        t.recv(timeout=5)


def echo_round_trips(a: Transport, b: Transport, msg: object, count: int) -> None:
    """Send ``msg`` ``count`` times through an echoing peer; every reply must equal it."""

    def echo() -> None:
        try:
            while True:
                b.send(b.recv().message)
        except TransportClosed:
            pass

    t = in_thread(echo)
    for _ in range(count):
        a.send(msg)
        assert a.recv(timeout=5).message == msg
    a.close()
    t.join(5)
    b.close()


def test_counters_over_many_round_trips() -> None:
    a, b = socketpair_transports()
    msg = Blob(bytes(16 * 1024))
    echo_round_trips(a, b, msg, 200)
    assert a.bytes_sent == a.bytes_received == 200 * (HEADER.size + len(wire.encode(msg)))


def test_unix_helpers_errors() -> None:
    with tempfile.TemporaryDirectory(prefix="gt") as d:
        path = os.path.join(d, "s")
        with pytest.raises(TransportClosed):
            connect_unix(path, "nobody")
        listener = listen_unix(path)
        try:
            with pytest.raises(PeerTimeout):
                accept_unix(listener, "server", timeout=0.02)
            with pytest.raises(BadInput, match="stale"):
                listen_unix(path)
        finally:
            listener.close()


# ----------------------------------------------------------------------------- TLS specifics
def test_tls_foreign_client_is_refused_and_listener_keeps_serving(pki: Pki,
                                                                   foreign_pki: Pki) -> None:
    server_ctx = pki.server()
    bad_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bad_ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    bad_ctx.load_verify_locations(cadata=pki.ca_pem)  # trusts the server...
    bad_ctx.load_cert_chain(foreign_pki.files["worker"])  # ...but presents a foreign cert
    with TlsListener("127.0.0.1", 0, server_ctx) as listener:
        bad: dict[str, object] = {}

        def bad_client() -> None:
            try:
                t = connect_tls("127.0.0.1", listener.port, bad_ctx, "holder", timeout=5)
                bad["recv"] = t.recv(timeout=5)  # TLS 1.3: the refusal shows up here
            except Exception as e:  # noqa: BLE001 - recorded for the assertion
                bad["error"] = e

        t = in_thread(bad_client)
        with pytest.raises(ProtocolError, match=r"(?i)certificate"):
            listener.accept(timeout=5)
        t.join(5)
        assert isinstance(bad.get("error"), (ProtocolError, TransportClosed)), bad

        good: dict[str, StreamTransport] = {}
        t = in_thread(lambda: good.update(
            c=connect_tls("127.0.0.1", listener.port, pki.client("worker2"), "holder")))
        server, cn = listener.accept(timeout=5)
        t.join(5)
    with server, good["c"] as client:
        assert cn == "worker2"
        client.send(Ping(1))
        assert server.recv(timeout=5).message == Ping(1)


def test_tls_wrong_server_name_is_refused(pki: Pki) -> None:
    with TlsListener("127.0.0.1", 0, pki.server()) as listener:
        t = in_thread(lambda: pytest.raises(ProtocolError, listener.accept, timeout=5))
        with pytest.raises(ProtocolError, match="verification failed"):
            connect_tls("127.0.0.1", listener.port, pki.client(), "someone-else", timeout=5)
        t.join(5)


def test_a_link_that_negotiates_less_than_tls_1_3_is_refused_on_both_ends(pki: Pki) -> None:
    """The contexts are the caller's: if both would settle for TLS 1.2, the transport itself
    still refuses the link."""
    server_ctx, client_ctx = pki.server(), pki.client()
    for ctx in (server_ctx, client_ctx):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    with TlsListener("127.0.0.1", 0, server_ctx) as listener:
        got: dict[str, object] = {}
        t = in_thread(lambda: got.update(error=pytest.raises(ProtocolError, listener.accept, timeout=5).value))
        with pytest.raises(ProtocolError, match=r"TLS 1\.3 is required"):
            connect_tls("127.0.0.1", listener.port, client_ctx, "holder", timeout=5)
        t.join(5)
    assert "TLS 1.3 is required" in str(got["error"])


def test_tls_listener_requires_client_certificates(pki: Pki) -> None:
    ctx = pki.server()
    ctx.verify_mode = ssl.CERT_NONE
    with pytest.raises(BadInput, match="CERT_REQUIRED"):
        TlsListener("127.0.0.1", 0, ctx)


def test_tls_accept_timeout_and_connect_refused(pki: Pki) -> None:
    with TlsListener("127.0.0.1", 0, pki.server()) as listener:
        with pytest.raises(PeerTimeout):
            listener.accept(timeout=0.02)
        port = listener.port
    with pytest.raises(TransportClosed):
        connect_tls("127.0.0.1", port, pki.client(), "holder", timeout=2)


def test_tls_round_trips_and_nodelay(pki: Pki) -> None:
    a, b = tls_pair(pki)
    assert a._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    assert b._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    echo_round_trips(a, b, Blob(bytes(16 * 1024)), 100)


# ----------------------------------------------------------------------------- lifecycle details
def test_send_timeout_closes_the_half_written_stream() -> None:
    raw, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t = StreamTransport(other, "slow-peer", send_timeout=0.05)
    try:
        with pytest.raises(PeerTimeout, match="stopped reading"):
            t.send(Blob(bytes(8 * 1024 * 1024)))  # nobody reads: the buffer fills up
        with pytest.raises(TransportClosed):
            t.send(Ping(1))
    finally:
        t.close()
        raw.close()


def test_a_forked_child_closing_its_copy_does_not_cut_the_parent(processes) -> None:
    a, b = socketpair_transports()
    pid = os.fork()
    if pid == 0:  # child: drop inherited copies, as a spawned trust domain would
        a.close()
        b.close()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    with a, b:
        a.send(Ping(1))
        assert b.recv(timeout=5).message == Ping(1)


def test_memory_close_releases_undelivered_fds() -> None:
    a, b = memory_pair()
    r, w = os.pipe()
    a.send(Ping(1), fds=[w])
    os.close(w)
    b.close()  # b never received: its dup of w must be closed, so r sees EOF
    assert os.read(r, 1) == b""
    os.close(r)
    a.close()


def test_descriptors_do_not_leak(pki: Pki) -> None:
    before = len(os.listdir("/proc/self/fd"))
    for make in (memory_pair, socketpair_transports, unix_pair, lambda: tls_pair(pki)):
        a, b = make()
        fd = os.memfd_create("leak-check")
        if not isinstance(a, StreamTransport) or a._unix:
            a.send(Ping(1), fds=[fd])
            a.send(Ping(2), fds=[fd])  # left undelivered on purpose
            for got_fd in b.recv(timeout=5).fds:
                os.close(got_fd)
        os.close(fd)
        a.close()
        b.close()
    assert len(os.listdir("/proc/self/fd")) == before
