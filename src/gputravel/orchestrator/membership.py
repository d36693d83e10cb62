"""Joining and leaving a running cohort (paper 4.5, last paragraph), over the control links.

- **Join** (every time, first join or rejoin): the holder attests the orchestrator afresh
  (orchestrator/attester.py) and reports `Joined` with what it verified, or `Failed` and stays
  up, free to try again.
- **Late join**: a holder booted after the orchestrator must probe the GPU while it holds
  it, but its probe moves the device's RPC queue. So the orchestrator lends the GPU
  (`LendGpu`: only between travels, with no keys exported), the holder probes (`ProbeGpu`),
  and the orchestrator takes the GPU back (`ReclaimGpu`): it rejoins the RPC queue and proves
  with an encrypted RPC that the device still holds its session.
- **Leave**: the holder tells the orchestrator `Bye` over their TLS link and closes it
  (`Leave`); the orchestrator reads that goodbye (`AwaitDeparture`) and drops the link, so
  the holder is offline until it joins again. Its enrolment (manifest) is kept.

The supervisor drives the order; the orchestrator and the holders act on their own links.
"""

from __future__ import annotations

import selectors
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gputravel.errors import BadInput, GputravelError, IllegalTransition, ProtocolError, TransportClosed
from gputravel.protocol.travel import Bye
from gputravel.protocol.codec import message
from gputravel.protocol.control import Failed, JoinCohort

if TYPE_CHECKING:
    from gputravel.transport.base import Transport
    from gputravel.holder.cvm import DataHolder
    from gputravel.orchestrator.cvm import Orchestrator

__all__ = [
    "HOLDER_COMMANDS",
    "ORCHESTRATOR_COMMANDS",
    "AwaitDeparture",
    "Departed",
    "GpuLent",
    "GpuReclaimed",
    "Joined",
    "Leave",
    "Left",
    "LendGpu",
    "ProbeGpu",
    "Probed",
    "ReclaimGpu",
    "holder_command",
    "join",
    "orchestrator_command",
]

ORCHESTRATOR = "orchestrator"


# ----------------------------------------------------------------------------- control messages
@message("ctl.member.joined")
@dataclass(frozen=True)
class Joined:
    """Holder -> supervisor: attested the orchestrator and was welcomed."""

    holder: str
    measurement: bytes  # the orchestrator measurement its quote carried (and the policy pins)
    gpu_serial: str  # the GPU whose evidence (for the holder's nonce) the holder verified
    gpu_verified_at: int  # when the holder verified it (unix seconds)


@message("ctl.member.lend")
@dataclass(frozen=True)
class LendGpu:
    holder: str


@message("ctl.member.lent")
@dataclass(frozen=True)
class GpuLent:
    holder: str


@message("ctl.member.probe")
@dataclass(frozen=True)
class ProbeGpu:
    pass


@message("ctl.member.probed")
@dataclass(frozen=True)
class Probed:
    holder: str


@message("ctl.member.reclaim")
@dataclass(frozen=True)
class ReclaimGpu:
    pass


@message("ctl.member.reclaimed")
@dataclass(frozen=True)
class GpuReclaimed:
    pass


@message("ctl.member.leave")
@dataclass(frozen=True)
class Leave:
    reason: str


@message("ctl.member.left")
@dataclass(frozen=True)
class Left:
    holder: str


@message("ctl.member.await_departure")
@dataclass(frozen=True)
class AwaitDeparture:
    holder: str
    timeout: float


@message("ctl.member.departed")
@dataclass(frozen=True)
class Departed:
    holder: str
    reason: str


ORCHESTRATOR_COMMANDS = (LendGpu, ReclaimGpu, AwaitDeparture)
HOLDER_COMMANDS = (ProbeGpu, Leave)


def _failed(exc: GputravelError) -> Failed:
    return Failed(kind=type(exc).__name__, reason=str(exc))


# ----------------------------------------------------------------------------- orchestrator side
def orchestrator_command(orch: Orchestrator, cmd: object) -> object:
    """Carry out one membership command; errors propagate (the serve loop reports them)."""
    if isinstance(cmd, LendGpu):
        return _lend(orch, cmd.holder)
    if isinstance(cmd, ReclaimGpu):
        orch.switch(ORCHESTRATOR)
        orch.driver.reclaim_rpc_queue(timeout=orch.config.device_timeout)
        return GpuReclaimed()
    if isinstance(cmd, AwaitDeparture):
        return _await_departure(orch, cmd.holder, cmd.timeout)
    raise ProtocolError(f"not a membership command: {type(cmd).__name__}")


def _lend(orch: Orchestrator, holder: str) -> GpuLent:
    # Only between travels: the context is home, so the borrower gets the PCIe link but no key.
    if orch.driver.away:
        raise IllegalTransition(ORCHESTRATOR, "context-away", f"lend the GPU to {holder!r}")
    if orch.driver.rotating or orch.driver.ledger.halted:  # the device may be on an epoch a holder had
        raise IllegalTransition(ORCHESTRATOR, "not-rotated", f"lend the GPU to {holder!r}")
    if holder == ORCHESTRATOR:
        raise BadInput("the orchestrator cannot lend the GPU to itself")
    orch.switch(holder)
    return GpuLent(holder=holder)


def _await_departure(orch: Orchestrator, holder: str, timeout: float) -> Departed:
    conn = orch.holders.get(holder)
    if conn is None:
        raise BadInput(f"holder {holder!r} is not connected")
    try:
        msg = conn.recv(timeout=timeout, expect=Bye).message
        reason = msg.reason if isinstance(msg, Bye) else ""
    except TransportClosed:
        reason = "closed its connection"
    finally:
        # Whatever it sent, it is offline now: the link is dropped, the enrolment kept.
        orch.holders.pop(holder, None)
        conn.close()
    return Departed(holder=holder, reason=reason)


# ----------------------------------------------------------------------------- holder side
def join(holder: DataHolder, cmd: JoinCohort, control: Transport) -> bool:
    """Attest the orchestrator and join; report Joined or Failed. A failure leaves the holder
    up and out of the cohort (it may be told to join again)."""
    try:
        att = holder.join(cmd.host, cmd.port)
    except GputravelError as exc:
        control.send(_failed(exc))
        return False
    control.send(Joined(holder=holder.config.name, measurement=att.cvm.measurement,
                        gpu_serial=att.gpu.ueid, gpu_verified_at=att.gpu.verified_at))
    return True


def holder_command(holder: DataHolder, cmd: object, control: Transport, sel: selectors.BaseSelector) -> None:
    try:
        if isinstance(cmd, ProbeGpu):
            reply: object = _probe(holder)
        elif isinstance(cmd, Leave):
            reply = _leave(holder, cmd.reason, sel)
        else:
            raise ProtocolError(f"not a membership command: {type(cmd).__name__}")
    except GputravelError as exc:
        reply = _failed(exc)
    control.send(reply)


def _probe(holder: DataHolder) -> Probed:
    """The orchestrator lent us the GPU: set up the driver (paper 4.1), then hand it back."""
    name = holder.config.name
    holder.switch(name)
    holder.driver.probe(timeout=holder.config.device_timeout)
    holder.switch(ORCHESTRATOR)
    return Probed(holder=name)


def _leave(holder: DataHolder, reason: str, sel: selectors.BaseSelector) -> Left:
    conn = holder.orchestrator
    if conn is None:
        raise IllegalTransition(holder.config.name, "not-joined", "leave the cohort")
    holder.orchestrator = None
    sel.unregister(conn.fileno())
    try:
        conn.send(Bye(reason=reason or "leaving the cohort"))
    finally:
        conn.close()
    return Left(holder=holder.config.name)
