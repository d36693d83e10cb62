"""A data holder's side of joining and leaving a running cohort (paper 4.5, last paragraph).

Every join attests the orchestrator afresh and reports `Joined` or `Failed` (the holder stays up);
a late holder probes the GPU the orchestrator lends it (`ProbeGpu`); `Leave` says `Bye` and closes
the link. :func:`plan` decides, sans-IO; :func:`holder_command` carries the actions out.
"""

from __future__ import annotations

import selectors
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gputravel.attest import OrchestratorAttestation
from gputravel.errors import GputravelError, IllegalTransition, ProtocolError
from gputravel.protocol.control import Failed, JoinCohort, Joined, Leave, Left, ProbeGpu, Probed
from gputravel.protocol.parties import ORCHESTRATOR
from gputravel.protocol.travel import Bye

if TYPE_CHECKING:
    from gputravel.transport.base import Transport

__all__ = ["HOLDER_COMMANDS", "Member", "holder_command", "join", "joined", "plan"]

HOLDER_COMMANDS = (ProbeGpu, Leave)


# ----------------------------------------------------------------------------- the core (sans-IO)
@dataclass(frozen=True)
class SwitchTo:
    target: str  # the CVM the PCIe MUX is to switch the GPU to


@dataclass(frozen=True)
class ProbeDriver:
    """Set up the driver on the GPU we hold (paper 4.1)."""


@dataclass(frozen=True)
class SayGoodbye:
    """Stop reading the orchestrator's link, send it ``bye`` and close it."""

    bye: Bye


def plan(cmd: object, name: str, joined: bool) -> tuple[object, ...]:
    """The actions a membership command asks of holder ``name`` (``joined``: linked to the
    orchestrator), its reply to the supervisor last."""
    if isinstance(cmd, ProbeGpu):  # the orchestrator lent us the GPU: probe, then hand it back
        return SwitchTo(name), ProbeDriver(), SwitchTo(ORCHESTRATOR), Probed(holder=name)
    if isinstance(cmd, Leave):
        if not joined:
            raise IllegalTransition(name, "not-joined", "leave the cohort")
        return SayGoodbye(Bye(reason=cmd.reason or "leaving the cohort")), Left(holder=name)
    raise ProtocolError(f"not a membership command: {type(cmd).__name__}")


def joined(name: str, att: OrchestratorAttestation) -> Joined:
    """What the supervisor is told of a join: what this holder verified."""
    return Joined(holder=name, measurement=att.cvm.measurement, gpu_serial=att.gpu.ueid,
                  gpu_verified_at=att.gpu.verified_at)


def _failed(exc: GputravelError) -> Failed:
    return Failed(kind=type(exc).__name__, reason=str(exc))


# ----------------------------------------------------------------------------- the shell
class _Named(Protocol):
    @property
    def name(self) -> str: ...


class Member(Protocol):
    """The holder as its membership commands use it (holder/cvm.DataHolder, which imports this module)."""

    orchestrator: Transport | None  # its link to the orchestrator, while joined

    @property
    def config(self) -> _Named: ...
    def join(self, host: str, port: int) -> OrchestratorAttestation: ...
    def switch(self, target: str) -> object: ...
    def probe_driver(self) -> None: ...


def join(holder: Member, cmd: JoinCohort, control: Transport) -> bool:
    """Attest the orchestrator and join; report Joined or Failed (the holder stays up, out)."""
    try:
        att = holder.join(cmd.host, cmd.port)
    except GputravelError as exc:
        control.send(_failed(exc))
        return False
    control.send(joined(holder.config.name, att))
    return True


def holder_command(holder: Member, cmd: object, control: Transport, sel: selectors.BaseSelector) -> None:
    """Carry out one membership command and report its reply (or Failed) to the supervisor."""
    try:
        *actions, reply = plan(cmd, holder.config.name, holder.orchestrator is not None)
        for act in actions:
            _carry_out(holder, act, sel)
    except GputravelError as exc:
        reply = _failed(exc)
    control.send(reply)


def _carry_out(holder: Member, act: object, sel: selectors.BaseSelector) -> None:
    if isinstance(act, SwitchTo):
        holder.switch(act.target)
    elif isinstance(act, ProbeDriver):
        holder.probe_driver()
    elif isinstance(act, SayGoodbye):
        conn = holder.orchestrator
        assert conn is not None
        holder.orchestrator = None
        sel.unregister(conn.fileno())
        try:
            conn.send(act.bye)
        finally:
            conn.close()
    else:
        raise AssertionError(f"not a membership action: {act!r}")
