"""The PCIe MUX (paper 4.3, 5.1) as a sans-IO state machine.

Per CVM it saves the DMA mappings (an IOVA range backed by that CVM's unprotected-memory
segment) and the interrupt endpoint (an eventfd). ``switch`` yields the plan the host
executes: drop the current CVM's mappings from the device's view, replay the target's, swap
the interrupt endpoint. BAR mappings are not part of it: they stay in every CVM.
"""

from __future__ import annotations

from dataclasses import dataclass

from gputravel.errors import BadInput


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
        reg = self._saved.get(target)
        if reg is None:
            known = ", ".join(sorted(self._saved)) or "none"
            raise BadInput(f"cannot switch the GPU to unknown CVM {target!r} (registered: {known})")
        plan = SwitchPlan(previous=self._current, target=reg)
        self._current = target
        self.switches += 1
        return plan
