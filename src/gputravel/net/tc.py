"""The shape of a link and the tc qdiscs that impose it: a tbf rate cap, a netem delay."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gputravel.errors import BadInput
from gputravel.net.iproute import run_iproute

MAX_BANDWIDTH_MBIT = 100_000.0  # 100 Gbit/s: anything above is a typo, not a link
MAX_DELAY_MS = 10_000.0


def check_bandwidth(bandwidth_mbit: float | None) -> None:
    """A cap in (0, MAX_BANDWIDTH_MBIT] Mbit/s, or None (uncapped); BadInput otherwise."""
    if bandwidth_mbit is None:
        return
    if isinstance(bandwidth_mbit, bool) or not isinstance(bandwidth_mbit, (int, float)):
        raise BadInput(f"bandwidth must be a number of Mbit/s or None, got {bandwidth_mbit!r}")
    if not math.isfinite(bandwidth_mbit) or not 0 < bandwidth_mbit <= MAX_BANDWIDTH_MBIT:
        raise BadInput(f"bandwidth must be a positive number of Mbit/s, at most {MAX_BANDWIDTH_MBIT:g}, or None "
                       f"(uncapped), got {bandwidth_mbit!r}")


def default_burst_bytes(bandwidth_mbit: float) -> int:
    """Bucket depth for a cap: 5 ms of traffic (timer slack at high rates), at least 32 KiB (half
    a 64 KiB GSO super-packet at low rates), so the queue drains at the cap, not below it."""
    return max(32 * 1024, int(bandwidth_mbit * 1e6 / 8 * 0.005))


# The tbf queue bound: 20, 50 and 200 ms measured the same goodput; 50 ms keeps control messages'
# delay behind a bulk transfer modest.
DEFAULT_LATENCY_MS = 50.0


@dataclass(frozen=True)
class LinkShape:
    """One holder<->hub link, each way: a cap (None: none), a delay, tbf's burst and latency (None: defaults)."""

    bandwidth_mbit: float | None = None
    delay_ms: float = 0.0
    burst_bytes: int | None = None
    latency_ms: float | None = None

    def __post_init__(self) -> None:
        check_bandwidth(self.bandwidth_mbit)
        if (isinstance(self.delay_ms, bool) or not isinstance(self.delay_ms, (int, float))
                or not math.isfinite(self.delay_ms) or not 0 <= self.delay_ms <= MAX_DELAY_MS):
            raise BadInput(f"delay must be in [0, {MAX_DELAY_MS:g}] ms, got {self.delay_ms!r}")
        if self.burst_bytes is not None and (not isinstance(self.burst_bytes, int)
                                             or not 1600 <= self.burst_bytes <= 1 << 30):
            raise BadInput(f"burst must be 1600 bytes (one frame) to 1 GiB, got {self.burst_bytes!r}")
        if self.latency_ms is not None and not 1 <= self.latency_ms <= 60_000:
            raise BadInput(f"tbf latency must be in [1, 60000] ms, got {self.latency_ms!r}")

    @property
    def capped(self) -> bool:
        return self.bandwidth_mbit is not None

    def tbf_args(self) -> list[str]:
        """The tbf part of a tc command line (the rate in bit/s: exact, no unit rounding)."""
        assert self.bandwidth_mbit is not None
        burst = self.burst_bytes or default_burst_bytes(self.bandwidth_mbit)
        latency = self.latency_ms or DEFAULT_LATENCY_MS
        return ["tbf", "rate", f"{round(self.bandwidth_mbit * 1e6)}bit", "burst", str(burst),
                "latency", f"{latency:g}ms"]


def shape_device(ns: str, dev: str, shape: LinkShape) -> None:
    """Apply the shape to one device's egress. With a delay, netem is the root and tbf its child
    (netem's own rate is not used: this kernel family may lack it)."""
    base = ["tc", "-n", ns, "qdisc", "add", "dev", dev]
    if shape.delay_ms > 0:
        # The netem queue must hold a delay's worth of packets at line rate.
        run_iproute([*base, "root", "handle", "1:", "netem", "delay", f"{shape.delay_ms:g}ms", "limit", "100000"])
        if shape.capped:
            run_iproute([*base, "parent", "1:1", "handle", "10:", *shape.tbf_args()])
    elif shape.capped:
        run_iproute([*base, "root", *shape.tbf_args()])
