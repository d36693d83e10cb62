"""The travel job (the `gputravel travel` command): a whole local cohort moving every holder's
dataset through the GPU, without training.

Each holder gets a deterministic synthetic dataset (seeded bytes). The GPU travels to the
holders round robin; every chunk is verified by digest on the orchestrator side; each travel
is reported with where its time went.
"""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from gputravel.errors import BadInput
from gputravel.protocol.hardware import hardware_profile
from gputravel.protocol.control import STEPS, TravelReport
from gputravel.protocol.layout import Layout
from gputravel.cohort import capacity
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.local import Cohort

MIB = 1 << 20


@dataclass(frozen=True)
class TravelJobConfig:
    holders: int = 3
    dataset_mib: int = 24
    buffer_mib: int = 8
    seed: int = 0
    hardware: str = "emulated"  # protocol/hardware.py

    def __post_init__(self) -> None:
        if not 1 <= self.holders <= capacity.MAX_HOLDERS:  # what this machine carries: run_travel_job
            raise BadInput(f"--holders must be between 1 and {capacity.MAX_HOLDERS}")
        if not 1 <= self.buffer_mib <= 1024:
            raise BadInput("--buffer-mib must be between 1 and 1024")
        if not 1 <= self.dataset_mib <= 4096:  # an empty dataset has nothing to travel for
            raise BadInput("--dataset-mib must be between 1 and 4096")
        hardware_profile(self.hardware)  # BadInput for an unknown profile


def make_dataset(path: Path, nbytes: int, seed: bytes) -> None:
    """Deterministic bytes: SHAKE-256 of the seed, so a run can be reproduced and checked."""
    with open(path, "wb") as f:
        written = 0
        block = 0
        while written < nbytes:
            chunk = hashlib.shake_256(seed + block.to_bytes(8, "big")).digest(min(4 * MIB, nbytes - written))
            f.write(chunk)
            written += len(chunk)
            block += 1


def plan(dataset_bytes: dict[str, int], buffer_bytes: int) -> Iterator[tuple[str, int]]:
    """Round robin over holders, one chunk each, until every dataset has been visited once."""
    cursors = {name: 0 for name, size in dataset_bytes.items() if size > 0}
    while cursors:
        for name in list(cursors):
            yield name, cursors[name]
            cursors[name] += buffer_bytes
            if cursors[name] >= dataset_bytes[name]:
                del cursors[name]


def run_travel_job(config: TravelJobConfig, workdir: Path,
                   on_travel: Callable[[TravelReport], None]) -> list[TravelReport]:
    capacity.check(config.holders, sysmem_bytes=Layout().sysmem_bytes, dataset_bytes=config.dataset_mib * MIB)
    workdir.mkdir(parents=True, exist_ok=True)
    specs = []
    for i in range(1, config.holders + 1):
        path = workdir / f"holder-{i}.bin"
        # The seed's "gputravel-demo" prefix stays: it fixes the datasets (and their digests).
        make_dataset(path, config.dataset_mib * MIB, f"gputravel-demo/{config.seed}/{i}".encode())
        specs.append(HolderSpec(f"holder-{i}", str(path)))
    cohort_cfg = CohortConfig(holders=tuple(specs), buffer_bytes=config.buffer_mib * MIB, hardware=config.hardware)
    reports = []
    with Cohort(cohort_cfg) as cohort:
        for holder, offset in plan(cohort.dataset_bytes, cohort_cfg.buffer_bytes):
            report = cohort.travel(holder, offset)
            reports.append(report)
            on_travel(report)
    return reports


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
