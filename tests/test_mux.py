"""The host's PCIe MUX state machine: saved DMA mappings per CVM and the switch plan."""

from __future__ import annotations

import pytest

from gputravel.errors import BadInput
from gputravel.host.mux import CvmRegistration, PcieMux, SwitchPlan
from gputravel.protocol.layout import SYSMEM_IOVA


def reg(cvm: str, fd: int = 10, nbytes: int = 1 << 20) -> CvmRegistration:
    return CvmRegistration(cvm=cvm, iova=SYSMEM_IOVA, nbytes=nbytes, sysmem_fd=fd, irq_fd=fd + 1)


@pytest.fixture
def mux() -> PcieMux:
    m = PcieMux()
    for i, name in enumerate(["alice", "bob", "orchestrator"]):
        assert m.register(reg(name, fd=10 * (i + 1))) is None
    return m


def test_a_new_mux_is_empty() -> None:
    m = PcieMux()
    assert m.current is None and m.registered == () and m.switches == 0


def test_register_keeps_every_cvm_in_order(mux: PcieMux) -> None:
    assert mux.registered == ("alice", "bob", "orchestrator")
    assert mux.current is None  # registering does not attach anybody


def test_switch_plans_from_the_current_cvm_to_the_target(mux: PcieMux) -> None:
    plan = mux.switch("orchestrator")
    assert plan == SwitchPlan(previous=None, target=reg("orchestrator", fd=30))
    assert mux.current == "orchestrator"
    plan = mux.switch("alice")
    assert plan.previous == "orchestrator" and plan.target == reg("alice", fd=10)
    assert mux.current == "alice"
    plan = mux.switch("alice")  # switching to where it is already is allowed, and counted
    assert plan.previous == "alice" and plan.target.cvm == "alice"
    assert mux.switches == 3


def test_switch_to_an_unknown_cvm_lists_the_registered_ones(mux: PcieMux) -> None:
    mux.switch("bob")
    with pytest.raises(BadInput, match=r"'mallory' \(registered: alice, bob, orchestrator\)"):
        mux.switch("mallory")
    assert mux.current == "bob" and mux.switches == 1  # nothing changed
    with pytest.raises(BadInput, match="registered: none"):
        PcieMux().switch("alice")


def test_re_register_replaces_and_returns_the_old_registration(mux: PcieMux) -> None:
    mux.switch("alice")
    newer = reg("alice", fd=99, nbytes=2 << 20)
    old = mux.register(newer)
    assert old == reg("alice", fd=10)
    assert mux.registered.count("alice") == 1
    assert mux.current == "alice"
    assert mux.switch("alice").target == newer  # the next switch uses the new mappings


def test_unregister_forgets_the_cvm_and_detaches_it_if_current(mux: PcieMux) -> None:
    mux.switch("bob")
    assert mux.unregister("alice") == reg("alice", fd=10)
    assert mux.current == "bob"
    assert mux.unregister("bob") == reg("bob", fd=20)
    assert mux.current is None
    assert mux.registered == ("orchestrator",)
    with pytest.raises(BadInput, match="unknown CVM 'bob'"):
        mux.switch("bob")
    with pytest.raises(BadInput, match="unknown CVM 'bob'"):
        mux.unregister("bob")


@pytest.mark.parametrize("bad", [reg(""), reg("alice", nbytes=0), reg("alice", nbytes=-4096)])
def test_register_refuses_a_nameless_or_empty_registration(bad: CvmRegistration) -> None:
    m = PcieMux()
    with pytest.raises(BadInput):
        m.register(bad)
    assert m.registered == ()


# ============================================================================ a CVM's MUX client
# The host is played by the test over an in-memory pair; what matters is which reply or
# notice the client takes as the one it waits for.
from gputravel.driver.link import PcieMuxClient  # noqa: E402
from gputravel.errors import PeerTimeout, ProtocolError  # noqa: E402
from gputravel.protocol.host import Attached, HostError, SwitchRequest, Switched  # noqa: E402
from gputravel.transport.memory import memory_pair  # noqa: E402


@pytest.fixture
def client_and_host():
    cvm_end, host_end = memory_pair("cvm", "host")
    yield PcieMuxClient(cvm_end, "alice"), host_end
    cvm_end.close()


def test_requests_are_answered_in_order_and_notices_in_between_are_kept(client_and_host) -> None:
    client, host = client_and_host
    client.request("orchestrator")
    assert host.recv(timeout=1).message == SwitchRequest(target="orchestrator")
    host.send(Attached(target="alice", elapsed_ns=1, seq=7))  # another CVM's switch to us, first
    host.send(Switched(target="orchestrator", elapsed_ns=2, seq=8))
    assert client.switched(timeout=1).seq == 8
    # The notice (seq 7) is older than our own switch away (seq 8): it must not pass for a new one.
    with pytest.raises(PeerTimeout):
        client.attached(timeout=0.05)
    host.send(Attached(target="alice", elapsed_ns=3, seq=9))
    assert client.attached(timeout=1).seq == 9


def test_a_notice_that_arrives_while_a_reply_is_awaited_is_used_later(client_and_host) -> None:
    client, host = client_and_host
    client.request("bob")
    host.send(Switched(target="bob", elapsed_ns=1, seq=3))
    client.switched(timeout=1)
    client.request("carol")
    host.send(Attached(target="alice", elapsed_ns=1, seq=4))  # someone switched it to us meanwhile
    host.send(Switched(target="carol", elapsed_ns=1, seq=5))
    client.switched(timeout=1)
    with pytest.raises(PeerTimeout):  # seq 4 is older than our seq-5 switch away
        client.attached(timeout=0.05)


def test_stale_and_foreign_notices_are_skipped(client_and_host) -> None:
    client, host = client_and_host
    client.request("orchestrator")
    host.send(Switched(target="orchestrator", elapsed_ns=1, seq=10))
    client.switched(timeout=1)
    host.send(Attached(target="alice", elapsed_ns=1, seq=9))  # late notice of an earlier travel
    host.send(Attached(target="bob", elapsed_ns=1, seq=11))  # not ours
    host.send(Switched(target="x", elapsed_ns=1, seq=11))  # a reply to nothing
    host.send(Attached(target="alice", elapsed_ns=5, seq=12))
    notice = client.attached(timeout=1)
    assert (notice.seq, notice.elapsed_ns) == (12, 5)


def test_switch_answers_earlier_requests_first(client_and_host) -> None:
    client, host = client_and_host
    client.request("bob")
    client.request("orchestrator")  # e.g. a recovery after a travel failed mid-way
    for seq, target in enumerate(("bob", "orchestrator", "alice"), start=1):
        host.send(Switched(target=target, elapsed_ns=1, seq=seq))
    assert client.switch("alice", timeout=1).seq == 3
    assert [host.recv(timeout=1).message.target for _ in range(3)] == ["bob", "orchestrator", "alice"]


def test_a_host_error_or_a_wrong_reply_is_a_protocol_error(client_and_host) -> None:
    client, host = client_and_host
    client.request("nobody")
    host.send(HostError(reason="cannot switch the GPU to unknown CVM 'nobody'"))
    with pytest.raises(ProtocolError, match="nobody"):
        client.switched(timeout=1)
    client.request("bob")
    host.send(Switched(target="carol", elapsed_ns=1, seq=1))
    with pytest.raises(ProtocolError, match="bob"):
        client.switched(timeout=1)
    with pytest.raises(ProtocolError, match="no switch request"):
        client.switched(timeout=1)


def test_waiting_for_the_gpu_with_a_request_unanswered_is_refused(client_and_host) -> None:
    client, _ = client_and_host
    client.request("bob")
    with pytest.raises(ProtocolError, match="unanswered"):
        client.attached(timeout=1)


# ============================================================================ the host's notices
def test_the_host_tells_the_target_cvm_and_only_when_another_cvm_asked(host_with_device) -> None:
    """A real host process loop (in a thread); the test plays the device and two CVMs."""
    from gputravel.driver.link import register_with_host
    from gputravel.testing import TEST_LAYOUT
    from gputravel.transport.unix import connect_unix

    links, clients = {}, {}
    for name in ("orchestrator", "alice"):
        conn = connect_unix(host_with_device.socket_path, name)
        links[name] = register_with_host(conn, name, TEST_LAYOUT)
        clients[name] = PcieMuxClient(conn, name)
    orch, alice = clients["orchestrator"], clients["alice"]
    try:
        assert orch.switch("orchestrator", timeout=5).seq == 1  # to itself: no notice anywhere
        orch.request("alice")
        sent = orch.switched(timeout=5)
        notice = alice.attached(timeout=5)  # the target hears of it, with the same switch number
        assert (notice.target, notice.seq) == ("alice", sent.seq)
        alice.request("orchestrator")  # the holder sends it home...
        back = alice.switched(timeout=5)
        assert orch.attached(timeout=5).seq == back.seq > sent.seq  # ...and the orchestrator is told
        assert host_with_device.attached == ["orchestrator", "alice", "orchestrator"]
        with pytest.raises(PeerTimeout):  # nothing more is on its way to anybody
            orch.attached(timeout=0.1)
        with pytest.raises(PeerTimeout):
            alice.attached(timeout=0.1)
    finally:
        for link in links.values():
            link.close()


def test_a_late_reply_is_taken_for_the_request_it_answers(client_and_host) -> None:
    """A switch whose reply times out stays pending: its late reply is matched to it, and the
    next switch gets its own (the orchestrator's recovery switches home after a timeout)."""
    client, host = client_and_host
    client.request("alice")
    with pytest.raises(PeerTimeout):
        client.switched(timeout=0.05)
    host.send(Switched(target="alice", elapsed_ns=1, seq=4))  # late
    host.send(Switched(target="orchestrator", elapsed_ns=1, seq=5))
    assert client.switch("orchestrator", timeout=1).seq == 5




# ============================================================================ the host's hooks
def test_an_honest_host_hands_out_the_device_doorbell_and_maps_the_target() -> None:
    from gputravel.host.process import NoHooks

    alice = reg("alice")
    assert NoHooks().on_register(alice, doorbell=7) == 7
    assert NoHooks().on_switch("orchestrator", SwitchPlan(previous=None, target=alice)) == (alice, alice)


def test_the_host_hands_out_and_routes_what_its_hooks_decide(make_host) -> None:
    """What the red team's hypervisor builds on (host/process.py, HostHooks): the doorbell a CVM
    gets and where a switch maps DMA and routes the interrupt are the hooks' to decide."""
    import os

    from gputravel.driver.link import register_with_host
    from gputravel.host.process import HostProcess, NoHooks
    from gputravel.testing import TEST_LAYOUT
    from gputravel.transport.unix import connect_unix

    class Misroute(NoHooks):
        def __init__(self) -> None:
            self.served, self.regs, self.asked = False, {}, []
            self.bell = os.eventfd(0, os.EFD_NONBLOCK)

        def on_serve(self, host, sel) -> None:
            self.served = isinstance(host, HostProcess)

        def on_register(self, reg, doorbell):
            self.regs[reg.cvm] = reg
            return self.bell

        def on_switch(self, requester, plan):
            self.asked.append((requester, plan.target.cvm))
            home = self.regs["orchestrator"]
            return home, home  # the device stays on the orchestrator's memory, whoever asked

    hooks = Misroute()
    host = make_host(hooks)
    sock, bell, attached = host.socket_path, host.bell, host.attached
    links, conns = {}, {}
    try:
        for name in ("orchestrator", "alice"):
            conns[name] = connect_unix(sock, name)
            links[name] = register_with_host(conns[name], name, TEST_LAYOUT)
        assert hooks.served
        for link in links.values():  # each CVM rings the hook's doorbell, not the device's
            link.ring()
        assert os.eventfd_read(hooks.bell) == 2
        with pytest.raises(BlockingIOError):
            os.eventfd_read(bell)
        client = PcieMuxClient(conns["orchestrator"], "orchestrator")
        assert client.switch("alice", timeout=5).target == "alice"  # the MUX believes it went to alice...
        assert hooks.asked == [("orchestrator", "alice")]
        assert attached == ["orchestrator"]  # ...the device was mapped where the hook said
    finally:
        for link in links.values():
            link.close()
        os.close(hooks.bell)  # the host and its device are closed by make_host
