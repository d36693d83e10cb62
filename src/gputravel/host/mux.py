"""The PCIe MUX (paper 4.3, 5.1) as a sans-IO state machine: per CVM its saved DMA mapping and
interrupt endpoint; ``switch`` plans replaying the target's in place of the current CVM's (BAR
mappings stay in every CVM)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gputravel.errors import BadInput, GputravelError
from gputravel.protocol.host import Attached, HostError, SwitchRequest, Switched


@dataclass(frozen=True)
class CvmRegistration:
    cvm: str
    iova: int
    nbytes: int
    sysmem_fd: int  # owned by the host process
    irq_fd: int


@dataclass(frozen=True)
class SwitchPlan:
    previous: str | None
    target: CvmRegistration


class PcieMux:
    def __init__(self) -> None:
        self._saved: dict[str, CvmRegistration] = {}
        self._current: str | None = None
        self.switches = 0

    @property
    def current(self) -> str | None:
        return self._current

    @property
    def registered(self) -> tuple[str, ...]:
        return tuple(self._saved)

    def register(self, reg: CvmRegistration) -> CvmRegistration | None:
        """Save (or update) a CVM's mappings; returns the registration it replaces, if any."""
        if not reg.cvm or reg.nbytes <= 0:
            raise BadInput("a CVM registration needs a name and a non-empty DMA range")
        old = self._saved.get(reg.cvm)
        self._saved[reg.cvm] = reg
        return old

    def unregister(self, cvm: str) -> CvmRegistration:
        if cvm not in self._saved:
            raise BadInput(f"unknown CVM {cvm!r}")
        if self._current == cvm:
            self._current = None
        return self._saved.pop(cvm)

    def switch(self, target: str) -> SwitchPlan:
        if (reg := self._saved.get(target)) is None:
            known = ", ".join(sorted(self._saved)) or "none"
            raise BadInput(f"cannot switch the GPU to unknown CVM {target!r} (registered: {known})")
        plan = SwitchPlan(previous=self._current, target=reg)
        self._current = target
        self.switches += 1
        return plan


def answer(mux: PcieMux, msg: object, carry_out: Callable[[SwitchPlan], int]) -> Switched | HostError:
    """The host's reply to a CVM's message: the switch it asks for, planned by ``mux`` and done by
    ``carry_out`` (which returns the nanoseconds it took), or why not."""
    if not isinstance(msg, SwitchRequest):
        return HostError(reason=f"unexpected message {type(msg).__name__}")
    try:
        elapsed_ns = carry_out(mux.switch(msg.target))
    except GputravelError as exc:
        return HostError(reason=str(exc))
    return Switched(target=msg.target, elapsed_ns=elapsed_ns, seq=mux.switches)


def notice(done: Switched) -> Attached:
    """What the CVM the GPU went to is told when another CVM asked: a holder imports the context
    while the switch runs, then waits for this."""
    return Attached(target=done.target, elapsed_ns=done.elapsed_ns, seq=done.seq)
