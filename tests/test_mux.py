"""The host's PCIe MUX state machine: saved DMA mappings per CVM and the switch plan."""

from __future__ import annotations

import pytest

from gputravel.errors import BadInput
from gputravel.host.mux import CvmRegistration, PcieMux, SwitchPlan
from gputravel.layout import SYSMEM_IOVA


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
