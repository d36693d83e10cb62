"""The transport interface: codec messages (and file descriptors, which the receiver owns and must
close, as with SCM_RIGHTS) between two peers; callers only ever see message structs."""

from __future__ import annotations

import abc
import os
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, TypeVar, overload

from gputravel.errors import BadInput, ProtocolError

__all__ = ["Received", "Transport", "MAX_FDS"]

MAX_FDS = 253
"""Most descriptors one message may carry (Linux SCM_MAX_FD)."""

# What ``recv(expect=...)`` returns, for type checkers: the class, or the union of up to three.
M = TypeVar("M")
N = TypeVar("N")
O = TypeVar("O")  # noqa: E741  # M, N, O: three message classes


@dataclass(frozen=True)
class Received(Generic[M]):
    """One received message and the descriptors that came with it (owned by the receiver)."""

    message: M
    fds: tuple[int, ...] = ()


class Transport(abc.ABC):
    """A bidirectional, ordered, message-oriented link to one peer."""

    name: str

    @abc.abstractmethod
    def send(self, message: object, fds: Sequence[int] = ()) -> None:
        """Send one registered message; ``fds`` are duplicated to the peer, not moved."""

    @overload
    def recv(self, timeout: float | None = None, *, expect: tuple[type[M], type[N]]) -> Received[M | N]: ...
    @overload
    def recv(self, timeout: float | None = None, *,
             expect: tuple[type[M], type[N], type[O]]) -> Received[M | N | O]: ...
    @overload
    def recv(self, timeout: float | None = None, *, expect: type[M] | tuple[type[M], ...]) -> Received[M]: ...
    @overload
    def recv(self, timeout: float | None = None, *, expect: None = None) -> Received[object]: ...

    def recv(self, timeout: float | None = None, *,
             expect: type | tuple[type, ...] | None = None) -> Received[Any]:
        """Receive the next message. PeerTimeout after ``timeout`` (the transport stays usable),
        TransportClosed once the peer closed and all it sent is read, ProtocolError for a malformed
        message or one not in ``expect``."""
        return self._recv(timeout, expect)  # the typed overloads above live here only

    @abc.abstractmethod
    def _recv(self, timeout: float | None, expect: type | tuple[type, ...] | None) -> Received[Any]: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Close this end (idempotent); the peer's recv then raises TransportClosed."""

    def fileno(self) -> int:
        """A descriptor that becomes readable when a message may be available (for selectors)."""
        raise BadInput(f"{self.name}: this transport has no file descriptor")

    def peer_certificate(self) -> bytes:
        """DER of the TLS peer's certificate, what an attestation binds to; ProtocolError if none."""
        raise ProtocolError(f"{self.name}: no TLS peer certificate on this link")

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


def check_fds(name: str, fds: Sequence[int]) -> tuple[int, ...]:
    out = tuple(fds)
    if len(out) > MAX_FDS:
        raise BadInput(f"{name}: at most {MAX_FDS} descriptors per message, got {len(out)}")
    for fd in out:
        if type(fd) is not int or fd < 0:
            raise BadInput(f"{name}: descriptors must be non-negative ints")
    return out


def close_fds(fds: Sequence[int]) -> None:
    """Close descriptors nobody will own (already-closed ones are skipped)."""
    for fd in fds:
        with suppress(OSError):
            os.close(fd)
