"""Mutual TLS 1.3 over TCP, giving :class:`StreamTransport` links: the caller's ``ssl.SSLContext``,
the handshake with typed errors, TLS 1.3 insisted on, the peer named by its certificate's CN."""

from __future__ import annotations

import select
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

from gputravel.errors import BadInput, PeerTimeout, ProtocolError, TransportClosed
from gputravel.transport.deadline import wait_ready
from gputravel.transport.stream import StreamTransport

__all__ = ["connect_tls", "TlsListener"]


def connect_tls(host: str, port: int, context: ssl.SSLContext, server_hostname: str, *,
                timeout: float = 10.0) -> StreamTransport:
    """Connect, handshake (within ``timeout``) and verify the server as ``server_hostname``. A
    rejected client certificate surfaces on the first ``recv`` (TLS 1.3), not here."""
    name = f"tls:{server_hostname}"
    try:
        raw = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError:
        raise PeerTimeout(f"{name}: connect to {host}:{port} timed out") from None
    except OSError as e:
        raise TransportClosed(f"{name}: cannot connect to {host}:{port}: "
                              f"{e.strerror or type(e).__name__}") from None
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    tls = _handshake(raw, name, lambda: context.wrap_socket(raw, server_hostname=server_hostname))
    return StreamTransport(tls, name)


class TlsListener:
    """A TCP listener whose ``accept`` completes a mutual-TLS handshake (bounded by
    ``handshake_timeout``) and names the peer by its certificate; a failed one leaves it serving."""

    def __init__(self, host: str, port: int, context: ssl.SSLContext, *, backlog: int = 16,
                 handshake_timeout: float = 10.0) -> None:
        if context.verify_mode != ssl.CERT_REQUIRED:
            raise BadInput("TlsListener needs a server context with verify_mode=CERT_REQUIRED "
                           "(peers are identified by their client certificates)")
        self._context = context
        self._handshake_timeout = handshake_timeout
        try:
            self._sock = socket.create_server((host, port), backlog=backlog)
        except OSError as e:
            raise BadInput(f"cannot listen on {host}:{port}: {e.strerror}") from None
        self._sock.setblocking(False)
        self._poll = select.poll()
        self._poll.register(self._sock.fileno(), select.POLLIN)
        self.host = host
        self._closed = False
        self.port: int = self._sock.getsockname()[1]

    def accept(self, timeout: float | None = None) -> tuple[StreamTransport, str]:
        """Wait up to ``timeout`` for a client; return its transport and certificate CN."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._closed:  # closed from another thread while we waited
                raise TransportClosed(f"tls listener :{self.port}: closed")
            try:
                wait_ready(self._poll, deadline)
            except PeerTimeout:
                raise PeerTimeout(f"tls listener :{self.port}: no client within {timeout}s") from None
            try:
                raw, addr = self._sock.accept()
                break
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                if self._closed:
                    continue  # reported at the top of the loop
                raise
        raw.settimeout(self._handshake_timeout)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        where = f"tls client {addr[0]}:{addr[1]}"
        tls = _handshake(raw, where, lambda: self._context.wrap_socket(raw, server_side=True))
        try:
            cn = _common_name(tls.getpeercert())
        except ProtocolError as e:
            tls.close()
            raise ProtocolError(f"{where}: {e}") from None
        return StreamTransport(tls, f"tls:{cn}"), cn

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._closed = True
        self._sock.close()

    def __enter__(self) -> TlsListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _handshake(raw: socket.socket, where: str, wrap: Callable[[], ssl.SSLSocket]) -> ssl.SSLSocket:
    """Run ``wrap`` (a blocking handshake under ``raw``'s timeout) with typed failures."""
    try:
        tls = wrap()
    except OSError as e:  # ssl.SSLError and TimeoutError are OSErrors
        raw.close()
        if isinstance(e, ssl.SSLCertVerificationError):
            why = e.verify_message or e.reason
            raise ProtocolError(f"{where}: TLS certificate verification failed: {why}") from None
        if isinstance(e, ssl.SSLError):
            raise ProtocolError(f"{where}: TLS handshake failed: {e.reason or e}") from None
        if isinstance(e, TimeoutError):
            raise PeerTimeout(f"{where}: TLS handshake timed out") from None
        raise TransportClosed(f"{where}: connection lost during TLS handshake ({type(e).__name__})") from None
    if (version := tls.version()) != "TLSv1.3":
        tls.close()
        raise ProtocolError(f"{where}: negotiated {version}, TLS 1.3 is required")
    return tls


def _common_name(cert: dict[str, Any] | None) -> str:
    """The subject commonName of a verified peer certificate (``getpeercert()`` form)."""
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName" and value:
                return str(value)
    raise ProtocolError("peer certificate has no subject commonName")
