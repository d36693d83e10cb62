"""Shaped links: namespaces that come and go cleanly, tc caps that are really applied, and
the in-process token bucket's arithmetic. No timing assertions here: the measured rates are
checked by the benchmark (gputravel.net.check_rate)."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys

import pytest

from gputravel.errors import BadInput
from gputravel.net import (
    LINK_NETNS,
    LINK_TOKEN_BUCKET,
    LinkError,
    LinkShape,
    PacedSocket,
    ShapedLinks,
    TokenBucket,
    cleanup_stale,
    default_burst_bytes,
    netem_available,
    netns_available,
    transfer,
)
from gputravel.net import shaped
from gputravel.net.iproute import run_iproute

NETNS_OK, NETNS_WHY = netns_available()
needs_netns = pytest.mark.skipif(not NETNS_OK, reason=f"shaped links unavailable: {NETNS_WHY}")
KIB = 1024


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def root_interfaces() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                         check=True).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]


def names_of(links: ShapedLinks) -> set[str]:
    return {links.namespace(m) for m in links.members}


def assert_gone(names: set[str]) -> None:
    assert not names & namespaces()
    for ns in names:
        assert not os.path.exists(f"/run/netns/{ns}")
    assert not [i for i in root_interfaces() if i.startswith("gt")]


def sent_bytes(report: str, dev: str) -> int:
    m = re.search(rf"qdisc tbf \S+ dev {re.escape(dev)} .*?\n Sent (\d+) bytes", report)
    assert m, f"no tbf on {dev}:\n{report}"
    return int(m.group(1))


# ----------------------------------------------------------------------------- namespaces
@needs_netns
def test_setup_builds_a_reachable_capped_star(processes):
    with ShapedLinks(["alice", "bob"], bandwidth_mbit=20) as links:
        assert names_of(links) <= namespaces()
        assert len({links.address(m) for m in links.members}) == 3
        assert links.exec_prefix("bob") == ["ip", "netns", "exec", links.namespace("bob")]
        # A TCP connection each way between each holder and the hub, and holder to holder.
        for src, dst in (("alice", "orchestrator"), ("orchestrator", "bob"), ("bob", "alice")):
            t = transfer(links, src, dst, 4 * KIB)
            assert t.link == LINK_NETNS and t.intact
        # Both ends of every holder link carry the 20 Mbit/s tbf.
        assert "tbf" in links.qdisc_report("alice") and "rate 20Mbit" in links.qdisc_report("alice")
        hub = links.qdisc_report("orchestrator")
        assert sent_bytes(hub, "gt-h1") > 0 and sent_bytes(hub, "gt-h2") > 0


@needs_netns
def test_uncapped_links_have_no_token_bucket(processes):
    with ShapedLinks(["alice"]) as links:
        assert "tbf" not in links.qdisc_report("alice") + links.qdisc_report("orchestrator")
        assert transfer(links, "alice", "orchestrator", 64 * KIB).intact


@needs_netns
def test_transfer_at_a_small_cap_arrives_intact_through_the_bucket(processes):
    with ShapedLinks(["alice"], bandwidth_mbit=20) as links:
        up = transfer(links, "alice", "orchestrator", 256 * KIB)
        down = transfer(links, "orchestrator", "alice", 256 * KIB)
        assert up.intact and down.intact and up.received_bytes == 256 * KIB
        # The payload really crossed the shaped queues, in each direction.
        assert sent_bytes(links.qdisc_report("alice"), "gt-up") > 256 * KIB
        assert sent_bytes(links.qdisc_report("orchestrator"), "gt-h1") > 256 * KIB


@needs_netns
def test_teardown_removes_namespaces_interfaces_and_processes_inside(processes):
    links = ShapedLinks(["alice", "bob"], bandwidth_mbit=100)
    with links:
        names = names_of(links)
        sleeper = subprocess.Popen([*links.exec_prefix("alice"), "sleep", "60"])
    assert_gone(names)
    assert sleeper.wait(timeout=5) == -9  # killed, or it would keep the namespace alive
    links.close()  # idempotent


@needs_netns
def test_teardown_happens_when_the_body_raises(processes):
    with pytest.raises(RuntimeError, match="boom"):
        with ShapedLinks(["alice"], bandwidth_mbit=20) as links:
            names = names_of(links)
            raise RuntimeError("boom")
    assert_gone(names)


@needs_netns
def test_failed_setup_leaves_nothing(processes, monkeypatch):
    def broken(ns, dev, shape):
        raise LinkError("tc qdisc add failed (exit 2): injected")

    monkeypatch.setattr(shaped, "shape_device", broken)
    links = ShapedLinks(["alice", "bob"], bandwidth_mbit=20)
    with pytest.raises(LinkError, match="injected"):
        links.open()
    assert_gone(names_of(links))


@needs_netns
def test_cleanup_stale_removes_only_dead_owners_namespaces(processes):
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = f"gt-{gone.pid:x}-dead-0x"
    live = f"gt-{os.getpid():x}-live-0x"
    for ns in (dead, live):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        removed = cleanup_stale()
        assert dead in removed and dead not in namespaces()
        assert live in namespaces()
    finally:
        for ns in (dead, live):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


@needs_netns
def test_exec_prefix_keeps_passed_descriptors(processes):
    # The supervisor hands control sockets to children by fd; they must survive `ip netns exec`.
    r, w = os.pipe()
    with ShapedLinks(["alice"]) as links:
        code = ("import os, socket, sys\n"
                "os.write(int(sys.argv[1]), f'{os.getpid()} {socket.if_nameindex()[-1][1]}'.encode())")
        child = subprocess.Popen([*links.exec_prefix("alice"), sys.executable, "-c", code, str(w)],
                                 pass_fds=(w,))
        os.close(w)
        assert child.wait(timeout=30) == 0
        # `ip netns exec` execs in place (same pid: the supervisor's signals and
        # PR_SET_PDEATHSIG reach the CVM), and the CVM runs inside alice's namespace.
        assert os.read(r, 100).decode() == f"{child.pid} gt-up"
    os.close(r)


@needs_netns
@pytest.mark.skipif(not netem_available(), reason="sch_netem unavailable: no delay support")
def test_delay_puts_netem_above_tbf():
    with ShapedLinks(["alice"], bandwidth_mbit=20, delay_ms=5) as links:
        report = links.qdisc_report("alice")
        assert "netem" in report and "tbf" in report
        assert transfer(links, "alice", "orchestrator", 64 * KIB).intact


@pytest.mark.skipif(shutil.which("ip") is None, reason="iproute2 not installed")
def test_link_error_names_the_command_and_its_stderr(processes):
    with pytest.raises(LinkError, match=r"ip netns delete gt-0-none-0x failed .*: \S"):
        run_iproute(["ip", "netns", "delete", "gt-0-none-0x"])


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bw", [0, -5, 0.0, math.nan, math.inf, 1e9, True, "20"])
def test_bad_bandwidth_is_bad_input(bw):
    with pytest.raises(BadInput):
        ShapedLinks(["alice"], bandwidth_mbit=bw)
    with pytest.raises(BadInput):
        TokenBucket.from_mbit(bw)


@pytest.mark.parametrize("kw", [{"delay_ms": -1}, {"delay_ms": math.nan}, {"delay_ms": 1e6},
                                {"burst_bytes": 10}, {"latency_ms": 0}])
def test_bad_shape_is_bad_input(kw):
    with pytest.raises(BadInput):
        ShapedLinks(["alice"], bandwidth_mbit=20, **kw)


@pytest.mark.parametrize("holders", [[], ["a", "a"], ["orchestrator"], [""], [3], "alice"])
def test_bad_members_are_bad_input(holders):
    with pytest.raises(BadInput):
        ShapedLinks(holders)


def test_lookups_and_run_need_known_members_and_an_open_set_up():
    links = ShapedLinks(["alice"])
    with pytest.raises(BadInput, match="unknown member"):
        links.address("mallory")
    with pytest.raises(BadInput, match="not set up"):
        links.run("alice", ["true"])
    assert all(len(links.namespace(m)) < 64 for m in links.members)


def test_tbf_arguments():
    assert LinkShape(20).tbf_args() == ["tbf", "rate", "20000000bit", "burst", "32768",
                                        "latency", "50ms"]
    assert LinkShape(500, burst_bytes=100_000, latency_ms=20).tbf_args()[3:] == [
        "burst", "100000", "latency", "20ms"]
    assert default_burst_bytes(500) == 312_500  # 5 ms at 500 Mbit/s


# ----------------------------------------------------------------------------- token bucket
class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


def bucket(rate_bps=8000, burst=500) -> tuple[TokenBucket, FakeClock]:
    clock = FakeClock()
    return TokenBucket(rate_bps, burst, clock=clock, sleep=clock.sleep), clock


def test_bucket_burst_is_free_then_each_byte_costs_its_time():
    b, _ = bucket()  # 1000 bytes/s, 500 banked
    assert b.consume(500) == 0
    assert b.consume(100) == pytest.approx(0.1, rel=1e-12)
    assert b.consume(100) == pytest.approx(0.2, rel=1e-12)  # queued behind the first debt


def test_bucket_sustained_sends_wait_exactly_size_over_rate():
    b, clock = bucket()
    start = clock.now
    waits = [b.throttle(250) for _ in range(10)]
    assert waits[:2] == [0, 0]
    assert waits[2:] == pytest.approx([0.25] * 8, rel=1e-12)
    assert clock.now - start == pytest.approx((2500 - 500) / 1000, rel=1e-12)


def test_bucket_larger_than_burst_send_is_paced_by_debt():
    b, clock = bucket()
    assert b.throttle(2500) == pytest.approx(2.0, rel=1e-12)
    assert b.tokens == pytest.approx(0, abs=1e-9)


def test_bucket_refill_caps_at_burst():
    b, clock = bucket()
    b.consume(500)
    clock.now += 3600
    assert b.tokens == 500
    assert b.wait_for(1500) == pytest.approx(1.0, rel=1e-12)
    assert b.tokens == 500  # wait_for only looks


def test_bucket_rejects_bad_arguments():
    for rate, burst in ((0, 10), (-1, 10), (math.inf, 10), (8000, 0), (8000, 1.5)):
        with pytest.raises(BadInput):
            TokenBucket(rate, burst)
    with pytest.raises(BadInput):
        bucket()[0].consume(-1)
    assert TokenBucket.from_mbit(20).burst_bytes == default_burst_bytes(20)


class FakeSocket:
    def __init__(self, clock: FakeClock, take: int | None = None) -> None:
        self.clock, self.take = clock, take
        self.sends: list[tuple[float, bytes]] = []

    def send(self, data) -> int:
        n = len(data) if self.take is None else min(self.take, len(data))
        self.sends.append((self.clock.now, bytes(data[:n])))
        return n

    def fileno(self) -> int:
        return 42


def test_paced_socket_sends_everything_at_the_rate_in_burst_sized_chunks():
    b, clock = bucket()
    raw = FakeSocket(clock)
    sock = PacedSocket(raw, b)
    data = bytes(range(256)) * 40  # 10240 bytes
    start = clock.now
    sock.sendall(data)
    assert b"".join(chunk for _, chunk in raw.sends) == data
    assert max(len(chunk) for _, chunk in raw.sends) <= 500
    assert clock.now - start == pytest.approx((len(data) - 500) / 1000, rel=1e-12)
    assert sock.fileno() == 42 and sock.link == LINK_TOKEN_BUCKET


def test_paced_socket_charges_only_what_a_short_send_took():
    b, clock = bucket()
    raw = FakeSocket(clock, take=100)
    sock = PacedSocket(raw, b)
    start = clock.now
    sock.sendall(b"x" * 1000)
    assert b"".join(chunk for _, chunk in raw.sends) == b"x" * 1000
    # Only bytes actually sent are charged: 1000 bytes, 500 of them free.
    assert clock.now - start == pytest.approx(0.5, rel=1e-12)
