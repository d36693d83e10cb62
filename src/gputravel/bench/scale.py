"""`gputravel bench scale`: what a travel costs as the cohort grows (issue 17, part 3).

Per holder count, travels round robin (the case that grows) alternate in blocks with travels
to one warm holder (the control), so both see the same load; docs/benchmarks.md reads them.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

from gputravel.bench.compare import parse_list, stamp
from gputravel.cohort import capacity
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.local import Cohort
from gputravel.errors import BadInput
from gputravel.protocol.control import STEPS, TravelReport
from gputravel.protocol.layout import Layout

MIB = 1 << 20
BLOCK = 8  # travels per block: round robin and the control alternate


def parse_holders(text: str) -> list[int]:
    """`1,8,32,64` -> [1, 8, 32, 64] (BadInput for anything else)."""
    counts = list(parse_list(text, int, f"--holders takes comma-separated counts, e.g. 1,8,32,64, not {text!r}"))
    if not counts or any(not 1 <= n <= capacity.MAX_HOLDERS for n in counts):
        raise BadInput(f"--holders: each count must be between 1 and {capacity.MAX_HOLDERS}")
    return counts


def run(holders: list[int], travels: int, buffer_mib: int = 1, *, command: str = "",
        on_row: Callable[[dict], None] | None = None, workdir: str | None = None) -> dict:
    if not holders:
        raise BadInput("--holders needs at least one count")
    if travels < 1:
        raise BadInput("--travels must be at least 1")
    if not 1 <= buffer_mib <= capacity.MAX_BUFFER_MIB:
        raise BadInput(f"--buffer-mib must be between 1 and {capacity.MAX_BUFFER_MIB}")
    for n in holders:  # before anything starts: every row must fit this machine
        capacity.check(n, sysmem_bytes=Layout().sysmem_bytes, dataset_bytes=buffer_mib * MIB,
                       vram_mib=buffer_mib + capacity.VRAM_MARGIN_MIB)
    result = {**stamp(), "command": command, "travels": travels, "buffer_mib": buffer_mib, "rows": []}
    with tempfile.TemporaryDirectory(prefix="gputravel-scale-", dir=workdir) as tmp:
        for n in holders:
            row = measure(Path(tmp), n, travels, buffer_mib * MIB)
            result["rows"].append(row)
            if on_row:
                on_row(row)
    base = next((r["median_ms"] for r in result["rows"] if r["holders"] == 1), None)
    for row in result["rows"]:
        row["vs_1_holder"] = row["median_ms"] / base if base else None
    return result


def measure(tmp: Path, n: int, travels: int, buffer_bytes: int) -> dict:
    specs = []
    for i in range(1, n + 1):
        path = tmp / f"holder-{i}.bin"
        path.write_bytes(os.urandom(buffer_bytes))
        specs.append(HolderSpec(f"holder-{i}", str(path)))
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with Cohort(CohortConfig(holders=tuple(specs), buffer_bytes=buffer_bytes)) as cohort:
        boot_s = time.perf_counter() - started
        names, pids = [s.name for s in specs], cohort.pids()
        memory = [holder_memory(pids[name]) for name in names]
        for name in names:  # warm-up: first touch of every holder's staging slots and code paths
            cohort.travel(name, 0)
        reports, same = travel_in_blocks(cohort, names, travels)
    for path in tmp.iterdir():
        path.unlink()
    row = row_of(n, reports, boot_s, memory, (load_before, os.getloadavg()[0]))
    row["same_holder_median_ms"] = statistics.median(r.total_ms for r in same)
    row["same_holder_fixed_ms"] = statistics.median(fixed_ms(r) for r in same)
    return row


def travel_in_blocks(cohort: Cohort, names: list[str], travels: int) -> tuple[list[TravelReport], list[TravelReport]]:
    """``travels`` round robin and as many to the last holder (the control), in alternating blocks."""
    rotation: list[TravelReport] = []
    control: list[TravelReport] = []
    while len(rotation) < travels:
        for _ in range(min(BLOCK, travels - len(rotation))):
            rotation.append(cohort.travel(names[len(rotation) % len(names)], 0))
        for _ in range(min(BLOCK, travels - len(control))):
            control.append(cohort.travel(names[-1], 0))
    return rotation, control


def row_of(n: int, reports: list[TravelReport], boot_s: float, memory: list[dict], load: tuple[float, float]) -> dict:
    totals = [r.total_ms for r in reports]
    fixed = [fixed_ms(r) for r in reports]
    return {"holders": n, "travels": len(reports), "median_ms": statistics.median(totals),
            "p90_ms": statistics.quantiles(totals, n=10, method="inclusive")[8] if len(totals) > 1 else totals[0],
            "fixed_ms": statistics.median(fixed),
            "steps_ms": {s: statistics.median(r.steps_ms[s] for r in reports) for s in STEPS}, "boot_s": boot_s,
            "rss_mib": statistics.median(m["rss_mib"] for m in memory),
            "rss_private_mib": statistics.median(m["rss_private_mib"] for m in memory),
            "boot_cpu_s": statistics.median(m["cpu_s"] for m in memory),
            "verified": all(r.chunk is not None for r in reports),
            "loadavg": list(load)}  # 1-minute load before and after: other work on the machine


def fixed_ms(r: TravelReport) -> float:
    """A travel beyond moving and scrubbing the data (bench/travel.py's fixed overhead)."""
    return r.total_ms - r.steps_ms["dh_copy"] - r.steps_ms["o_cleanup"]


def holder_memory(pid: int) -> dict:
    """A holder's VmRSS (shared libraries and DMA segment too), RssAnon and CPU so far, from /proc."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read().rsplit(")", 1)[1].split()
    return {"rss_mib": int(fields["VmRSS"][0]) / 1024, "rss_private_mib": int(fields["RssAnon"][0]) / 1024,
            "cpu_s": (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")}
