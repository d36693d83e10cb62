"""The emulated GPU's memory: the one DMA window the PCIe MUX maps (outside it, a DmaFault),
records read in from it, and VRAM scrubs at memory bandwidth."""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gputravel.crypto.channel import TAG_BYTES
from gputravel.errors import DeviceError

if TYPE_CHECKING:
    from gputravel.crypto.channel import SizedBuffer


class DmaFault(DeviceError):
    """The device touched an IOVA that the IOMMU (the PCIe MUX) does not map right now."""


@dataclass
class DmaWindow:
    cvm: str
    iova: int
    view: memoryview


def dma_view(win: DmaWindow | None, iova: int, nbytes: int) -> memoryview:
    """The bytes at ``iova`` in the mapped window; DmaFault unless all of them are mapped."""
    if win is None or iova < win.iova or iova + nbytes > win.iova + len(win.view) or nbytes < 0:
        raise DmaFault(f"DMA fault at IOVA {iova:#x} (+{nbytes})")
    start = iova - win.iova
    return win.view[start : start + nbytes]


class Opener(Protocol):
    """What opens a record: crypto/channel.Receiver (the device's copy-engine receiver)."""

    def decrypt_once_into(self, data: SizedBuffer, out: SizedBuffer, piece: SizedBuffer,
                          aad: bytes | None = None) -> None: ...


#: The copy engine's own buffer for a record on its way in: it stays in L2, so reading through it
#: costs little more than reading once (256 KiB beat 128 and 512 KiB: docs/benchmarks.md).
PIECE_BYTES = 256 * 1024


def open_record(receiver: Opener, record: memoryview, piece: bytearray, scratch: bytearray) -> memoryview:
    """Verify and decrypt a sealed record (ciphertext || tag) in a DMA window. The host can rewrite
    it meanwhile and AES-GCM may read its input twice, so each byte is read once, into ``piece``, and
    only those copies are checked and decrypted, into ``scratch`` (zeroed on a bad tag)."""
    out = memoryview(scratch)[: len(record) - TAG_BYTES]
    receiver.decrypt_once_into(record, out, piece)
    return out


#: The device process's glibc tunables: copies over 256 KiB bypass the cache, as a copy engine's
#: DMA does, so a record written to VRAM keeps the next one's cache (docs/benchmarks.md).
COPY_ENGINE_TUNABLES = "glibc.cpu.x86_non_temporal_threshold=0x40000"


def check_range(offset: int, nbytes: int, limit: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > limit:
        raise DeviceError(f"VRAM range {offset:#x}+{nbytes} out of bounds")


#: Buffers this large are filled by several threads: one core's stores fall short of the bandwidth.
FILL_SPLIT_BYTES = 64 << 20
_FILL_THREADS = max(1, min(os.cpu_count() or 1, 4))
_fill_pool: ThreadPoolExecutor | None = None


def fill(view: memoryview, value: int) -> None:
    """memset through ctypes: runs at memory bandwidth and releases the GIL."""
    if len(view) == 0:
        return
    if view.readonly:
        raise DeviceError("VRAM is read-only")
    buf = (ctypes.c_char * len(view)).from_buffer(view)
    try:
        base, n, byte = ctypes.addressof(buf), len(view), value & 0xFF
        parts = _FILL_THREADS if n >= FILL_SPLIT_BYTES else 1
        if parts == 1:
            ctypes.memset(base, byte, n)
            return
        global _fill_pool
        if _fill_pool is None:
            _fill_pool = ThreadPoolExecutor(max_workers=parts - 1, thread_name_prefix="fill")
        step = -(-n // parts)
        pieces = [(base + off, min(step, n - off)) for off in range(0, n, step)]
        helpers = [_fill_pool.submit(ctypes.memset, addr, byte, size) for addr, size in pieces[1:]]
        ctypes.memset(pieces[0][0], byte, pieces[0][1])
        for job in helpers:
            job.result()
    finally:
        del buf
