"""The orchestrator's private link to the device: the VRAM window its kernels read."""

from __future__ import annotations

from gputravel.protocol.codec import Message


class VramRequest(Message, tag="device.vram_request"):
    """Orchestrator -> device over their private link: the VRAM window for running kernels."""


class VramGrant(Message, tag="device.vram"):
    """fds: [VRAM memfd]: what the orchestrator's kernels read."""

    vram_bytes: int
