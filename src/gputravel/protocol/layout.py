"""Fixed memory layouts shared by the device and every CVM's driver: the GPU learns its bounce
buffers' addresses once (paper 5.4), so every CVM puts each in the same slot at the same IOVA.
The slot table, and the device's BAR0 (MMIO) window."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from enum import IntEnum

from gputravel.crypto.channel import TAG_BYTES as TAG_BYTES  # re-exported: slots hold ciphertext || tag
from gputravel.errors import BadInput
from gputravel.protocol.manifest import PIECE_BYTES

MIB = 1 << 20
PAGE = 4096

#: Every CVM maps its reserved unprotected memory at this IOVA (same in every CVM).
SYSMEM_IOVA = 0x8000_0000
#: Bytes reserved for one encrypted push (a method stream) in a push-buffer slot.
PUSH_SLOT_BYTES = 512
#: Bytes of one RPC slot (request or response).
RPC_SLOT_BYTES = 64 * 1024
#: Bytes of one encrypted semaphore record (notifier, IV index, ciphertext, tag).
SEMAPHORE_RECORD_BYTES = 64


class PushChannel(IntEnum):
    """The two work-launch channels. USER keys travel to holders; KERNEL keys never do."""

    USER = 0
    KERNEL = 1


def record_bytes_for(buffer_bytes: int) -> int:
    """The largest power of two up to 1 MiB that tiles the dataset buffer (whole records)."""
    if buffer_bytes <= 0 or buffer_bytes % PAGE:
        raise BadInput(f"the dataset buffer must be a positive multiple of {PAGE} bytes (got {buffer_bytes})")
    record = MIB
    while buffer_bytes % record:
        record //= 2
    return record


@dataclass(frozen=True)
class Layout:
    """Sizes that fix every slot's address. Must be identical in the device and all CVMs."""

    record_bytes: int = MIB
    staging_slots: int = 8
    gpfifo_entries: int = 64

    def __post_init__(self) -> None:
        if self.record_bytes % PAGE or not PAGE <= self.record_bytes <= 64 * MIB:
            raise BadInput("record_bytes must be a multiple of 4096 between 4 KiB and 64 MiB")
        if not 2 <= self.staging_slots <= 256:
            raise BadInput("staging_slots must be between 2 and 256")
        if not 4 <= self.gpfifo_entries <= 4096:
            raise BadInput("gpfifo_entries must be between 4 and 4096")

    # ------------------------------------------------------------------ unprotected sysmem
    @property
    def semaphores_offset(self) -> int:
        return 0

    @property
    def rpc_request_offset(self) -> int:
        return PAGE

    @property
    def rpc_response_offset(self) -> int:
        return self.rpc_request_offset + RPC_SLOT_BYTES

    def pushbuf_offset(self, channel: PushChannel, index: int) -> int:
        base = self.rpc_response_offset + RPC_SLOT_BYTES
        return base + (int(channel) * self.gpfifo_entries + index) * PUSH_SLOT_BYTES

    @property
    def staging_offset(self) -> int:
        end = self.pushbuf_offset(PushChannel.KERNEL, self.gpfifo_entries - 1) + PUSH_SLOT_BYTES
        return -(-end // PAGE) * PAGE

    @property
    def staging_slot_bytes(self) -> int:
        return self.record_bytes + TAG_BYTES

    def staging_slot_offset(self, slot: int) -> int:
        return self.staging_offset + slot * self.staging_slot_bytes

    @property
    def sysmem_bytes(self) -> int:
        end = self.staging_slot_offset(self.staging_slots)
        return -(-end // PAGE) * PAGE

    def semaphore_offset(self, channel: PushChannel) -> int:
        return self.semaphores_offset + int(channel) * SEMAPHORE_RECORD_BYTES

    def iova(self, offset: int) -> int:
        return SYSMEM_IOVA + offset

    def digest(self) -> str:
        """Short fingerprint carried in context blobs: a blob only fits a CVM with this layout."""
        raw = struct.pack("<III", self.record_bytes, self.staging_slots, self.gpfifo_entries)
        return hashlib.sha256(raw).hexdigest()[:16]


class Bar0:
    """Offsets in the device's BAR0 window. It stays mapped in every CVM (paper 5.1), so nothing
    secret lives here: GPFIFO entries only point at encrypted pushes."""

    # per push channel: put (u32, CVM writes), get (u32, device writes), doorbell token (u32)
    CHANNEL_REGS = 0x000
    CHANNEL_STRIDE = 0x40
    # RPC queue: request seq put (CVM), response seq (device)
    RPC_PUT = 0x100
    RPC_GET = 0x104
    GPFIFO_BASE = 0x1000  # entries: u64 iova, u32 length, u32 reserved; per channel ring

    @staticmethod
    def put(channel: PushChannel) -> int:
        return Bar0.CHANNEL_REGS + int(channel) * Bar0.CHANNEL_STRIDE

    @staticmethod
    def get(channel: PushChannel) -> int:
        return Bar0.put(channel) + 4

    @staticmethod
    def doorbell(channel: PushChannel) -> int:
        return Bar0.put(channel) + 8

    @staticmethod
    def size(layout: Layout) -> int:
        end = Bar0.gpfifo_entry(layout, PushChannel.KERNEL, layout.gpfifo_entries)
        return -(-end // PAGE) * PAGE

    @staticmethod
    def gpfifo_entry(layout: Layout, channel: PushChannel, index: int) -> int:
        return Bar0.GPFIFO_BASE + (int(channel) * layout.gpfifo_entries + index) * 16


RPC_HEADER = struct.Struct("<IIB3x")  # RPC slot header: sequence number, payload length, encrypted
FAULT_REG = 12  # per-channel error notifier, inside the channel's BAR0 registers
GPFIFO_ENTRY = struct.Struct("<QII")  # push IOVA, push length, reserved
U32 = struct.Struct("<I")
# notifier, channel counter, message counter, pad; then ciphertext(8) || tag(16)
SEMAPHORE_HEADER = struct.Struct("<QQII")


def layout_for(buffer_bytes: int) -> Layout:
    """Bounce-buffer records of 1 MiB, or smaller when the dataset buffer itself is smaller."""
    return Layout(record_bytes=record_bytes_for(buffer_bytes))


def manifest_piece_bytes(layout: Layout) -> int:
    """A holder's manifest piece size: at most one record, so pieces tile any buffer (whole records)."""
    return min(PIECE_BYTES, layout.record_bytes)
