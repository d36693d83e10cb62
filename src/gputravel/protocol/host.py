"""The PCIe MUX's control plane (CVM <-> host <-> device); descriptors travel alongside."""

from __future__ import annotations

from dataclasses import dataclass

from gputravel.protocol.codec import message


@message("host.device_attach")
@dataclass(frozen=True)
class DeviceAttach:
    """Device -> host at power-on. fds: [BAR0 memfd, doorbell eventfd]. Never VRAM."""

    serial: str
    bar_bytes: int


@message("host.register")
@dataclass(frozen=True)
class RegisterCvm:
    """CVM -> host: save my DMA mappings and interrupt endpoint. fds: [sysmem memfd, irq eventfd]."""

    cvm: str
    iova: int
    nbytes: int


@message("host.registered")
@dataclass(frozen=True)
class Registered:
    """Host -> CVM. fds: [BAR0 memfd, doorbell eventfd]: BAR mappings stay in every CVM."""

    bar_bytes: int


@message("host.switch")
@dataclass(frozen=True)
class SwitchRequest:
    target: str


@message("host.switched")
@dataclass(frozen=True)
class Switched:
    """Host -> the CVM that asked. ``seq`` numbers the MUX's switches: an ``Attached`` with a
    lower number is older than this switch. ``elapsed_ns``: the MUX's own time to re-route."""

    target: str
    elapsed_ns: int
    seq: int


@message("host.attached")
@dataclass(frozen=True)
class Attached:
    """Host -> the CVM the GPU was just switched to, when another CVM asked for the switch.

    The orchestrator hands its context over while the MUX switches, so the holder learns
    here when the GPU is its own (and the orchestrator, when a holder sends it home). The
    host is untrusted: a false notice only makes the CVM's pushes go unseen (a timeout),
    as a host that never switches would."""

    target: str
    elapsed_ns: int
    seq: int


@message("host.error")
@dataclass(frozen=True)
class HostError:
    reason: str


@message("host.attach_cvm")
@dataclass(frozen=True)
class AttachCvm:
    """Host -> device: drop current DMA mappings, map these. fds: [sysmem memfd, irq eventfd]."""

    cvm: str
    iova: int
    nbytes: int


@message("host.ack")
@dataclass(frozen=True)
class DeviceAck:
    cvm: str
