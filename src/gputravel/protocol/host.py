"""The PCIe MUX's control plane (CVM <-> host <-> device); descriptors travel alongside."""

from __future__ import annotations

from gputravel.protocol.codec import Message


class DeviceAttach(Message, tag="host.device_attach"):
    """Device -> host at power-on. fds: [BAR0 memfd, doorbell eventfd]. Never VRAM."""

    serial: str
    bar_bytes: int


class RegisterCvm(Message, tag="host.register"):
    """CVM -> host: save my DMA mappings and interrupt endpoint. fds: [sysmem memfd, irq eventfd]."""

    cvm: str
    iova: int
    nbytes: int


class Registered(Message, tag="host.registered"):
    """Host -> CVM. fds: [BAR0 memfd, doorbell eventfd]: BAR mappings stay in every CVM."""

    bar_bytes: int


class SwitchRequest(Message, tag="host.switch"):
    target: str


class Switched(Message, tag="host.switched"):
    """Host -> the CVM that asked. ``seq`` numbers the MUX's switches (an older ``Attached`` has
    a lower one); ``elapsed_ns``: the MUX's own time to re-route."""

    target: str
    elapsed_ns: int
    seq: int


class Attached(Message, tag="host.attached"):
    """Host -> the CVM the GPU was just switched to, when another CVM asked for the switch. The
    host is untrusted: a false notice only makes the CVM's pushes go unseen (a timeout)."""

    target: str
    elapsed_ns: int
    seq: int


class HostError(Message, tag="host.error"):
    reason: str


class AttachCvm(Message, tag="host.attach_cvm"):
    """Host -> device: drop current DMA mappings, map these. fds: [sysmem memfd, irq eventfd]."""

    cvm: str
    iova: int
    nbytes: int


class DeviceAck(Message, tag="host.ack"):
    cvm: str
