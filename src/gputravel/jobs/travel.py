"""The travel job (`gputravel travel`): a local cohort moving every holder's seeded synthetic
dataset through the GPU round robin, each chunk verified by digest, without training. With
several GPUs each is a cohort of its own travelling to its share of the holders, all at once.
"""

from __future__ import annotations

import hashlib
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from gputravel.errors import BadInput
from gputravel.protocol.hardware import hardware_profile
from gputravel.protocol.control import STEPS, TravelReport
from gputravel.protocol.layout import Layout
from gputravel.cohort import capacity
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.gpus import GpuCohorts, on_each
from gputravel.cohort.local import Cohort
from gputravel.train.schedule import partition

MIB = 1 << 20


@dataclass(frozen=True)
class TravelJobConfig:
    holders: int = 3
    dataset_mib: int = 24
    buffer_mib: int = 8
    seed: int = 0
    hardware: str = "emulated"  # protocol/hardware.py
    gpus: int = 1  # each GPU a single-GPU cohort travelling to its own share of the holders

    def __post_init__(self) -> None:
        if not 1 <= self.holders <= capacity.MAX_HOLDERS:  # what this machine carries: check_capacity
            raise BadInput(f"--holders must be between 1 and {capacity.MAX_HOLDERS}")
        if not 1 <= self.buffer_mib <= capacity.MAX_BUFFER_MIB:
            raise BadInput(f"--buffer-mib must be between 1 and {capacity.MAX_BUFFER_MIB}")
        if not 1 <= self.dataset_mib <= 4096:  # an empty dataset has nothing to travel for
            raise BadInput("--dataset-mib must be between 1 and 4096")
        hardware_profile(self.hardware)  # BadInput for an unknown profile
        if type(self.gpus) is not int or not 1 <= self.gpus <= self.holders:
            raise BadInput(f"--gpus must be between 1 and the number of holders ({self.holders}): each GPU "
                           f"travels to holders of its own, got {self.gpus!r}")


@dataclass(frozen=True)
class Travel:
    """One travel: which GPU, when (seconds from the job's common start) and its report."""

    gpu: int
    holder: str
    dataset_offset: int
    start_s: float
    end_s: float
    report: TravelReport


def make_dataset(path: Path, nbytes: int, seed: bytes) -> None:
    """Deterministic bytes: SHAKE-256 of the seed, so a run can be reproduced and checked."""
    with open(path, "wb") as f:
        for block, at in enumerate(range(0, nbytes, 4 * MIB)):
            f.write(hashlib.shake_256(seed + block.to_bytes(8, "big")).digest(min(4 * MIB, nbytes - at)))


def plan(dataset_bytes: dict[str, int], buffer_bytes: int) -> Iterator[tuple[str, int]]:
    """Round robin over holders, one chunk each, until every dataset has been visited once."""
    cursors = {name: 0 for name, size in dataset_bytes.items() if size > 0}
    while cursors:
        for name in list(cursors):
            yield name, cursors[name]
            cursors[name] += buffer_bytes
            if cursors[name] >= dataset_bytes[name]:
                del cursors[name]


def run_travels(config: TravelJobConfig, workdir: Path, on_travel: Callable[[Travel], None]) -> list[Travel]:
    """Every chunk of every holder once, each travel to `on_travel`; the first error of any GPU stops them all."""
    check_capacity(config)
    base = CohortConfig(holders=_datasets(config, workdir), buffer_bytes=config.buffer_mib * MIB,
                        hardware=config.hardware)
    log = _Log(on_travel)
    if config.gpus == 1:
        with Cohort(base) as cohort:
            log.start()
            _travel_share(0, cohort, log, threading.Event())
        return log.travels
    shares = partition({h.name: Path(h.dataset).stat().st_size for h in base.holders}, config.gpus)
    with GpuCohorts(base, shares) as gpus:
        log.start()
        stop = threading.Event()  # the first failure stops every GPU; each ends its travel in flight
        on_each(gpus.cohorts, lambda k, cohort: _travel_share(k, cohort, log, stop), stop_all=stop.set)
    return log.travels


def check_capacity(config: TravelJobConfig) -> None:
    capacity.check(config.holders, sysmem_bytes=Layout().sysmem_bytes, dataset_bytes=config.dataset_mib * MIB,
                   gpus=config.gpus, vram_mib=config.buffer_mib + capacity.VRAM_MARGIN_MIB)


def _datasets(config: TravelJobConfig, workdir: Path) -> tuple[HolderSpec, ...]:
    workdir.mkdir(parents=True, exist_ok=True)
    specs = []
    for i in range(1, config.holders + 1):
        path = workdir / f"holder-{i}.bin"
        # The seed's "gputravel-demo" prefix stays: it fixes the datasets (and their digests).
        make_dataset(path, config.dataset_mib * MIB, f"gputravel-demo/{config.seed}/{i}".encode())
        specs.append(HolderSpec(f"holder-{i}", str(path)))
    return tuple(specs)


@dataclass
class _Log:
    on_travel: Callable[[Travel], None]
    travels: list[Travel] = field(default_factory=list)
    t0: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def record(self, travel: Travel) -> None:
        with self._lock:  # the callback draws a table: one GPU at a time
            self.travels.append(travel)
            self.on_travel(travel)


def _travel_share(gpu: int, cohort: Cohort, log: _Log, stop: threading.Event) -> None:
    for holder, offset in plan(cohort.dataset_bytes, cohort.config.buffer_bytes):
        if stop.is_set():
            return
        start = log.now()
        report = cohort.travel(holder, offset)
        log.record(Travel(gpu, holder, offset, start, log.now(), report))


def summarise(reports: list[TravelReport]) -> dict:
    copied = sum(r.chunk.nbytes for r in reports if r.chunk)
    return {
        "travels": len(reports),
        "bytes": copied,
        "verified": sum(1 for r in reports if r.chunk is not None),
        "median_steps_ms": {s: statistics.median(r.steps_ms[s] for r in reports) for s in STEPS},
        "median_total_ms": statistics.median(r.total_ms for r in reports),
        "median_fixed_ms": statistics.median(r.total_ms - r.steps_ms["dh_copy"] - r.steps_ms["o_cleanup"] for r in reports),
    }
