"""How many data holders this machine can carry in one local cohort: each is a process, so uids,
the host's descriptors and memory grow with their number. Checked before anything starts, naming
the limit; memory against MemAvailable (the device's VRAM memfd is charged there, not to /dev/shm).
"""

from __future__ import annotations

import contextlib
import resource

from gputravel.cohort.isolation import BLOCK
from gputravel.errors import BadInput
from gputravel.protocol.layout import PAGE

MIB = 1 << 20
#: The uid block less the other parties, rounded down.
MAX_HOLDERS = (BLOCK - 8) // 100 * 100
#: The host's per CVM (connection, DMA segment, interrupt) with a margin, and every process's own.
FDS_PER_HOLDER, FDS_BASE = 4, 64
#: A holder process's private memory (~25 MiB measured, rounded up), and what is left free.
PROCESS_MIB, RESERVE_MIB = 40, 512
#: The largest dataset buffer any command takes, MiB (the paper's Table 1 goes up to 512).
MAX_BUFFER_MIB = 1024
#: What the device's VRAM holds beside the dataset buffer (CohortConfig.device_vram), MiB.
VRAM_MARGIN_MIB = 64


def mib_per_holder(sysmem_bytes: int, dataset_bytes: int) -> int:
    return PROCESS_MIB + -(-(sysmem_bytes + dataset_bytes) // MIB)


def available_mib() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return None


def check_memory(need_mib: int, what_needs: str, fix: str, detail: str = "") -> None:
    """BadInput, saying `fix`, unless `need_mib` fits in MemAvailable (where readable) less RESERVE_MIB."""
    have = available_mib()
    if have is not None and need_mib + RESERVE_MIB > have:
        raise BadInput(f"{what_needs} about {need_mib} MiB of memory{f' ({detail})' if detail else ''}, above the "
                       f"{max(have - RESERVE_MIB, 0)} MiB this machine has available (MemAvailable {have} MiB, less "
                       f"{RESERVE_MIB} MiB kept free): {fix}")


def check_buffer(buffer_bytes: int, flag: str, unit: int = MIB, given: object = None) -> None:
    """BadInput naming `flag` (in `unit` bytes; `given`: as typed) unless the buffer is a positive
    multiple of a page, at most MAX_BUFFER_MIB, and the device's VRAM fits in memory."""
    name = {MIB: "MiB", 1 << 10: "KiB"}.get(unit, f"x {unit} bytes")
    shown = f"{buffer_bytes / unit:.12g}" if given is None else str(given)
    page, top = f"{PAGE / unit:.12g}", f"{MAX_BUFFER_MIB * MIB / unit:.12g}"
    if not 0 < buffer_bytes <= MAX_BUFFER_MIB * MIB or buffer_bytes % PAGE:
        raise BadInput(f"{flag} must be a multiple of {page} ({PAGE >> 10} KiB) from {page} to {top} ({name}), "
                       f"got {shown}")
    vram = -(-buffer_bytes // MIB) + VRAM_MARGIN_MIB
    check_memory(vram, f"{flag} {shown}: the GPU's protected memory needs", f"use a smaller {flag}",
                 f"the buffer and {VRAM_MARGIN_MIB} MiB more, populated when the device boots")


def check(holders: int, *, sysmem_bytes: int, dataset_bytes: int, gpus: int = 1, vram_mib: int = 0,
          train_mib: int = 0, fix: str = "use fewer holders or GPUs, or smaller datasets") -> None:
    """BadInput, naming the limit, if this machine cannot carry these holders and `gpus` cohorts."""
    if not 1 <= holders <= MAX_HOLDERS:
        raise BadInput(f"a cohort has between 1 and {MAX_HOLDERS} holders (its parties share a block of "
                       f"{BLOCK} uids), not {holders}")
    who = f"{holders} holder{'s' if holders != 1 else ''}" if gpus == 1 else f"{gpus} GPUs with {holders} holders"
    need = "needs" if holders == 1 and gpus == 1 else "need"
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    fds = FDS_PER_HOLDER * holders + gpus * FDS_BASE
    if soft != resource.RLIM_INFINITY and soft < fds:
        raise BadInput(f"{who} {need} about {fds} open files in the host process, above this "
                       f"process's limit of {soft} (RLIMIT_NOFILE): raise it (ulimit -n {fds}) or use fewer holders")
    each = mib_per_holder(sysmem_bytes, dataset_bytes)
    per_gpu = (4 * PROCESS_MIB if gpus > 1 else 0) + vram_mib + train_mib
    gpu = f"{per_gpu} MiB a GPU with its own cohort" if gpus > 1 else f"{per_gpu} MiB the GPU"
    parts = [name for name, mib in (("VRAM", vram_mib), ("training", train_mib)) if mib]
    gpu += f" ({', '.join(parts)})" if parts else ""
    check_memory(holders * each + gpus * per_gpu, f"{who} {need}", fix,
                 f"{each} MiB a holder: process, DMA segment, dataset; {gpu}")
