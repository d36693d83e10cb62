"""Joining and leaving a running cohort (paper 4.5): the sans-IO cores of both sides, and the
orchestrator's shell on fakes. Whole cohorts that lend, leave and rejoin are in
test_attest_cohort.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gputravel.errors import BadInput, IllegalTransition, PeerTimeout, ProtocolError
from gputravel.holder.membership import ProbeDriver, SayGoodbye, plan
from gputravel.holder.membership import SwitchTo as HolderSwitchTo
from gputravel.orchestrator.cvm import Orchestrator
from gputravel.orchestrator.membership import (
    AwaitBye,
    DropLink,
    GpuState,
    Lending,
    Membership,
    RejoinRpcQueue,
    SwitchTo,
)
from gputravel.protocol.control import (
    AwaitDeparture,
    Departed,
    GpuLent,
    GpuReclaimed,
    Leave,
    Left,
    LendGpu,
    ProbeGpu,
    Probed,
    ReclaimGpu,
)
from gputravel.protocol.parties import ORCHESTRATOR
from gputravel.protocol.travel import Bye, ProbeDone, ProbeNow
from gputravel.transport.memory import memory_pair

HOME = GpuState(away=False, rotating=False, halted=False)


# ----------------------------------------------------------------------------- orchestrator core
def test_the_gpu_is_lent_only_between_travels_and_never_to_the_orchestrator() -> None:
    lending = Lending()
    for gpu, why in ((GpuState(True, False, False), "context-away"), (GpuState(False, True, False), "not-rotated"),
                     (GpuState(False, False, True), "not-rotated")):
        with pytest.raises(IllegalTransition, match=why):
            lending.lend("bob", gpu)
    with pytest.raises(BadInput, match="to itself"):
        lending.lend(ORCHESTRATOR, HOME)
    assert lending.phase == "idle"
    assert lending.lend("bob", HOME) == SwitchTo("bob") and lending.phase == "lent-to-bob"
    assert lending.lent("bob") == GpuLent(holder="bob")
    assert lending.reclaim() == (SwitchTo(ORCHESTRATOR), RejoinRpcQueue())
    assert lending.phase == "lent-to-bob"  # until the reclaim is done
    assert lending.reclaimed() == GpuReclaimed() and lending.phase == "idle"


def test_a_departure_is_awaited_until_its_deadline() -> None:
    lending = Lending()
    with pytest.raises(BadInput, match="not connected"):
        lending.await_departure("alice", False, 5.0, now=100.0)
    assert lending.next_deadline() is None
    assert lending.await_departure("alice", True, 5.0, now=100.0) == AwaitBye("alice")
    assert lending.phase == "awaiting-departure" and lending.next_deadline() == 105.0
    assert lending.on_timeout(104.0) is None
    assert lending.departed("done") == (DropLink("alice"), Departed(holder="alice", reason="done"))
    assert lending.phase == "idle" and lending.next_deadline() is None
    lending.await_departure("alice", True, 5.0, now=200.0)
    assert lending.on_timeout(205.0) == DropLink("alice") and lending.phase == "idle"
    with pytest.raises(IllegalTransition):
        lending.departed("late")


# ----------------------------------------------------------------------------- orchestrator shell
def _orchestrator(**holders) -> SimpleNamespace:
    switched: list[str] = []
    driver = SimpleNamespace(away=False, rotating=False, ledger=SimpleNamespace(halted=None), reclaimed=[],
                             reclaim_rpc_queue=lambda timeout: driver.reclaimed.append(timeout))
    links = dict(holders)
    orch = SimpleNamespace(driver=driver, switch=switched.append, switched=switched, holders=links,
                           config=SimpleNamespace(device_timeout=7.0))
    orch.drop = lambda name: Orchestrator.drop(orch, name)  # the real one, on these links
    return orch


def test_the_shell_lends_and_reclaims_on_the_mux_and_the_driver() -> None:
    orch = _orchestrator()
    membership = Membership(orch)
    assert membership.command(LendGpu(holder="bob")) == GpuLent(holder="bob")
    assert membership.command(ReclaimGpu()) == GpuReclaimed()
    assert orch.switched == ["bob", ORCHESTRATOR] and orch.driver.reclaimed == [7.0]
    with pytest.raises(ProtocolError, match="not a membership command"):
        membership.command(ProbeGpu())


@pytest.mark.parametrize("answer", ["bob", "mallory", None])
def test_a_late_holder_probes_over_its_own_link_and_the_gpu_comes_back_whatever_it_says(answer) -> None:
    """A deployed holder's late join: lent the GPU between travels, told ProbeNow on its link;
    a ProbeDone naming another holder, or silence, is an error, and the GPU is reclaimed anyway."""
    orch = _orchestrator()
    orch.config.holder_timeout = 0.2
    ours, theirs = memory_pair()
    if answer is not None:
        theirs.send(ProbeDone(holder=answer))
    membership = Membership(orch)
    if answer == "bob":
        membership.probe_over("bob", ours)
    else:
        with pytest.raises((ProtocolError, PeerTimeout)):
            membership.probe_over("bob", ours)
    assert isinstance(theirs.recv(timeout=1).message, ProbeNow)
    assert orch.switched == ["bob", ORCHESTRATOR] and orch.driver.reclaimed == [7.0]
    assert membership.core.lent_to is None


def test_a_late_probe_is_refused_while_the_context_is_away_and_the_gpu_still_comes_home() -> None:
    orch = _orchestrator()
    orch.driver.away = True  # a travel is under way: the holder would get the PCIe link with keys out
    ours, theirs = memory_pair()
    with pytest.raises(IllegalTransition):
        Membership(orch).probe_over("bob", ours)
    assert orch.switched == [ORCHESTRATOR]  # never to bob; the reclaim switches home


def test_a_departing_holder_is_dropped_whatever_it_does() -> None:
    holder_end, orch_end = memory_pair("alice", "orchestrator")
    orch = _orchestrator(alice=orch_end)
    holder_end.send(Bye(reason="done for today"))
    assert Membership(orch).command(AwaitDeparture(holder="alice", timeout=1.0)) == \
        Departed(holder="alice", reason="done for today")
    assert orch.holders == {}
    holder_end, orch_end = memory_pair("alice", "orchestrator")
    orch.holders["alice"] = orch_end
    with pytest.raises(PeerTimeout):  # no goodbye by the deadline: dropped all the same
        Membership(orch).command(AwaitDeparture(holder="alice", timeout=0.05))
    assert orch.holders == {}
    holder_end, orch_end = memory_pair("alice", "orchestrator")
    orch.holders["alice"] = orch_end
    holder_end.close()
    assert Membership(orch).await_departure("alice", 1.0).reason == "closed its connection"
    assert orch.holders == {}


def test_one_membership_keeps_the_lending_state_from_command_to_command() -> None:
    """The serve loop (orchestrator/process.py) keeps one Membership for the orchestrator's life."""
    orch = _orchestrator()
    membership = Membership(orch)
    membership.command(LendGpu(holder="bob"))
    assert orch.switched == ["bob"] and membership.core.lent_to == "bob"
    membership.command(ReclaimGpu())
    assert orch.switched == ["bob", ORCHESTRATOR] and membership.core.lent_to is None


# ----------------------------------------------------------------------------- holder core
def test_a_holder_probes_the_lent_gpu_then_hands_it_back() -> None:
    assert plan(ProbeGpu(), "bob", joined=False) == (HolderSwitchTo("bob"), ProbeDriver(), HolderSwitchTo(ORCHESTRATOR),
                                                     Probed(holder="bob"))


def test_a_holder_leaves_only_when_joined_saying_goodbye() -> None:
    with pytest.raises(IllegalTransition, match="not-joined"):
        plan(Leave(reason="bye"), "bob", joined=False)
    assert plan(Leave(reason="moving on"), "bob", joined=True) == (SayGoodbye(Bye(reason="moving on")),
                                                                  Left(holder="bob"))
    assert plan(Leave(reason=""), "bob", joined=True)[0] == SayGoodbye(Bye(reason="leaving the cohort"))
    with pytest.raises(ProtocolError, match="not a membership command"):
        plan(LendGpu(holder="bob"), "bob", joined=True)
