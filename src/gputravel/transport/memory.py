"""An in-process transport pair for tests: two queues, but the real codec (encoded on send,
decoded on recv) and SCM_RIGHTS semantics (descriptors ``os.dup``-ed on send)."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Sequence
from typing import Any

from gputravel.protocol import codec
from gputravel.errors import PeerTimeout, ProtocolError, TransportClosed
from gputravel.transport.base import Received, Transport, check_fds, close_fds

__all__ = ["MemoryTransport", "memory_pair"]

_Inbox = queue.SimpleQueue[tuple[bytes, tuple[int, ...]] | None]  # a message and its descriptors; None: closed


class MemoryTransport(Transport):
    """One end of a :func:`memory_pair`."""

    def __init__(self, name: str, inbox: _Inbox, outbox: _Inbox,
                 lock: threading.Lock) -> None:
        self.name = name
        self._inbox = inbox
        self._outbox = outbox
        # One lock per pair: a send racing the peer's close must not strand dup-ed fds.
        self._lock = lock
        self._closed = False  # this end closed
        self._peer_closed = False  # the peer's end-of-stream marker has been seen
        self.peer: MemoryTransport | None = None

    def send(self, message: object, fds: Sequence[int] = ()) -> None:
        fds = check_fds(self.name, fds)
        data = codec.encode(message)
        if len(data) > codec.MAX_FRAME_BYTES:
            raise ProtocolError(f"{self.name}: message of {len(data)} bytes exceeds "
                                f"{codec.MAX_FRAME_BYTES}")
        with self._lock:
            if self._closed:
                raise TransportClosed(f"{self.name}: transport is closed")
            peer = self.peer
            if peer is None or peer._closed:
                raise TransportClosed(f"{self.name}: peer has closed")
            dups = tuple(os.dup(fd) for fd in fds)
            self._outbox.put((data, dups))

    def _recv(self, timeout: float | None, expect: type | tuple[type, ...] | None) -> Received[Any]:
        item = None
        if not (self._closed or self._peer_closed):
            try:
                item = self._inbox.get(timeout=timeout)
            except queue.Empty:
                raise PeerTimeout(f"{self.name}: nothing received within {timeout}s") from None
        if item is None:  # this end closed, or the peer's end-of-stream marker
            self._peer_closed = not self._closed
            raise TransportClosed(f"{self.name}: " + ("transport is closed" if self._closed else "peer has closed"))
        data, fds = item
        try:
            msg = codec.decode(data, expect=expect)
        except ProtocolError as e:
            close_fds(fds)  # nobody will own them
            raise ProtocolError(f"{self.name}: {e}") from None
        return Received(msg, fds)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._outbox.put(None)
            self._drain()  # undelivered descriptors would leak
            self._inbox.put(None)  # wakes a recv blocked on this end in another thread

    def _drain(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                close_fds(item[1])


def memory_pair(name_a: str = "a", name_b: str = "b") -> tuple[MemoryTransport, MemoryTransport]:
    """Two connected in-memory transports; thread-safe, ordered, with fd passing."""
    a_to_b: _Inbox = queue.SimpleQueue()
    b_to_a: _Inbox = queue.SimpleQueue()
    lock = threading.Lock()
    a = MemoryTransport(name_a, inbox=b_to_a, outbox=a_to_b, lock=lock)
    b = MemoryTransport(name_b, inbox=a_to_b, outbox=b_to_a, lock=lock)
    a.peer, b.peer = b, a
    return a, b
