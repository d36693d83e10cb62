"""The orchestrator's private link to the device: the VRAM window its kernels read."""

from __future__ import annotations

from dataclasses import dataclass

from gputravel.protocol.codec import message


@message("device.vram_request")
@dataclass(frozen=True)
class VramRequest:
    """Orchestrator -> device over their private link: the VRAM window for running kernels."""


@message("device.vram")
@dataclass(frozen=True)
class VramGrant:
    """fds: [VRAM memfd]. Emulates kernels the orchestrator launches reading protected memory."""

    vram_bytes: int
