"""What the host loop lets a hook decide: which doorbell a CVM gets, where a switch goes.

An honest host uses :class:`NoHooks`: each CVM gets the device's own doorbell, and a switch
maps the target's DMA range and routes its interrupt to it. A hypervisor that wants more
(the red team's, for one) implements :class:`HostHooks` and is handed to
:class:`~gputravel.host.process.HostProcess`; the host never knows who it is.
"""

from __future__ import annotations

import selectors
from typing import TYPE_CHECKING, Protocol

from gputravel.host.mux import CvmRegistration, SwitchPlan

if TYPE_CHECKING:  # the host process imports this module: only type checkers look back
    from gputravel.host.process import HostProcess


class HostHooks(Protocol):
    def on_serve(self, host: HostProcess, sel: selectors.BaseSelector) -> None:
        """The host loop starts. A hook may add endpoints of its own to ``sel``: the loop calls
        an endpoint's data (a callable, no arguments) whenever it is readable."""

    def on_register(self, reg: CvmRegistration, doorbell: int) -> int:
        """A CVM registered its bounce buffers (``reg.sysmem_fd``) and interrupt: the doorbell
        descriptor to hand it. ``doorbell`` is the device's own."""

    def on_switch(self, requester: str, plan: SwitchPlan) -> tuple[CvmRegistration, CvmRegistration]:
        """``requester`` asked for the GPU to go to ``plan.target``: the CVM whose DMA range the
        device gets mapped, and the CVM its interrupt is routed to."""


class NoHooks:
    """The honest host: it hands out what it holds and switches where it is asked."""

    def on_serve(self, host: HostProcess, sel: selectors.BaseSelector) -> None:
        pass

    def on_register(self, reg: CvmRegistration, doorbell: int) -> int:
        return doorbell

    def on_switch(self, requester: str, plan: SwitchPlan) -> tuple[CvmRegistration, CvmRegistration]:
        return plan.target, plan.target
