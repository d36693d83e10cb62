"""Bandwidth-capped links between cohort members, like the paper's capped CVM virtio links.

Two kinds of link exist, and every result must say which one it ran on:

* ``LINK_NETNS`` ("netns-tc"): :class:`ShapedLinks` puts each member in its own network
  namespace, wired as a star around the orchestrator's namespace (a bridge in the hub, one
  veth pair per holder), and caps both directions of each holder's link with a kernel token
  bucket filter (``tc qdisc ... tbf``). Traffic between two processes then crosses a real
  TCP/IP stack and a real queue, as it did between the paper's CVMs.
* ``LINK_TOKEN_BUCKET`` ("token-bucket"): :class:`TokenBucket` and :func:`paced_socket`
  pace ``send`` in-process. It is the fallback where namespaces are unavailable (no root,
  no ``ip``, no ``sch_tbf``); it caps what one sender writes, not the wire.

Only ``ip`` (iproute2) and ``tc`` are used, always with argument lists, never a shell.
See docs/links.md for the picture, the tc parameters and how to inspect a live set-up.
"""

from __future__ import annotations

import atexit
import functools
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from gputravel.errors import BadInput, LocalError

LINK_NETNS = "netns-tc"
LINK_TOKEN_BUCKET = "token-bucket"

# Every namespace we create is named gt-<owner pid, hex>-<random>-<index><member>, so that
# cleanup_stale can tell a crashed run's leftovers (owner dead) from a live run's.
NS_PREFIX = "gt-"
_NS_RE = re.compile(r"^gt-([0-9a-f]+)-")

# Namespaces are private, so one fixed subnet serves every run (even concurrent ones).
_SUBNET = "10.213.0"
_PREFIX_LEN = 24
_MAX_HOLDERS = 250
_BRIDGE = "gt-br"
_HOLDER_IF = "gt-up"  # the holder's end of its link, inside the holder's namespace

MAX_BANDWIDTH_MBIT = 100_000.0  # 100 Gbit/s: anything above is a typo, not a link
MAX_DELAY_MS = 10_000.0
_CMD_TIMEOUT = 30.0


class LinkError(LocalError):
    """Setting up or tearing down shaped links failed; the message names the command and
    carries its stderr."""


# ----------------------------------------------------------------------------- commands
def _cmd(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ip/tc command; a failure becomes LinkError with the command and its stderr."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LinkError(f"{' '.join(argv)}: {e}") from e
    if check and done.returncode != 0:
        raise LinkError(f"{' '.join(argv)} failed (exit {done.returncode}): "
                        f"{done.stderr.strip() or done.stdout.strip()}")
    return done


def _list_namespaces() -> list[str]:
    # Lines look like "name" or "name (id: 3)".
    out = _cmd(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _namespace_pids(ns: str) -> list[int]:
    out = _cmd(["ip", "netns", "pids", ns], check=False).stdout
    return [int(tok) for tok in out.split() if tok.isdigit()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(ns: str) -> None:
    """Kill what still runs inside, then delete. A process left inside would keep the
    namespace (and its veths) alive after its name is gone."""
    pids = _namespace_pids(ns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # Re-ask the kernel rather than probing pids: a killed child of ours stays a zombie
    # until reaped, yet it has already left the namespace.
    deadline = time.monotonic() + 5.0
    while pids and _namespace_pids(ns) and time.monotonic() < deadline:
        time.sleep(0.02)
    _cmd(["ip", "netns", "delete", ns])


def cleanup_stale(prefix: str = NS_PREFIX) -> list[str]:
    """Delete namespaces named by an earlier run whose owner process is dead.

    Only names that start with ``prefix`` and follow our pattern are touched, and a live
    owner's namespaces are left alone, so concurrent runs do not tear each other down.
    Returns the names deleted."""
    if not prefix.startswith(NS_PREFIX):
        raise BadInput(f"prefix must start with {NS_PREFIX!r}, got {prefix!r}")
    removed = []
    for ns in _list_namespaces():
        m = _NS_RE.match(ns)
        if not ns.startswith(prefix) or m is None or _pid_alive(int(m.group(1), 16)):
            continue
        _delete_namespace(ns)
        removed.append(ns)
    return removed


# ----------------------------------------------------------------------------- probe
@functools.cache
def netns_available() -> tuple[bool, str]:
    """Whether ShapedLinks can work here, and why not: checks root, the tools, and actually
    builds a throwaway namespace with a bridge, a veth pair and a tbf qdisc."""
    if os.geteuid() != 0:
        return False, "network namespaces need root (euid is not 0)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"{tool!r} (iproute2) is not installed"
    ns = f"{NS_PREFIX}{os.getpid():x}-probe"
    try:
        _cmd(["ip", "netns", "add", ns])
    except LinkError as e:
        return False, f"cannot create a network namespace: {e}"
    try:
        _cmd(["ip", "-n", ns, "link", "add", "gt-a", "type", "veth", "peer", "name", "gt-b"])
        _cmd(["ip", "-n", ns, "link", "add", _BRIDGE, "type", "bridge"])
        _cmd(["tc", "-n", ns, "qdisc", "add", "dev", "gt-a", "root", "tbf", "rate", "20mbit",
              "burst", "32768", "latency", "100ms"])
    except LinkError as e:
        return False, f"veth, bridge or tc tbf unavailable: {e}"
    finally:
        _cmd(["ip", "netns", "delete", ns], check=False)
    return True, "network namespaces, veth, bridge and tc tbf are available"


@functools.cache
def netem_available() -> bool:
    """Whether the kernel has sch_netem, needed only for ``delay_ms`` > 0."""
    if not netns_available()[0]:
        return False
    ns = f"{NS_PREFIX}{os.getpid():x}-probenetem"
    try:
        _cmd(["ip", "netns", "add", ns])
        _cmd(["ip", "-n", ns, "link", "add", "gt-a", "type", "veth", "peer", "name", "gt-b"])
        _cmd(["tc", "-n", ns, "qdisc", "add", "dev", "gt-a", "root", "netem", "delay", "1ms"])
        return True
    except LinkError:
        return False
    finally:
        _cmd(["ip", "netns", "delete", ns], check=False)


# ----------------------------------------------------------------------------- link shape
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
    """Bucket depth for a cap: 5 ms of traffic, at least 32 KiB.

    The floor keeps a bucket above one 64 KiB GSO super-packet's worth of halves at low rates
    (tbf splits larger ones), and 5 ms at high rates covers timer slack, so the queue drains
    at the cap rather than below it. A burst is sent at once, so it inflates a short
    transfer's rate: 32 KiB is 1.6 % of a 2 MiB transfer."""
    return max(32 * 1024, int(bandwidth_mbit * 1e6 / 8 * 0.005))


# The tbf queue bound. Measured: 20, 50 and 200 ms give the same goodput (within 0.1 %) at
# 4-500 Mbit/s, because the senders are local and TCP backs off on a qdisc drop without a
# retransmission timeout; 50 ms keeps the queueing delay that control messages see behind a
# bulk transfer modest while leaving room for a real sender's bursts.
DEFAULT_LATENCY_MS = 50.0


@dataclass(frozen=True)
class LinkShape:
    """What one holder<->hub link looks like, each direction: a rate cap (None: uncapped),
    a one-way delay, and the tbf bucket depth and queue bound (None: the defaults)."""

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
        """The tbf part of a tc command line: rate in bit/s (exact, no unit rounding), burst
        in bytes, latency in ms."""
        assert self.bandwidth_mbit is not None
        burst = self.burst_bytes or default_burst_bytes(self.bandwidth_mbit)
        latency = self.latency_ms or DEFAULT_LATENCY_MS
        return ["tbf", "rate", f"{round(self.bandwidth_mbit * 1e6)}bit", "burst", str(burst),
                "latency", f"{latency:g}ms"]


def _shape_device(ns: str, dev: str, shape: LinkShape) -> None:
    """Apply the shape to one device's egress. With a delay, netem is the root and tbf its
    child, so packets are first rate-limited, then delayed (netem's own rate is not used:
    this kernel family may lack it, and tbf was measured accurate)."""
    base = ["tc", "-n", ns, "qdisc", "add", "dev", dev]
    if shape.delay_ms > 0:
        # The netem queue must hold a delay's worth of packets at line rate.
        _cmd([*base, "root", "handle", "1:", "netem", "delay", f"{shape.delay_ms:g}ms",
              "limit", "100000"])
        if shape.capped:
            _cmd([*base, "parent", "1:1", "handle", "10:", *shape.tbf_args()])
    elif shape.capped:
        _cmd([*base, "root", *shape.tbf_args()])


# ----------------------------------------------------------------------------- the star
def _slug(member: str) -> str:
    return re.sub(r"[^a-z0-9]", "", member.lower())[:8]


class ShapedLinks:
    """A star of network namespaces, one per cohort member, the hub in the middle.

    ::

        holder a [gt-up]==veth==[gt-h1]--+
        holder b [gt-up]==veth==[gt-h2]--+-- gt-br 10.213.0.1  (hub: the orchestrator)
        holder c [gt-up]==veth==[gt-h3]--+

    Holder i is 10.213.0.(i+1)/24. Each veth end's egress carries the link shape, so each
    direction of each holder's link is capped on its own, like a full-duplex NIC. Use as a
    context manager; teardown deletes every namespace (and so every veth and the bridge),
    even when the body raises, and again at interpreter exit if close() was never reached.
    """

    link = LINK_NETNS

    def __init__(self, holders: Sequence[str], *, hub: str = "orchestrator",
                 bandwidth_mbit: float | None = None, delay_ms: float = 0.0,
                 burst_bytes: int | None = None, latency_ms: float | None = None) -> None:
        self.shape = LinkShape(bandwidth_mbit, delay_ms, burst_bytes, latency_ms)
        if isinstance(holders, str):  # a lone name would be split into one holder per letter
            raise BadInput(f"holders must be a sequence of names, got the string {holders!r}")
        members = (hub, *holders)
        if not holders:
            raise BadInput("shaped links need at least one holder")
        if len(holders) > _MAX_HOLDERS:
            raise BadInput(f"at most {_MAX_HOLDERS} holders fit the link subnet, got {len(holders)}")
        if any(not isinstance(m, str) or not m for m in members):
            raise BadInput("member names must be non-empty strings")
        if len(set(members)) != len(members):
            raise BadInput(f"member names must be unique, got {list(members)}")
        self.hub = hub
        self.members: tuple[str, ...] = members
        self.run_id = f"{os.getpid():x}-{secrets.token_hex(2)}"
        self._ns = {m: f"{NS_PREFIX}{self.run_id}-{i}{_slug(m)}" for i, m in enumerate(members)}
        self._addr = {m: f"{_SUBNET}.{i + 1}" for i, m in enumerate(members)}
        self._created: list[str] = []
        self._open = False

    # -------------------------------------------------------------- lookups
    def namespace(self, member: str) -> str:
        return self._ns[self._known(member)]

    def address(self, member: str) -> str:
        """The IPv4 address the other members use to reach ``member``."""
        return self._addr[self._known(member)]

    def exec_prefix(self, member: str) -> list[str]:
        """Prepend to an argv to run it inside ``member``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(member)]

    def run(self, member: str, argv: Sequence[str], *, input: bytes | None = None,
            timeout: float = 60.0) -> subprocess.CompletedProcess[bytes]:
        """Run ``argv`` to completion inside ``member``'s namespace (output captured)."""
        self._check_open()
        return subprocess.run([*self.exec_prefix(member), *argv], input=input,
                              capture_output=True, timeout=timeout)

    def _known(self, member: str) -> str:
        if member not in self._ns:
            raise BadInput(f"unknown member {member!r}; members are {list(self.members)}")
        return member

    def _check_open(self) -> None:
        if not self._open:
            raise BadInput("shaped links are not set up (use them inside `with`)")

    # -------------------------------------------------------------- lifecycle
    def __enter__(self) -> ShapedLinks:
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except LinkError as e:
            if exc is None:
                raise
            # Do not hide the body's error behind a teardown one; attach it instead.
            exc.add_note(f"also, shaped-link teardown failed: {e}")

    def open(self) -> None:
        if self._open or self._created:
            raise BadInput("shaped links are already set up")
        ok, why = netns_available()
        if not ok:
            raise LinkError(f"cannot build shaped links: {why}")
        if self.shape.delay_ms > 0 and not netem_available():
            raise LinkError("a delay needs sch_netem, which this kernel lacks")
        cleanup_stale()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self._open = True

    def _build(self) -> None:
        for m in self.members:
            _cmd(["ip", "netns", "add", self._ns[m]])
            self._created.append(self._ns[m])
            _cmd(["ip", "-n", self._ns[m], "link", "set", "lo", "up"])
        hub = self._ns[self.hub]
        _cmd(["ip", "-n", hub, "link", "add", _BRIDGE, "type", "bridge"])
        _cmd(["ip", "-n", hub, "addr", "add", f"{self._addr[self.hub]}/{_PREFIX_LEN}",
              "dev", _BRIDGE])
        _cmd(["ip", "-n", hub, "link", "set", _BRIDGE, "up"])
        for i, m in enumerate(self.members[1:], start=1):
            self._wire_holder(m, f"gt-h{i}")

    def _wire_holder(self, member: str, hub_dev: str) -> None:
        hub, ns = self._ns[self.hub], self._ns[member]
        # Both ends are created directly inside their namespaces: no name ever appears in the
        # root namespace, so concurrent runs cannot collide on interface names.
        _cmd(["ip", "link", "add", hub_dev, "netns", hub, "type", "veth",
              "peer", "name", _HOLDER_IF, "netns", ns])
        _cmd(["ip", "-n", hub, "link", "set", hub_dev, "master", _BRIDGE])
        _cmd(["ip", "-n", ns, "addr", "add", f"{self._addr[member]}/{_PREFIX_LEN}",
              "dev", _HOLDER_IF])
        _shape_device(ns, _HOLDER_IF, self.shape)  # holder -> hub
        _shape_device(hub, hub_dev, self.shape)  # hub -> holder
        _cmd(["ip", "-n", hub, "link", "set", hub_dev, "up"])
        _cmd(["ip", "-n", ns, "link", "set", _HOLDER_IF, "up"])

    def close(self) -> None:
        """Delete every namespace this instance created; idempotent. Processes still inside
        are killed first (they would otherwise keep the namespace alive)."""
        self._open = False
        atexit.unregister(self.close)
        errors = []
        while self._created:
            ns = self._created.pop()
            try:
                _delete_namespace(ns)
            except LinkError as e:
                errors.append(str(e))
        if errors:
            raise LinkError("teardown left namespaces behind: " + "; ".join(errors))

    def qdisc_report(self, member: str) -> str:
        """``tc -s qdisc show`` inside a member's namespace: the counters prove shaping ran."""
        self._check_open()
        return _cmd(["tc", "-n", self.namespace(member), "-s", "qdisc", "show"]).stdout


# ----------------------------------------------------------------------------- measuring
# The receiver times from accept to EOF, so interpreter start-up is never counted.
_SERVER = """
import hashlib, socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); t0 = time.monotonic(); h = hashlib.sha256(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b); h.update(b)
t1 = time.monotonic(); c.sendall(b"k"); c.close()
print(n, t1 - t0, h.hexdigest(), flush=True)
"""

# Pseudo-random bytes, so a dropped or reordered chunk changes the digest.
_CLIENT = """
import hashlib, random, socket, sys
addr, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = random.Random(n).randbytes(n)
c = socket.create_connection((addr, port), timeout=30); c.settimeout(None)
c.sendall(data); c.shutdown(socket.SHUT_WR); c.recv(1)
print(hashlib.sha256(data).hexdigest(), flush=True)
"""


@dataclass(frozen=True)
class Transfer:
    """One TCP transfer between two members, timed by the receiver."""

    link: str
    src: str
    dst: str
    sent_bytes: int
    received_bytes: int
    seconds: float
    sent_sha256: str
    received_sha256: str

    @property
    def intact(self) -> bool:
        return self.sent_bytes == self.received_bytes and self.sent_sha256 == self.received_sha256

    @property
    def mbit_per_s(self) -> float:
        return self.received_bytes * 8 / self.seconds / 1e6 if self.seconds > 0 else math.inf


def transfer(links: ShapedLinks, src: str, dst: str, nbytes: int, *,
             timeout: float | None = None) -> Transfer:
    """Send ``nbytes`` over TCP from ``src``'s namespace to ``dst``'s and time the receipt."""
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise BadInput(f"transfer size must be a positive number of bytes, got {nbytes!r}")
    if timeout is None:
        rate = links.shape.bandwidth_mbit or 1000.0
        timeout = 30.0 + 4 * nbytes * 8 / (rate * 1e6)
    server = subprocess.Popen([*links.exec_prefix(dst), sys.executable, "-c", _SERVER,
                               links.address(dst)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().strip() if server.stdout else ""
        if not port.isdigit():
            raise LinkError(f"receiver in {dst!r} did not start: {server.communicate()[1].strip()}")
        client = links.run(src, [sys.executable, "-c", _CLIENT, links.address(dst), port,
                                 str(nbytes)], timeout=timeout)
        if client.returncode != 0:
            raise LinkError(f"sender in {src!r} failed: {client.stderr.decode().strip()}")
        out, err = server.communicate(timeout=timeout)
        if server.returncode != 0:
            raise LinkError(f"receiver in {dst!r} failed: {err.strip()}")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    got, seconds, digest = out.split()
    return Transfer(links.link, src, dst, nbytes, int(got), float(seconds),
                    client.stdout.decode().strip(), digest)


def measure_rate(links: ShapedLinks, src: str, dst: str, nbytes: int) -> float:
    """Goodput of one real TCP transfer from ``src`` to ``dst``, in Mbit/s (10^6 bit/s)."""
    t = transfer(links, src, dst, nbytes)
    if not t.intact:
        raise LinkError(f"transfer {src}->{dst} arrived damaged ({t.received_bytes} of "
                        f"{t.sent_bytes} bytes, digests differ)")
    return t.mbit_per_s


@dataclass(frozen=True)
class RateCheck:
    """A capped transfer against the issue's target: time within ``tolerance`` of size/cap."""

    cap_mbit: float
    nbytes: int
    measured_mbit: float
    expected_s: float
    measured_s: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return abs(self.measured_s - self.expected_s) <= self.tolerance * self.expected_s


def check_rate(links: ShapedLinks, src: str, dst: str, nbytes: int, *,
               tolerance: float = 0.15) -> RateCheck:
    """Measure one transfer and compare its duration with size/cap (for the benchmark; unit
    tests make no timing claims). The cap counts frame bytes, so TCP goodput sits ~4-5 %
    under it at MTU 1500, well inside the tolerance."""
    cap = links.shape.bandwidth_mbit
    if cap is None:
        raise BadInput("an uncapped link has no rate to check")
    t = transfer(links, src, dst, nbytes)
    if not t.intact:
        raise LinkError(f"transfer {src}->{dst} arrived damaged")
    return RateCheck(cap, nbytes, t.mbit_per_s, nbytes * 8 / (cap * 1e6), t.seconds, tolerance)


# ----------------------------------------------------------------------------- in-process
class TokenBucket:
    """A token bucket in bytes: ``rate_bps`` bits/s refill, at most ``burst_bytes`` banked.

    Pure logic over an injectable clock: :meth:`consume` takes ``n`` bytes and says how long
    the caller must wait before they may leave. Tokens may go negative (a debt), so a send
    larger than the burst is still paced exactly, and back-to-back sends each wait n/rate.
    Not thread-safe: use one bucket per sending direction, as a duplex link has."""

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
        self._tokens = min(float(self.burst_bytes),
                           self._tokens + (now - self._stamp) * self._bytes_per_s)
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
    """A socket whose ``send``/``sendall`` are paced by a :class:`TokenBucket`; every other
    attribute is the wrapped socket's. Each send offers at most one burst (and 64 KiB) and
    then pays for what the socket took, sleeping off any debt: so only bytes really sent are
    charged, however short the sends. It paces application bytes: TLS record and TCP/IP
    overhead come on top (under 5 %)."""

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


def paced_socket(sock, bucket: TokenBucket) -> PacedSocket:
    """Wrap a socket-like object so its sends keep to ``bucket``'s rate (the fallback link)."""
    return PacedSocket(sock, bucket)
