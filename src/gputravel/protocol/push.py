"""Push-buffer methods: what a driver encrypts into a push buffer for the device to execute."""

from __future__ import annotations

from gputravel.protocol.codec import Message


class CopyToVram(Message, tag="push.copy_to_vram"):
    """Decrypt one record from a staging slot (IOVA) into VRAM at ``dst_offset``."""

    src_iova: int
    nbytes: int
    dst_offset: int
    release: int  # tracking-semaphore value to release afterwards (0: none)
    interrupt: bool


class CopyFromVram(Message, tag="push.copy_from_vram"):
    """Encrypt ``nbytes`` of VRAM at ``src_offset`` into a staging slot (IOVA)."""

    src_offset: int
    nbytes: int
    dst_iova: int
    release: int
    interrupt: bool


class Memset(Message, tag="push.memset"):
    """Scrub: fill a VRAM range with ``value`` (kernel channel only)."""

    offset: int
    nbytes: int
    value: int
    release: int
    interrupt: bool


class RotateKeys(Message, tag="push.rotate"):
    """Move every channel to the keys of ``epoch`` (kernel channel only); also clears a faulted
    user channel and its pending GPFIFO entries, so both ends start on fresh counters."""

    epoch: int
    release: int
    interrupt: bool


class GrantWindow(Message, tag="push.grant_window"):
    """Open the VRAM range the user channel may copy to and from (kernel channel only): the
    dataset buffer alone, so a holder with the user keys reaches nothing else of VRAM."""

    offset: int
    nbytes: int
    release: int
    interrupt: bool


class SemaphoreRelease(Message, tag="push.semaphore"):
    release: int
    interrupt: bool
