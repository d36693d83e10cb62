"""The orchestrator's side of joining and leaving a running cohort (paper 4.5): a late holder's
probe gets the GPU only between travels, with no key out, and it is reclaimed with an encrypted RPC
proving the session is still ours. :class:`Lending` decides, sans-IO; :class:`Membership` acts."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gputravel.errors import BadInput, IllegalTransition, ProtocolError, TransportClosed
from gputravel.protocol.control import AwaitDeparture, Departed, GpuLent, GpuReclaimed, LendGpu, ReclaimGpu
from gputravel.protocol.parties import ORCHESTRATOR
from gputravel.protocol.travel import Bye, ProbeDone, ProbeNow

if TYPE_CHECKING:
    from gputravel.orchestrator.cvm import Orchestrator
    from gputravel.transport.base import Transport

ORCHESTRATOR_COMMANDS = (LendGpu, ReclaimGpu, AwaitDeparture)


# ----------------------------------------------------------------------------- the core (sans-IO)
@dataclass(frozen=True)
class GpuState:
    away: bool  # the context is with a holder (a travel is under way)
    rotating: bool  # a key rotation was submitted and not confirmed
    halted: bool  # travel is halted: the device may be on an epoch a holder had


@dataclass(frozen=True)
class SwitchTo:
    target: str


@dataclass(frozen=True)
class RejoinRpcQueue:
    """Take the device's RPC queue back after a borrower moved it, and prove the session."""


@dataclass(frozen=True)
class AwaitBye:
    holder: str


@dataclass(frozen=True)
class DropLink:
    holder: str


class Lending:
    """Who has the GPU between travels, and whose departure is awaited (the supervisor orders lends)."""

    def __init__(self) -> None:
        self.lent_to: str | None = None
        self.departing: str | None = None
        self._deadline: float | None = None

    @property
    def phase(self) -> str:
        if self.departing is not None:
            return "awaiting-departure"
        return f"lent-to-{self.lent_to}" if self.lent_to is not None else "idle"

    def lend(self, holder: str, gpu: GpuState) -> SwitchTo:
        # Only between travels: the borrower gets the PCIe link but no key.
        if gpu.away:
            raise IllegalTransition(ORCHESTRATOR, "context-away", f"lend the GPU to {holder!r}")
        if gpu.rotating or gpu.halted:  # the device may be on an epoch a holder had
            raise IllegalTransition(ORCHESTRATOR, "not-rotated", f"lend the GPU to {holder!r}")
        if holder == ORCHESTRATOR:
            raise BadInput("the orchestrator cannot lend the GPU to itself")
        self.lent_to = holder  # from here the GPU may be the holder's, even if the switch fails
        return SwitchTo(holder)

    def lent(self, holder: str) -> GpuLent:
        return GpuLent(holder=holder)

    def reclaim(self) -> tuple[SwitchTo, RejoinRpcQueue]:
        return SwitchTo(ORCHESTRATOR), RejoinRpcQueue()

    def reclaimed(self) -> GpuReclaimed:  # both reclaim actions were carried out
        self.lent_to = None
        return GpuReclaimed()

    def await_departure(self, holder: str, connected: bool, timeout: float, now: float) -> AwaitBye:
        if not connected:
            raise BadInput(f"holder {holder!r} is not connected")
        self.departing, self._deadline = holder, now + timeout
        return AwaitBye(holder)

    def next_deadline(self) -> float | None:
        return self._deadline

    def departed(self, reason: str) -> tuple[DropLink, Departed]:
        holder = self._end_departure()
        return DropLink(holder), Departed(holder=holder, reason=reason)

    def on_timeout(self, now: float) -> DropLink | None:
        """No goodbye by the deadline (None before it): the link is dropped anyway."""
        if self._deadline is None or now < self._deadline:
            return None
        return DropLink(self._end_departure())

    def link_failed(self) -> DropLink:
        return DropLink(self._end_departure())

    def _end_departure(self) -> str:
        holder = self.departing
        if holder is None:
            raise IllegalTransition(ORCHESTRATOR, self.phase, "take a departure")
        self.departing, self._deadline = None, None
        return holder


# ----------------------------------------------------------------------------- the shell
class Membership:
    """Carries out :class:`Lending`'s actions; one for the orchestrator's life (process.py)."""

    def __init__(self, orch: Orchestrator) -> None:
        self.orch, self.core, self._clock = orch, Lending(), time.monotonic

    def command(self, cmd: object) -> object:
        if isinstance(cmd, LendGpu):
            return self.lend(cmd.holder)
        if isinstance(cmd, ReclaimGpu):
            return self.reclaim()
        if isinstance(cmd, AwaitDeparture):
            return self.await_departure(cmd.holder, cmd.timeout)
        raise ProtocolError(f"not a membership command: {type(cmd).__name__}")

    def lend(self, holder: str) -> GpuLent:
        drv = self.orch.driver
        act = self.core.lend(holder, GpuState(drv.away, drv.rotating, bool(drv.ledger.halted)))
        self.orch.switch(act.target)
        return self.core.lent(holder)

    def probe_over(self, holder: str, conn: Transport) -> None:
        """Lend a late holder the GPU to probe over its own link; take it back whatever happened."""
        try:
            self.lend(holder)  # a switch the host fails leaves the GPU maybe lent: reclaimed below
            conn.send(ProbeNow())
            done = conn.recv(timeout=self.orch.config.holder_timeout, expect=ProbeDone).message
            if not isinstance(done, ProbeDone) or done.holder != holder:
                raise ProtocolError(f"holder {holder!r} answered the lent GPU with something else")
        finally:
            self.reclaim()

    def reclaim(self) -> GpuReclaimed:
        home, _ = self.core.reclaim()
        self.orch.switch(home.target)
        self.orch.driver.reclaim_rpc_queue(timeout=self.orch.config.device_timeout)
        return self.core.reclaimed()

    def await_departure(self, holder: str, timeout: float) -> Departed:
        act = self.core.await_departure(holder, holder in self.orch.holders, timeout, self._clock())
        conn = self.orch.holders[act.holder]
        deadline = self.core.next_deadline()
        assert deadline is not None
        try:
            reason = conn.recv(timeout=max(deadline - self._clock(), 0.0), expect=Bye).message.reason
        except TransportClosed:
            reason = "closed its connection"
        except BaseException:
            self.orch.drop((self.core.on_timeout(self._clock()) or self.core.link_failed()).holder)
            raise
        drop, departed = self.core.departed(reason)
        self.orch.drop(drop.holder)
        return departed
