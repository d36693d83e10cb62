"""The in-process fallback link where namespaces are unavailable: a token bucket that paces ``send``."""

from __future__ import annotations

import math
import time
from typing import Callable

from gputravel.errors import BadInput
from gputravel.net.tc import MAX_BANDWIDTH_MBIT, check_bandwidth, default_burst_bytes

LINK_TOKEN_BUCKET = "token-bucket"


class TokenBucket:
    """A token bucket in bytes: ``rate_bps`` bits/s refill, at most ``burst_bytes`` banked. Tokens
    may go negative (a debt), so a send above the burst is still paced exactly. One per direction."""

    def __init__(self, rate_bps: float, burst_bytes: int, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if isinstance(rate_bps, bool) or not isinstance(rate_bps, (int, float)) \
                or not math.isfinite(rate_bps) or not 0 < rate_bps <= MAX_BANDWIDTH_MBIT * 1e6:
            raise BadInput(f"rate must be in (0, {MAX_BANDWIDTH_MBIT * 1e6:g}] bit/s, got {rate_bps!r}")
        if isinstance(burst_bytes, bool) or not isinstance(burst_bytes, int) or burst_bytes <= 0:
            raise BadInput(f"burst must be a positive number of bytes, got {burst_bytes!r}")
        self.rate_bps = float(rate_bps)
        self.burst_bytes = burst_bytes
        self._bytes_per_s = self.rate_bps / 8
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(burst_bytes)  # a fresh link may send one burst at once
        self._stamp = clock()

    @classmethod
    def from_mbit(cls, bandwidth_mbit: float, burst_bytes: int | None = None,
                  **kw: Callable) -> TokenBucket:
        """A bucket matching a netns link of the same cap (same default burst)."""
        check_bandwidth(bandwidth_mbit)
        return cls(bandwidth_mbit * 1e6, burst_bytes or default_burst_bytes(bandwidth_mbit), **kw)

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(float(self.burst_bytes), self._tokens + (now - self._stamp) * self._bytes_per_s)
        self._stamp = now

    @property
    def tokens(self) -> float:
        """Bytes that may leave now (negative: a debt still being paid off)."""
        self._refill()
        return self._tokens

    def wait_for(self, nbytes: int) -> float:
        """Seconds until ``nbytes`` could leave, without taking them."""
        self._refill()
        return max(0.0, (nbytes - self._tokens) / self._bytes_per_s)

    def consume(self, nbytes: int) -> float:
        """Take ``nbytes`` now; return the seconds to wait before they may leave."""
        if nbytes < 0:
            raise BadInput(f"cannot consume a negative byte count ({nbytes})")
        wait = self.wait_for(nbytes)
        self._tokens -= nbytes
        return wait

    def throttle(self, nbytes: int) -> float:
        """Take ``nbytes`` and sleep until they may leave; returns the time slept."""
        wait = self.consume(nbytes)
        if wait > 0:
            self._sleep(wait)
        return wait


class PacedSocket:
    """A socket whose sends are paced by a :class:`TokenBucket`: each offers at most one burst (and
    64 KiB), then pays for what the socket took, so only bytes really sent are charged."""

    link = LINK_TOKEN_BUCKET

    def __init__(self, sock, bucket: TokenBucket) -> None:
        self._sock = sock
        self._bucket = bucket
        self._chunk = max(1, min(bucket.burst_bytes, 64 * 1024))

    def send(self, data, flags: int = 0) -> int:
        chunk = memoryview(data).cast("B")[: self._chunk]
        n = self._sock.send(chunk, flags) if flags else self._sock.send(chunk)
        self._bucket.throttle(n)
        return n

    def sendall(self, data, flags: int = 0) -> None:
        view = memoryview(data).cast("B")
        while view:
            view = view[self.send(view, flags):]

    def __getattr__(self, name: str):
        return getattr(self._sock, name)
