"""`gputravel bench compare`: GPU Travelling against the centralised TLS baseline on the same
capped links (paper 7.2, Figure 6); docs/benchmarks.md gives the method.

Baseline transfers longer than ``max_transfer_s`` are extrapolated linearly in size from the
largest size measured at that bandwidth (``"extrapolated": true``), not run.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from gputravel.errors import BadInput, RemoteError, number_in
from gputravel.net import LINK_NETNS, check_rate
from gputravel.cohort.links import resolve_link
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.local import Cohort
from gputravel.bench import paper
from gputravel.cohort import capacity
from gputravel.protocol.hardware import EMULATED, hardware_profile
from gputravel.protocol.layout import Layout

MIB = 1 << 20
HOLDER = "holder-1"
RATE_TOLERANCE = 0.15
WARMUP_BYTES = MIB  # the baseline's warm-up moves one record-sized chunk, not a whole buffer
LINKS = ("auto", "netns", "token-bucket")  # auto: netns-tc where namespaces work, else token-bucket


@dataclass(frozen=True)
class CompareConfig:
    sizes_mib: tuple[int, ...]
    bandwidths: tuple[float | None, ...]  # Mbit/s; None: uncapped
    repeat: int = 3
    link: str = "auto"
    max_transfer_s: float = 25.0  # longer baseline transfers (size/rate) are extrapolated
    link_check_s: float = 2.0  # netns-tc: a raw TCP transfer of about this long per cap; 0: none
    workdir: str | None = None
    hardware: str = EMULATED  # protocol/hardware.py: the hardware both methods stand for

    def __post_init__(self) -> None:
        check_sizes(self.sizes_mib)  # what this machine carries, before anything starts
        check_links(self.bandwidths, self.link)
        if self.repeat < 1:
            raise BadInput("--repeat must be at least 1")
        number_in(self.max_transfer_s, "--max-transfer-s")
        number_in(self.link_check_s, "--link-check-s", low_included=True)
        hardware_profile(self.hardware)  # BadInput for an unknown profile


def check_links(bandwidths: tuple[float | None, ...], link: str) -> None:
    if not bandwidths or any(b is not None and not 0 < b <= 100_000 for b in bandwidths):
        raise BadInput("bandwidths must be in (0, 100000] Mbit/s, or 'uncapped'")
    if link not in LINKS:
        raise BadInput(f"--link must be auto, netns or token-bucket, not {link!r}")


def check_sizes(sizes_mib: list[int] | tuple[int, ...]) -> None:
    """BadInput naming --sizes if this machine cannot carry one holder's cohort at the largest size."""
    if not sizes_mib or any(not 1 <= s <= 4096 for s in sizes_mib):
        raise BadInput("sizes must be between 1 and 4096 MiB")
    size = max(sizes_mib)
    capacity.check(1, sysmem_bytes=Layout().sysmem_bytes, dataset_bytes=size * MIB,
                   vram_mib=size + capacity.VRAM_MARGIN_MIB, fix=f"use smaller --sizes than {size} MiB")


def link_kind(link: str) -> str:
    """The link the whole grid runs on: what a capped cohort would get (cohort/links.py)."""
    check_links((None,), link)
    return resolve_link(link, bandwidth_mbit=1.0)


def transfer_s(size_mib: int, bandwidth_mbit: float | None) -> float:
    return 0.0 if bandwidth_mbit is None else size_mib * MIB * 8 / (bandwidth_mbit * 1e6)


def run(cfg: CompareConfig, *, on_cell: Callable[[dict], None] | None = None) -> dict:
    kind = link_kind(cfg.link)
    sizes = sorted(set(cfg.sizes_mib))
    result = {"link": kind, **stamp(), "repeat": cfg.repeat, "max_transfer_s": cfg.max_transfer_s, "cells": [],
              "link_checks": [], "hardware": hardware_profile(cfg.hardware).to_json()}
    with tempfile.TemporaryDirectory(prefix="gputravel-compare-", dir=cfg.workdir) as tmp:
        data = {s: dataset(Path(tmp), s) for s in sizes}
        for bw in cfg.bandwidths:
            result["cells"].extend(_bandwidth(cfg, kind, bw, sizes, data, result["link_checks"], on_cell))
    result["tie_breaks"] = tie_breaks(result["cells"], cfg.bandwidths)
    result["tie_break_estimates"] = [{"bandwidth_mbit": bw, "size_mib": paper.tie_break_mib(result["cells"], bw)}
                                     for bw in cfg.bandwidths]
    result["table_2"] = paper.table_2(result["cells"])  # the 512 MiB cells beside the paper's Table 2
    return result


def _bandwidth(cfg: CompareConfig, kind: str, bw: float | None, sizes: list[int], data: dict[int, str],
               checks: list, on_cell: Callable[[dict], None] | None) -> list[dict]:
    cells: list[dict] = []
    ref: dict | None = None  # the largest size measured at this bandwidth
    for size in sizes:
        measure = ref is None or transfer_s(size, bw) <= cfg.max_transfer_s
        with Cohort(_cohort_config(kind, bw, size, data[size], cfg)) as cohort:
            if (bw is not None and kind == LINK_NETNS and cfg.link_check_s > 0
                    and not any(c["bandwidth_mbit"] == bw for c in checks)):
                checks.append(_link_check(cohort, bw, cfg.link_check_s))
            travel = _travels(cohort, cfg.repeat)
            base = _baselines(cohort, cfg.repeat) if measure else _extrapolate(ref, size)
        cell = _cell(size, bw, travel, base)
        if measure:
            ref = cell
        cells.append(cell)
        if on_cell is not None:
            on_cell(cell)
    return cells


def _cohort_config(kind: str, bw: float | None, size: int, dataset: str, cfg: CompareConfig) -> CohortConfig:
    link = "netns" if kind == LINK_NETNS else "token-bucket"
    timeout = 120.0 + 2 * transfer_s(min(size, 4), bw)  # per 4 MiB piece of a baseline transfer
    return CohortConfig(holders=(HolderSpec(HOLDER, dataset),), buffer_bytes=size * MIB, bandwidth_mbit=bw,
                        link=link, workdir=cfg.workdir, travel_timeout=timeout, hardware=cfg.hardware)


def _travels(cohort: Cohort, repeat: int) -> dict:
    cohort.travel(HOLDER, 0)  # warm-up: first touch of staging slots and code paths
    reports = [cohort.travel(HOLDER, 0) for _ in range(repeat)]
    refused = [r.refused for r in reports if r.chunk is None]
    if refused:
        raise RemoteError(f"the holder refused a travel: {refused[0]}")
    return {"total_ms": statistics.median(r.total_ms for r in reports),
            "tls_ms": statistics.median(r.steps_ms["tls"] for r in reports)}


def _baselines(cohort: Cohort, repeat: int) -> dict:
    size = cohort.config.buffer_bytes
    cohort.baseline(HOLDER, max(size - WARMUP_BYTES, 0))  # warm-up: one small chunk
    reports = [cohort.baseline(HOLDER, 0) for _ in range(repeat)]
    steps = {k: statistics.median(r.steps_ms[k] for r in reports) for k in ("read", "tls", "gpu_write")}
    return {"total_ms": statistics.median(r.total_ms for r in reports), "steps_ms": steps,
            "extrapolated": False, "from_mib": None}


def _extrapolate(ref: dict | None, size: int) -> dict:
    assert ref is not None
    k = size / ref["size_mib"]
    steps = {name: v * k for name, v in ref["baseline_steps_ms"].items()}
    return {"total_ms": ref["baseline_ms"] * k, "steps_ms": steps, "extrapolated": True, "from_mib": ref["size_mib"]}


def _cell(size: int, bw: float | None, travel: dict, base: dict) -> dict:
    expected_ms = transfer_s(size, bw) * 1e3
    agreement = None
    if bw is not None and not base["extrapolated"]:
        ratio = base["steps_ms"]["tls"] / expected_ms
        agreement = {"expected_ms": expected_ms, "measured_ms": base["steps_ms"]["tls"], "ratio": ratio,
                     "ok": abs(ratio - 1) <= RATE_TOLERANCE}
    speedup = base["total_ms"] / travel["total_ms"]
    estimate = paper.paper_speedup(size, bw)
    cell = {"size_mib": size, "bandwidth_mbit": bw, "travel_ms": travel["total_ms"], "travel_tls_ms": travel["tls_ms"],
            "baseline_ms": base["total_ms"], "baseline_transfer_ms": base["steps_ms"]["tls"],
            "baseline_steps_ms": base["steps_ms"], "speedup": speedup, "extrapolated": base["extrapolated"],
            "extrapolated_from_mib": base["from_mib"], "rate_agreement": agreement,
            "paper_speedup_estimate": estimate, "at_least_paper": None if estimate is None else speedup >= estimate}
    return {**cell, "paper": paper.against_paper(cell)}  # Figure 6, cell by cell (estimated: bench/paper.py)


def _link_check(cohort: Cohort, bw: float, seconds: float) -> dict:
    """One raw TCP transfer, holder to orchestrator, of about ``seconds`` at the cap (1 to 32 MiB)."""
    nbytes = int(min(32 * MIB, max(MIB, bw * 1e6 / 8 * seconds)))
    check = check_rate(cohort.links.shaped, HOLDER, "orchestrator", nbytes, tolerance=RATE_TOLERANCE)
    return {"bandwidth_mbit": bw, "nbytes": nbytes, "measured_mbit": check.measured_mbit,
            "expected_s": check.expected_s, "measured_s": check.measured_s,
            "ratio": check.measured_s / check.expected_s, "ok": check.ok}


def tie_breaks(cells: list[dict], bandwidths: tuple[float | None, ...]) -> list[dict]:
    """Per bandwidth: where the baseline was faster, and from which size travelling wins for good."""
    out = []
    for bw in bandwidths:
        row = sorted((c for c in cells if c["bandwidth_mbit"] == bw), key=lambda c: c["size_mib"])
        slower = [c["size_mib"] for c in row if c["speedup"] < 1]
        wins_from = next((c["size_mib"] for c in row if not slower or c["size_mib"] > slower[-1]), None)
        out.append({"bandwidth_mbit": bw, "baseline_faster_at_mib": slower, "travel_faster_from_mib": wins_from})
    return out


def dataset(directory: Path, size_mib: int) -> str:
    path = directory / f"holder-{size_mib}mib.bin"
    with open(path, "wb") as f:
        f.writelines(os.urandom(MIB) for _ in range(size_mib))
    return str(path)


def stamp() -> dict:
    """Where and when a benchmark ran, for its JSON."""
    return {"machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
                       f"{platform.python_implementation()} {platform.python_version()}",
            "date": datetime.now(UTC).isoformat(timespec="seconds")}


def plot(result: dict, path: Path) -> Path:
    """Like the paper's Figure 6: one panel per bandwidth; extrapolated baseline bars hatched."""
    from matplotlib.figure import Figure

    bws = list(dict.fromkeys(c["bandwidth_mbit"] for c in result["cells"]))
    fig = Figure(figsize=(3.2 * len(bws), 4.2), dpi=110)
    axes = fig.subplots(1, len(bws), sharey=True, squeeze=False)[0]
    for ax, bw in zip(axes, bws, strict=True):
        _panel(ax, [c for c in result["cells"] if c["bandwidth_mbit"] == bw], bw)
    cells = result["cells"]  # the panels share the y axis: room for every bar and label
    axes[0].set_ylim(min(c["travel_ms"] for c in cells) / 2, max(c["baseline_ms"] for c in cells) * 40)
    axes[0].set_ylabel("time per transmission (ms, log)")
    axes[0].legend(loc="upper left", fontsize=7)
    fig.suptitle(f"GPU Travelling vs centralised TLS baseline (link: {result['link']})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")  # to `path` as named: without a format, "fig" would become fig.png
    return path


def _panel(ax, cells: list[dict], bw: float | None) -> None:
    cells = sorted(cells, key=lambda c: c["size_mib"])
    xs = range(len(cells))
    ax.bar([x - 0.2 for x in xs], [c["travel_ms"] for c in cells], 0.4, label="GPU Travelling", color="tab:blue")
    bars = ax.bar([x + 0.2 for x in xs], [c["baseline_ms"] for c in cells], 0.4, label="TLS baseline",
                  color="tab:orange")
    for bar, c in zip(bars, cells, strict=True):
        if c["extrapolated"]:
            bar.set_hatch("//")
            bar.set_alpha(0.6)
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() * 1.15, fmt_speedup(c["speedup"]),
                ha="center", va="bottom", fontsize=6, rotation=90)
    ax.set_yscale("log")
    ax.set_xticks(list(xs), [str(c["size_mib"]) for c in cells], fontsize=7)
    ax.set_xlabel("buffer (MiB)")
    ax.set_title("uncapped" if bw is None else f"{bw:g} Mbit/s", fontsize=9)


COLUMNS = ("MiB", "Mbit/s", "travel", "baseline", "speedup", "paper est.", "rate chk")


def table_rows(result: dict) -> list[list[str]]:
    """One printable row per cell; extrapolated baseline times marked '~'."""
    rows = []
    for c in result["cells"]:
        mark = "~" if c["extrapolated"] else ""
        agree = c["rate_agreement"]
        check = "-" if agree is None else f"{agree['ratio']:.3f}{'' if agree['ok'] else ' OFF'}"
        paper = "-" if c["paper_speedup_estimate"] is None else fmt_speedup(c["paper_speedup_estimate"])
        rows.append([str(c["size_mib"]), bandwidth_label(c["bandwidth_mbit"]), fmt_ms(c["travel_ms"]),
                     mark + fmt_ms(c["baseline_ms"]),
                     mark + fmt_speedup(c["speedup"]), paper, check])
    return rows


def fmt_ms(ms: float) -> str:
    return f"{ms:.1f} ms" if ms < 1000 else f"{ms / 1e3:.1f} s"


def fmt_speedup(x: float) -> str:
    return f"{x:.2f}x" if x < 10 else f"{x:,.0f}x"


def bandwidth_label(bw: float | None) -> str:
    return "uncapped" if bw is None else f"{bw:g}"


def parse_list(text: str, item: Callable[[str], Any], error: str) -> tuple:
    """A benchmark option's comma-separated values; BadInput(`error`) if `item` refuses one."""
    try:
        return tuple(item(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise BadInput(error) from None


def parse_bandwidths(text: str) -> tuple[float | None, ...]:
    """'4,20,100,500,uncapped' -> (4.0, 20.0, 100.0, 500.0, None)."""
    out = parse_list(text.lower(), lambda x: None if x in ("uncapped", "none", "inf") else float(x),
                     f"bandwidths are Mbit/s numbers or 'uncapped', got {text!r}")
    if not out:
        raise BadInput("give at least one bandwidth")
    return out
