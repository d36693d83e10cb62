"""Length-prefixed message frames over any connected stream socket (AF_UNIX, TCP, TLS).

A frame: payload length (u32 big-endian), descriptor count (u8), one codec message. Descriptors
(SCM_RIGHTS, AF_UNIX only) ride on the first byte and are counted on arrival. The socket is
non-blocking and every wait a sliced ``poll`` against a deadline: timeouts stay exact for TLS, two
threads can send and recv, a receive that times out mid-frame resumes, and a blocked thread sees
a close (which never calls ``shutdown``: that would cut the connection for every process).
"""

from __future__ import annotations

import array
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from typing import Any, Protocol

from gputravel.protocol import codec
from gputravel.errors import BadInput, PeerTimeout, ProtocolError, TransportClosed
from gputravel.transport.base import MAX_FDS, Received, Transport, check_fds, close_fds
from gputravel.transport.deadline import wait_ready


class Pacer(Protocol):
    """What :meth:`StreamTransport.pace` needs of a token bucket."""

    burst_bytes: int

    def throttle(self, nbytes: int) -> float: ...


__all__ = ["StreamTransport", "Pacer", "HEADER"]

HEADER = struct.Struct(">IB")  # payload length, descriptor count
_ANCBUF = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
_RETAIN = 1 << 20  # receive buffers up to this size are kept and reused between frames
_CLOSED_ERRORS = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError,
                  ssl.SSLEOFError, ssl.SSLZeroReturnError)


class StreamTransport(Transport):
    """A :class:`Transport` over a connected stream socket, which it owns. A send that waits past
    ``send_timeout`` for a peer that stopped reading closes the transport (PeerTimeout)."""

    _payload: memoryview | None  # the frame being read (None: its header first)

    def __init__(self, sock: socket.socket, name: str, *,
                 send_timeout: float | None = None) -> None:
        self.name = name
        self.bytes_sent = 0
        self.bytes_received = 0
        self._sock = sock
        self._unix = sock.family == socket.AF_UNIX and not isinstance(sock, ssl.SSLSocket)
        self._send_timeout = send_timeout
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # Small control messages must not sit in Nagle's buffer waiting for an ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self._fd = sock.fileno()
        self._rpoll = select.poll()
        self._rpoll.register(self._fd, select.POLLIN)
        self._wpoll = select.poll()
        self._wpoll.register(self._fd, select.POLLOUT)
        self._send_lock = threading.Lock()  # one frame at a time per direction
        self._recv_lock = threading.Lock()
        # Every socket call and the close, after a closed check: no call hits a closed (or reused)
        # descriptor, and OpenSSL gets the serialised calls it needs across two threads.
        self._io_lock = threading.Lock()
        self._closed = False
        self._eof = False
        self._buf = bytearray(64 * 1024)
        self._pacer: Pacer | None = None
        self._prepaid = 0  # bytes already paid to the pacer that have not left yet
        self._reset_frame()

    def pace(self, bucket: Pacer | None) -> None:
        """Keep what this end sends to ``bucket``'s rate (a net.TokenBucket; None: unpaced), each
        byte paid once before it leaves, at most one burst (and 64 KiB) a write."""
        with self._send_lock:
            self._pacer = bucket
            self._prepaid = 0

    # ------------------------------------------------------------------------- send
    def send(self, message: object, fds: Sequence[int] = ()) -> None:
        fds = check_fds(self.name, fds)
        if fds and not self._unix:
            raise BadInput(f"{self.name}: descriptors can only travel over AF_UNIX sockets")
        data = codec.encode(message)
        if len(data) > codec.MAX_FRAME_BYTES:
            raise ProtocolError(f"{self.name}: message of {len(data)} bytes exceeds "
                                f"{codec.MAX_FRAME_BYTES}")
        # One buffer, one write: header and payload leave in the same segment / TLS record.
        frame = HEADER.pack(len(data), len(fds)) + data
        with self._send_lock:
            self._check_open()
            self._write_all(memoryview(frame), fds)
            self.bytes_sent += len(frame)

    def _write_all(self, view: memoryview, fds: tuple[int, ...]) -> None:
        deadline = None if self._send_timeout is None else time.monotonic() + self._send_timeout
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else None
        sent = 0
        while sent < len(view):
            piece = view[sent:] if self._pacer is None else self._paid(view[sent:])
            try:
                with self._io_lock:
                    self._check_open()
                    if anc is not None:
                        n = self._sock.sendmsg([piece], anc)
                        anc = None  # descriptors ride on the first chunk only
                    else:
                        n = self._sock.send(piece)
            except (BlockingIOError, ssl.SSLWantWriteError):
                self._wait_send(self._wpoll, deadline)
                continue
            except ssl.SSLWantReadError:
                self._wait_send(self._rpoll, deadline)
                continue
            except ssl.SSLError as e:
                self._fail(ProtocolError(f"{self.name}: TLS error on send: {e.reason}"))
            except OSError as e:
                self._fail(self._closed_error(e))
            sent += n
            self._prepaid = max(self._prepaid - n, 0)

    def _paid(self, rest: memoryview) -> memoryview:
        """The next piece to offer the socket, paid for (a retry after a short write pays nothing more)."""
        assert self._pacer is not None
        piece = rest[: max(1, min(self._pacer.burst_bytes, 64 * 1024))]
        if self._prepaid < len(piece):
            self._pacer.throttle(len(piece) - self._prepaid)
            self._prepaid = len(piece)
        return piece

    def _wait_send(self, poller: select.poll, deadline: float | None) -> None:
        try:
            wait_ready(poller, deadline)
        except PeerTimeout:
            # The frame may be half written (and TLS state mid-record): the stream is unusable.
            self._fail(PeerTimeout(f"{self.name}: peer stopped reading; transport closed"))

    # ------------------------------------------------------------------------- receive
    def _recv(self, timeout: float | None, expect: type | tuple[type, ...] | None) -> Received[Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._recv_lock:
            self._check_open()
            if self._eof:
                raise TransportClosed(f"{self.name}: peer has closed")
            try:
                if self._payload is None:
                    self._read_header(deadline)
                while self._got < self._length:
                    assert self._payload is not None  # set by _read_header, replaced by _grow_payload
                    if self._got == len(self._payload):
                        self._grow_payload()
                    self._got += self._read_some(self._payload[self._got:], deadline)
                payload = self._payload
                assert payload is not None
            except PeerTimeout:
                if not self._closed:  # partial frame kept: the next call resumes it
                    raise PeerTimeout(f"{self.name}: nothing received within {timeout}s") \
                        from None
                self._discard_frame()  # closed by another thread while we waited
                raise TransportClosed(f"{self.name}: transport is closed") from None
            except BaseException:
                if self._closed:  # the stream failed: drop the partial frame and its fds
                    self._discard_frame()
                raise
            fds, want, truncated = tuple(self._fds), self._want_fds, self._truncated
            self._reset_frame()
            self.bytes_received += HEADER.size + len(payload)
            try:
                return self._finish(payload, fds, want, truncated, expect)
            finally:
                payload.release()

    def _read_header(self, deadline: float | None) -> None:
        while self._hdr_got < HEADER.size:
            self._hdr_got += self._read_some(self._hdr_view[self._hdr_got:], deadline)
        length, nfds = HEADER.unpack(self._hdr)
        if length > codec.MAX_FRAME_BYTES:
            # We cannot skip that much safely; the stream is lost.
            self._fail(ProtocolError(f"{self.name}: frame of {length} bytes exceeds "
                                     f"{codec.MAX_FRAME_BYTES}"))
        if nfds and not self._unix:
            self._fail(ProtocolError(f"{self.name}: frame claims descriptors on a non-unix socket"))
        if length <= len(self._buf):
            buf = self._buf
        elif length <= _RETAIN:
            buf = self._buf = bytearray(length)
        else:
            # A one-off that grows as bytes arrive: a header alone must not commit 64 MiB.
            buf = bytearray(_RETAIN)
        self._payload = memoryview(buf)[:length]
        self._length = length
        self._want_fds = nfds

    def _grow_payload(self) -> None:
        """Double the one-off payload buffer (up to the frame's length), keeping what arrived."""
        old = self._payload
        assert old is not None
        new = bytearray(min(self._length, 2 * len(old)))
        new[: len(old)] = old
        old.release()
        self._payload = memoryview(new)

    def _finish(self, payload: memoryview, fds: tuple[int, ...], want: int, truncated: bool,
                expect: type | tuple[type, ...] | None) -> Received[Any]:
        # Framing is intact whatever happens here, so errors leave the transport usable.
        if truncated or len(fds) != want:
            close_fds(fds)
            raise ProtocolError(f"{self.name}: frame announced {want} descriptor(s), "
                                f"{'too many' if truncated else len(fds)} arrived")
        try:
            msg = codec.decode(payload, expect=expect)
        except ProtocolError as e:
            close_fds(fds)
            raise ProtocolError(f"{self.name}: {e}") from None
        return Received(msg, fds)

    def _read_some(self, view: memoryview, deadline: float | None) -> int:
        """Read at least one byte into ``view``; waits until ``deadline`` (PeerTimeout)."""
        while True:
            try:
                with self._io_lock:
                    self._check_open()
                    if self._unix:
                        n, anc, flags, _ = self._sock.recvmsg_into([view], _ANCBUF, socket.MSG_CMSG_CLOEXEC)
                        if anc or flags & socket.MSG_CTRUNC:
                            self._take_fds(anc, flags)
                    else:
                        n = self._sock.recv_into(view)
            except (BlockingIOError, ssl.SSLWantReadError):
                wait_ready(self._rpoll, deadline)
                continue
            except ssl.SSLWantWriteError:
                wait_ready(self._wpoll, deadline)
                continue
            except ssl.SSLError as e:
                if isinstance(e, _CLOSED_ERRORS):
                    n = 0
                else:
                    self._fail(ProtocolError(f"{self.name}: TLS error on receive: {e.reason}"))
            except OSError as e:
                self._fail(self._closed_error(e))
            if n == 0:
                self._eof = True
                mid = self._hdr_got > 0
                self._discard_frame()
                self._check_open()
                raise TransportClosed(f"{self.name}: peer closed" + (" mid-frame" if mid else ""))
            return n

    def _take_fds(self, anc: list[tuple[int, int, bytes]], flags: int) -> None:
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(data[: len(data) - len(data) % got.itemsize])
                self._fds.extend(got)
        if flags & socket.MSG_CTRUNC:
            self._truncated = True  # reported when the frame completes

    def _reset_frame(self) -> None:
        self._hdr = bytearray(HEADER.size)
        self._hdr_view = memoryview(self._hdr)
        self._hdr_got = 0
        self._payload = None
        self._length = 0  # the frame's declared payload length (the buffer may still be shorter)
        self._got = 0
        self._want_fds = 0
        self._fds: list[int] = []
        self._truncated = False

    def _discard_frame(self) -> None:
        close_fds(self._fds)
        if self._payload is not None:
            self._payload.release()
        self._reset_frame()

    # ------------------------------------------------------------------------- lifecycle
    def fileno(self) -> int:
        """The socket's descriptor. A selector can miss TLS bytes already decrypted: prefer recv(timeout)."""
        return self._fd

    def peer_certificate(self) -> bytes:
        """DER of the certificate the TLS peer presented (and the handshake verified)."""
        der = self._sock.getpeercert(binary_form=True) if isinstance(self._sock, ssl.SSLSocket) else None
        if not der:
            raise ProtocolError(f"{self.name}: no TLS peer certificate on this link")
        return der

    def close(self) -> None:
        with self._io_lock:
            if self._closed:
                return
            self._close_socket()
        # A receiver blocked in another thread discards its partial frame itself; else drop it here.
        if self._recv_lock.acquire(blocking=False):
            try:
                self._discard_frame()
            finally:
                self._recv_lock.release()

    def _close_socket(self) -> None:
        """Caller holds ``_io_lock``, so no socket call is in flight on this descriptor."""
        self._closed = True
        with suppress(OSError):
            self._sock.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"{self.name}: transport is closed")

    def _closed_error(self, e: OSError) -> TransportClosed:
        if self._closed:
            return TransportClosed(f"{self.name}: transport is closed")
        return TransportClosed(f"{self.name}: connection lost ({type(e).__name__})")

    def _fail(self, error: Exception) -> None:
        """Close the socket (the stream may be out of sync) and raise ``error``; close() cleans up."""
        with self._io_lock:
            if not self._closed:
                self._close_socket()
        raise error
