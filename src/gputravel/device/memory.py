"""The emulated GPU's memory: the DMA window the PCIe MUX maps, records in, and VRAM scrubs.

The device reaches CVM memory only through the one window the IOMMU (the PCIe MUX) maps at
the moment; anything outside it is a :class:`DmaFault`. A sealed copy record is first read
out of that window into the device's own memory as it is opened (:func:`open_record`).
Scrubbing VRAM (a new SPDM session, a Memset) runs at memory bandwidth through :func:`fill`.
"""

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


#: The copy engine's own buffer for a record on its way in: small enough to stay in a core's
#: L2 cache (1 MiB here), so that reading the record through it costs little more than reading
#: it once. 256 KiB measured faster in the cohort than 128 or 512 KiB (docs/benchmarks.md).
PIECE_BYTES = 256 * 1024


def open_record(receiver: Opener, record: memoryview, piece: bytearray, scratch: bytearray) -> memoryview:
    """Read a sealed record (ciphertext || tag) out of a DMA window, verify and decrypt it.

    ``record`` lies in memory the host (and the holder) can write while the device works, so
    its bytes are read exactly once, a piece at a time into ``piece``, the copy engine's own
    buffer, and the tag check and the decryption read only those private copies
    (Receiver.decrypt_once_into). AES-GCM implementations may read their input twice (GHASH,
    then the CTR pass); decrypting straight from the slot, a host rewriting it in between
    could have bytes decrypted that the tag never covered. The plaintext lands in the private
    ``scratch`` (IntegrityError, with scratch zeroed, on a bad tag); the caller copies the
    returned view on into VRAM only after this returns.
    """
    out = memoryview(scratch)[: len(record) - TAG_BYTES]
    receiver.decrypt_once_into(record, out, piece)
    return out


#: glibc tunables the device process starts with (cohort/isolation.party_env sets them). The
#: VRAM write stands for a copy engine's DMA, which does not pass through a CPU's cache; with
#: this threshold glibc writes any copy over 256 KiB with non-temporal stores, so writing a
#: 1 MiB record into VRAM no longer evicts the cache the next record is opened in
#: (docs/benchmarks.md, "non-temporal stores"). It changes no byte written, only how.
COPY_ENGINE_TUNABLES = "glibc.cpu.x86_non_temporal_threshold=0x40000"


def check_range(offset: int, nbytes: int, limit: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > limit:
        raise DeviceError(f"VRAM range {offset:#x}+{nbytes} out of bounds")


#: Buffers at least this large are filled by several threads: one core's stores do not
#: reach the memory bandwidth (two threads scrubbed 512 MiB about 20% faster here).
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
