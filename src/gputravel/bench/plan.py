"""`gputravel plan`: what travelling would cost a consortium, before it buys hardware. Sans-IO:
benchmark results in, a prediction out. Per transmission of a buffer of ``b`` bytes:

* travelling: ``fixed + copy x b + context / goodput(bw)`` (only the context crosses the link);
* the TLS baseline: ``io x b + b / goodput(bw)`` (the read overlaps the transfer: ``io`` is the write);
* FL (modelled, not measured): each round every holder receives and sends the model.

Each method's share is transmission / (training + transmission), as the paper's Table 2.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

from gputravel.errors import BadInput, number_in
from gputravel.protocol.hardware import EMULATED, PAPER_H100, TABLE_2, TABLE_2_BUFFER_MIB, hardware_profile, table_1

MIB = 1 << 20
TIB = 1 << 40
#: "the keys and contexts were small (about 16 KiB)" (paper 7.1): what a travel sends over the link.
PAPER_CONTEXT_BYTES = 16 * 1024
SOURCES = ("auto", "results", "paper")


@dataclass(frozen=True)
class PlanInput:
    dataset_bytes: int  # per holder
    holders: int
    buffer_bytes: int
    bandwidth_mbit: float | None  # the slow link, each holder's; None: uncapped
    hardware: str = EMULATED
    tokens_per_s: float | None = None  # training throughput; or step_s with tokens_per_step
    step_s: float | None = None
    tokens_per_step: int | None = None
    bytes_per_token: float = 2.0  # llm.c's shards hold uint16 tokens
    model_bytes: int = 0  # for FL; 0: no FL estimate
    fl_rounds: int = 1
    epochs: int = 1

    def __post_init__(self) -> None:
        if self.dataset_bytes <= 0 or self.buffer_bytes <= 0:
            raise BadInput("the dataset and the buffer must be positive sizes")
        if self.holders < 1 or self.epochs < 1 or self.fl_rounds < 1:
            raise BadInput("--holders, --epochs and --fl-rounds must be at least 1")
        if self.bandwidth_mbit is not None and not self.bandwidth_mbit > 0:
            raise BadInput("--bandwidth must be a positive number of Mbit/s, or 'uncapped'")
        if self.model_bytes < 0:
            raise BadInput("--model-size must not be negative")
        number_in(self.bytes_per_token, "--bytes-per-token")
        hardware_profile(self.hardware)
        if (self.tokens_per_s is None) == (self.step_s is None):
            raise BadInput("give the training speed as --tokens-per-s, or as --step-s with --tokens-per-step")
        if self.step_s is not None:
            number_in(self.step_s, "--step-s")
            if not self.tokens_per_step or self.tokens_per_step <= 0:
                raise BadInput("--step-s needs a positive --tokens-per-step")
        if self.tokens_per_step is not None and self.step_s is None:
            raise BadInput("--tokens-per-step goes with --step-s")
        if self.tokens_per_s is not None:
            number_in(self.tokens_per_s, "--tokens-per-s")
        if not math.isfinite(self.rate) or self.rate <= 0:  # a step time so long that no token a second is left
            raise BadInput(f"the training speed comes to {self.rate:g} tokens/s: give a finite, positive one")

    @property
    def rate(self) -> float:
        return self.tokens_per_s if self.tokens_per_s is not None else self.tokens_per_step / self.step_s

    @property
    def transmissions(self) -> int:
        """Buffers moved: every holder's dataset, buffer by buffer, once per epoch."""
        return math.ceil(self.dataset_bytes / self.buffer_bytes) * self.holders * self.epochs


@dataclass(frozen=True)
class Constants:
    travel_fixed_ms: float  # a travel, beside its copy
    copy_ms_per_mib: float  # a travel's copy (and scrub)
    baseline_io_ms_per_mib: float  # the baseline's read and GPU write
    goodput: tuple[tuple[float, float], ...]  # (cap Mbit/s, goodput / cap), by cap
    uncapped_mbit: float | None  # goodput of an uncapped link; None: not known
    context_bytes: int  # what a travel sends over the link, both ways
    sources: dict[str, str] = field(default_factory=dict)

    def goodput_mbit(self, bw: float | None) -> float:
        if bw is None:
            if self.uncapped_mbit is None:
                raise BadInput("no measured rate for an uncapped link: give --bandwidth in Mbit/s, or run "
                               "`gputravel bench compare --bandwidths uncapped --json docs/results/...`")
            return self.uncapped_mbit
        return bw * _interpolate(self.goodput, bw)


def _interpolate(points: tuple[tuple[float, float], ...], bw: float) -> float:
    """Piecewise linear in log(bandwidth) between the measured caps; the nearest outside them."""
    pts = sorted(points)
    if bw <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if bw <= x1:
            t = (math.log(bw) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + t * (y1 - y0)
    return pts[-1][1]


def paper_constants() -> Constants:
    """The paper's figures: Table 1 for a travel, Table 2 for the baseline's goodput."""
    hw = hardware_profile(PAPER_H100)
    copy = hw.copy_s(MIB) * 1e3
    total = hw.copy_s(TABLE_2_BUFFER_MIB * MIB)
    bits = TABLE_2_BUFFER_MIB * MIB * 8
    points = tuple((bw, bits / (row[1] - total) / 1e6 / bw) for bw, row in TABLE_2.items() if bw is not None)
    fixed = table_1(TABLE_2_BUFFER_MIB, "Total Time") - total * 1e3  # the total less the read and the write
    return Constants(
        travel_fixed_ms=fixed, copy_ms_per_mib=copy, baseline_io_ms_per_mib=copy, goodput=points,
        uncapped_mbit=bits / (TABLE_2[None][1] - total) / 1e6, context_bytes=PAPER_CONTEXT_BYTES, sources={
            "travel": "the paper: Table 1, 512 MiB row (the total less read and write: fixed; read + write: copy)",
            "baseline": "the paper: Table 2 (goodput = 512 MiB / (Tx - read - write), per link; uncapped alike); "
                        "read + write: Table 1's rates",
            "context": "the paper 7.1: keys and contexts of about 16 KiB",
        })


def constants_from(results: list[tuple[str, dict]], hardware: str, source: str = "auto") -> Constants:
    """From the newest benchmark JSONs (``results``: (path, JSON) pairs) measured with ``hardware``,
    or from the paper's figures (paper-h100 only)."""
    if source not in SOURCES:
        raise BadInput(f"--source must be one of {', '.join(SOURCES)}")
    if source == "paper" or (source == "auto" and hardware == PAPER_H100 and not _newest(results, "travel", hardware)):
        if hardware != PAPER_H100:
            raise BadInput("the paper's figures are the paper-h100 hardware: use --hardware paper-h100")
        return paper_constants()
    travel = _newest(results, "travel", hardware)
    if travel is None:
        raise BadInput(f"no `bench travel` JSON measured with --hardware {hardware} among the results: run "
                       f"`gputravel bench travel --hardware {hardware} --json docs/results/...` or use --results")
    fixed, copy, sources = _travel_constants(*travel)
    points, uncapped, io, sources["baseline"] = _baseline_constants(_newest(results, "compare", hardware), hardware, copy)
    ctx, sources["context"] = _context_bytes(_newest(results, "codec", None))
    return Constants(travel_fixed_ms=fixed, copy_ms_per_mib=copy, baseline_io_ms_per_mib=io, goodput=points,
                     uncapped_mbit=uncapped, context_bytes=ctx, sources=sources)


def kind_of(doc: dict) -> str | None:
    """Which benchmark wrote a JSON: travel, compare, codec, or None."""
    if "cells" in doc and "tie_breaks" in doc:
        return "compare"
    if "crypto_limit_gbps" in doc and doc.get("rows") and "fixed_ms" in doc["rows"][0]:
        return "travel"
    if "codec" in doc and doc.get("rows"):
        return "codec"
    return None


def _newest(results: list[tuple[str, dict]], kind: str, hardware: str | None) -> tuple[str, dict] | None:
    found = [(doc.get("date", ""), path, doc) for path, doc in results if kind_of(doc) == kind
             and (hardware is None or doc.get("hardware", {}).get("profile", EMULATED) == hardware)]
    return max(found, key=lambda f: (f[0], f[1]))[1:] if found else None


def _travel_constants(path: str, doc: dict) -> tuple[float, float, dict[str, str]]:
    row = max(doc["rows"], key=lambda r: r["size_mib"])  # the largest buffer: the copy's rate, least noise
    per_mib = (row["steps_ms"]["dh_copy"] + row["steps_ms"]["o_cleanup"]) / row["size_mib"]
    return row["fixed_ms"], per_mib, {"travel": f"{path} (bench travel, {doc.get('date', '?')}, {row['size_mib']} MiB row)"}


def _baseline_constants(found: tuple[str, dict] | None, hardware: str, copy_ms_per_mib: float):
    """Goodput per cap and the GPU write: the read overlaps the transfer, so goodput = size / (total - write)."""
    hw = hardware_profile(hardware)
    if found is None:
        io = hw.copy_s(MIB) * 1e3 if hardware == PAPER_H100 else copy_ms_per_mib
        return (((1.0, 1.0),), None, io, f"no bench compare JSON for {hardware}: goodput taken as the cap itself, "
                "read + write as " + ("the profile's rates" if hardware == PAPER_H100 else "a travel's copy"))
    path, doc = found
    cells = [c for c in doc["cells"] if not c["extrapolated"]]
    if not cells:
        raise BadInput(f"{path}: no measured baseline cell (every one was extrapolated)")
    io = statistics.median(c["baseline_steps_ms"]["gpu_write"] / c["size_mib"] for c in cells)
    rate = {id(c): c["size_mib"] * MIB * 8 / ((c["baseline_ms"] - c["baseline_steps_ms"]["gpu_write"]) / 1e3) / 1e6
            for c in cells}  # Mbit/s of goodput
    by_cap: dict[float, list[float]] = {}
    for c in cells:
        if c["bandwidth_mbit"] is not None:
            by_cap.setdefault(c["bandwidth_mbit"], []).append(rate[id(c)] / c["bandwidth_mbit"])
    points = tuple((bw, statistics.median(v)) for bw, v in sorted(by_cap.items())) or ((1.0, 1.0),)
    free = [rate[id(c)] for c in cells if c["bandwidth_mbit"] is None]
    return (points, (statistics.median(free) if free else None), io,
            (f"{path} (bench compare, {doc.get('date', '?')}: goodput = size / (baseline - its GPU write), "
             "the read overlapping the transfer)"))


def _context_bytes(found: tuple[str, dict] | None) -> tuple[int, str]:
    if found is not None:
        path, doc = found
        sizes = {r["message"]: r["bytes"] for r in doc["rows"]}
        if "TravelRequest" in sizes and "TravelResult" in sizes:
            return sizes["TravelRequest"] + sizes["TravelResult"], f"{path} (bench codec: TravelRequest + TravelResult)"
    return 4096, "no bench codec JSON: 4 KiB assumed for the request and the reply"


def predict(inp: PlanInput, k: Constants) -> dict:
    b_mib = inp.buffer_bytes / MIB
    link = k.goodput_mbit(inp.bandwidth_mbit) * 1e6 / 8  # bytes/s of goodput
    n = inp.transmissions
    moved = inp.dataset_bytes * inp.holders * inp.epochs
    training_s = moved / inp.bytes_per_token / inp.rate
    travel_s = (k.travel_fixed_ms + k.copy_ms_per_mib * b_mib) / 1e3 + k.context_bytes / link
    base_s = k.baseline_io_ms_per_mib * b_mib / 1e3 + inp.buffer_bytes / link
    out = {
        "inputs": {**inp.__dict__, "tokens_per_s_used": inp.rate},
        "constants": {**{k_: v for k_, v in k.__dict__.items() if k_ != "sources"}, "goodput_mbit": link * 8 / 1e6},
        "sources": k.sources,
        "training_s": training_s,
        "transmissions": n,
        "travelling": _method(n * travel_s, training_s, n * k.context_bytes, travel_s, n),
        "baseline": _method(n * base_s, training_s, moved, base_s, n),
        "saved_per_transmission_s": base_s - travel_s,
        "saved_s": n * (base_s - travel_s),
    }
    if inp.model_bytes:
        rounds = inp.fl_rounds
        fl_s = rounds * 2 * inp.model_bytes / link  # the holders' links in parallel
        out["fl"] = {**_method(fl_s, training_s, 2 * inp.model_bytes * inp.holders * rounds, None, rounds),
                     "model": "FedAvg-style: each round every holder receives and sends the model over its own "
                              "link; its local training needs a GPU at every holder and is not counted"}
    return out


def _method(tx_s: float, training_s: float, nbytes: float, per_s: float | None, count: int) -> dict:
    return {"transmission_s": tx_s, "share": tx_s / (training_s + tx_s), "bytes_over_link": nbytes,
            "per_transmission_s": per_s, "count": count}


#: GPT-2 small (124M parameters, llm.c), fp32 weights.
GPT2_124M_BYTES = 124_439_808 * 4
#: Table 2: one 512 MiB buffer of uint16 tokens per about 1230 s of llm.c training on the H100.
PAPER_TOKENS_PER_S = TABLE_2_BUFFER_MIB * MIB / 2 / TABLE_2[500.0][0]
#: The talk's worked example: "Save 7 seconds per 256 MiB transmission; Fineweb is 44 TiB in
#: size; 1261568 s (14+ days) for the entire dataset" (the paper's slides, llm.c with GPT-2).
WORKED_EXAMPLE = {"saved_per_transmission_s": 7.0, "saved_s": 1_261_568.0, "dataset_bytes": 44 * TIB,
                  "buffer_bytes": 256 * MIB}


def worked_example_input(**changes) -> PlanInput:
    """The slides name no link: at Table 2's 500 Mbit/s, 256 MiB buffers save about their 7 s each."""
    inp = PlanInput(dataset_bytes=WORKED_EXAMPLE["dataset_bytes"], holders=1, buffer_bytes=WORKED_EXAMPLE["buffer_bytes"],
                    bandwidth_mbit=500.0, hardware=PAPER_H100, tokens_per_s=PAPER_TOKENS_PER_S,
                    model_bytes=GPT2_124M_BYTES)
    return replace(inp, **changes)


def against_worked_example(prediction: dict) -> dict:
    return {key: {"ours": prediction[key], "paper": WORKED_EXAMPLE[key], "ratio": prediction[key] / WORKED_EXAMPLE[key]}
            for key in ("saved_per_transmission_s", "saved_s")}


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str, what: str) -> int:
    """'44TiB', '256 MiB', '1.5GB' -> bytes (a unit is required: MB and MiB differ by 5 %)."""
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not value > 0 or not math.isfinite(value * _UNITS.get(unit, 1)):
        raise BadInput(f"{what} must be a positive size with a unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), "
                       f"e.g. 44TiB or 256MiB; got {text!r}")
    return int(value * _UNITS[unit])


def parse_bandwidth(text: str) -> float | None:
    if text.strip().lower() == "uncapped":
        return None
    try:
        return float(text)
    except ValueError:
        raise BadInput(f"--bandwidth is Mbit/s or 'uncapped', got {text!r}") from None


def fmt_duration(s: float) -> str:
    for unit, span in (("years", 365 * 86400), ("days", 86400), ("h", 3600), ("min", 60), ("s", 1)):
        if s >= span:
            return f"{s / span:,.1f} {unit}"
    return f"{s * 1e3:.1f} ms"


def fmt_bytes(n: float) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n >= _UNITS[unit.lower()]:
            return f"{n / _UNITS[unit.lower()]:,.1f} {unit}"
    return f"{n:.0f} B"
