"""How many data holders this machine can carry in one local cohort.

Every holder is a CVM process of its own, so what a cohort needs grows with their number:

- **uids**: each party runs under its own uid from the cohort's block (cohort/isolation.py);
- **descriptors**: the host keeps three per CVM (its connection, the CVM's DMA segment, its
  interrupt endpoint) and the orchestrator one TLS link per holder, all under the launcher's
  open-file limit, which the children inherit;
- **memory**: each holder's interpreter (about 25 MiB private, measured with `gputravel bench
  scale`), its DMA segment (unprotected memory, populated) and its dataset, mapped resident.

:func:`check` refuses, before anything starts, a cohort the machine cannot carry, naming the
limit it would hit.
"""

from __future__ import annotations

import resource

from gputravel.cohort.isolation import BLOCK
from gputravel.errors import BadInput

MIB = 1 << 20
#: The most holders one cohort may have: the uid block less the host, device, TDX module and
#: orchestrator, rounded down.
MAX_HOLDERS = (BLOCK - 8) // 100 * 100
#: Descriptors the host holds per CVM (connection, DMA segment, interrupt), with a margin, and
#: what every process holds anyway (interpreter, logs, its own links).
FDS_PER_HOLDER, FDS_BASE = 4, 64
#: A holder process's private memory (interpreter, libraries, heap), rounded up from the ~25
#: MiB measured, plus what is left free for everything else.
PROCESS_MIB, RESERVE_MIB = 40, 512


def fds_needed(holders: int) -> int:
    return FDS_BASE + FDS_PER_HOLDER * holders


def mib_per_holder(sysmem_bytes: int, dataset_bytes: int) -> int:
    return PROCESS_MIB + -(-(sysmem_bytes + dataset_bytes) // MIB)


def available_mib() -> int | None:
    """MemAvailable from /proc/meminfo, in MiB (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check(holders: int, *, sysmem_bytes: int, dataset_bytes: int, gpus: int = 1, vram_mib: int = 0) -> None:
    """BadInput, naming the limit, if this machine cannot carry ``holders`` holders whose DMA
    segments and datasets are this large (bytes each). With several ``gpus`` (cohort/gpus.py:
    one cohort each), each GPU's cohort beside them too: its device, whose ``vram_mib`` is
    populated, its host, TDX module and orchestrator, and the launcher's descriptors for it."""
    if not 1 <= holders <= MAX_HOLDERS:
        raise BadInput(f"a cohort has between 1 and {MAX_HOLDERS} holders (its parties share a block of "
                       f"{BLOCK} uids), not {holders}")
    who = f"{holders} holders" if gpus == 1 else f"{gpus} GPUs with {holders} holders"
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = fds_needed(holders) + (gpus - 1) * FDS_BASE
    if soft != resource.RLIM_INFINITY and soft < need:
        raise BadInput(f"{who} need about {need} open files in the host process, above this "
                       f"process's limit of {soft} (RLIMIT_NOFILE): raise it (ulimit -n {need}) or use fewer holders")
    each = mib_per_holder(sysmem_bytes, dataset_bytes)
    per_gpu = 4 * PROCESS_MIB + vram_mib if gpus > 1 else 0
    have = available_mib()
    total = holders * each + gpus * per_gpu + RESERVE_MIB
    if have is not None and total > have:
        raise BadInput(f"{who} need about {total} MiB of memory ({each} MiB a holder: process, DMA segment, "
                       f"dataset; {per_gpu} MiB a GPU with its own cohort; {RESERVE_MIB} MiB kept free), above "
                       f"the {have} MiB this machine has available (MemAvailable): use fewer holders or GPUs, or "
                       "smaller datasets")
