"""Transports: a small interface, an in-memory pair for tests, and real sockets for runs."""

from gputravel.transport.base import MAX_FDS, Received, Transport
from gputravel.transport.memory import MemoryTransport, memory_pair
from gputravel.transport.stream import StreamTransport
from gputravel.transport.unix import accept_unix, connect_unix, listen_unix, socketpair_transports
from gputravel.transport.tls import TlsListener, connect_tls

__all__ = ["MAX_FDS", "MemoryTransport", "Received", "StreamTransport", "TlsListener", "Transport", "accept_unix",
           "connect_tls", "connect_unix", "listen_unix", "memory_pair", "socketpair_transports"]
