"""AF_UNIX endpoints for stream transports (the only ones that carry descriptors)."""

from __future__ import annotations

import errno
import os
import select
import socket
import time

from gputravel.errors import BadInput, PeerTimeout, TransportClosed
from gputravel.transport.deadline import wait_ready
from gputravel.transport.stream import StreamTransport

__all__ = ["socketpair_transports", "listen_unix", "accept_unix", "connect_unix"]


def socketpair_transports(name_a: str = "a", name_b: str = "b") -> tuple[StreamTransport,
                                                                          StreamTransport]:
    """Two connected transports over ``socket.socketpair(AF_UNIX)`` (fd passing works)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return StreamTransport(a, name_a), StreamTransport(b, name_b)


def listen_unix(path: str | os.PathLike[str], backlog: int = 16) -> socket.socket:
    """A listening AF_UNIX socket at ``path``. A stale socket file is not removed for you."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(os.fspath(path))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        hint = " (remove the stale socket file if no one is listening)" if e.errno == errno.EADDRINUSE else ""
        raise BadInput(f"cannot listen on {os.fspath(path)!r}: {e.strerror or e}{hint}") from None
    return sock


def accept_unix(listener: socket.socket, name: str, *,
                timeout: float | None = None) -> StreamTransport:
    """Accept one connection on a :func:`listen_unix` socket (PeerTimeout after ``timeout``)."""
    poller = select.poll()
    poller.register(listener.fileno(), select.POLLIN)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            ready = wait_ready(poller, deadline)
        except PeerTimeout:
            raise PeerTimeout(f"{name}: no connection within {timeout}s") from None
        if not ready:
            continue  # the listener may be blocking: only accept once poll says a client waits
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            continue  # another acceptor won the race on a non-blocking listener
        return StreamTransport(conn, name)


def connect_unix(path: str | os.PathLike[str], name: str, *,
                 timeout: float = 10.0) -> StreamTransport:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(os.fspath(path))
    except OSError as e:
        sock.close()
        if isinstance(e, TimeoutError):
            raise PeerTimeout(f"{name}: connect to {os.fspath(path)!r} timed out") from None
        raise TransportClosed(f"{name}: cannot connect to {os.fspath(path)!r}: "
                              f"{e.strerror or type(e).__name__}") from None
    return StreamTransport(sock, name)
