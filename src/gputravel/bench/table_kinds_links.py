"""Kinds of table over capped links and training: `bench compare` (the paper's Figure 6 grid),
the demo's training report, `bench scale`, and a generic kind for any JSON with a list of
rows. `bench train` and `bench fl-sweep` are in table_kinds_train.py, the comparisons with the
paper in table_kinds_paper.py. See table_kinds.py for how a kind is written."""

from __future__ import annotations

import statistics

from gputravel.bench.compare import fmt_ms, fmt_speedup
from gputravel.bench.table_kinds import STEP_NAMES, Source, Table, link_label, num, pct
from gputravel.errors import BadInput


# ----------------------------------------------------------------------------- bench compare
def _grid(src: Source, cell_text) -> Table:
    """Sizes down, bandwidths across, in the order the run measured them."""
    cells = src.data["cells"]
    bws = list(dict.fromkeys(c["bandwidth_mbit"] for c in cells))
    sizes = sorted({c["size_mib"] for c in cells})
    at = {(c["size_mib"], c["bandwidth_mbit"]): c for c in cells}
    body = tuple((str(s), *(cell_text(at[s, bw]) if (s, bw) in at else "-" for bw in bws)) for s in sizes)
    return Table(("MiB", *(link_label(bw) for bw in bws)), body, "r")


def _mark(cell: dict) -> str:
    """~: the baseline was not run at this cell but extrapolated linearly in size."""
    return "~" if cell.get("extrapolated") else ""


def compare_time(src: Source) -> Table:
    """`bench compare`: time per transmission, travel / baseline."""
    return _grid(src, lambda c: f"{fmt_ms(c['travel_ms'])} / {_mark(c)}{fmt_ms(c['baseline_ms'])}")


def compare_speedup(src: Source) -> Table:
    """`bench compare`: speedup (baseline / travel), with the paper's estimate in parentheses."""
    def text(c: dict) -> str:
        paper = c.get("paper_speedup_estimate")
        return f"{_mark(c)}{fmt_speedup(c['speedup'])}" + ("" if paper is None else f" ({fmt_speedup(paper)})")
    return _grid(src, text)


def compare_targets(src: Source) -> Table:
    """`bench compare`: the issue's targets over the whole grid."""
    cells = src.data["cells"]
    judged = [c for c in cells if c.get("paper_speedup_estimate") is not None]
    ahead = [c for c in judged if c["speedup"] >= c["paper_speedup_estimate"]]
    low = min(judged, key=lambda c: c["speedup"] / c["paper_speedup_estimate"], default=None)
    margin = "-" if low is None else (f"lowest margin: {low['size_mib']} MiB at {link_label(low['bandwidth_mbit'])}, "
                                      f"{fmt_speedup(low['speedup'])} vs {fmt_speedup(low['paper_speedup_estimate'])}")
    slower = [c for c in cells if c["speedup"] < 1]
    where = ", ".join(f"{c['size_mib']} MiB at {link_label(c['bandwidth_mbit'])}" for c in slower)
    ratios = [c["rate_agreement"]["ratio"] for c in cells if c.get("rate_agreement")]
    body = [("travelling at least as fast as the paper's estimated speedup, every cell",
             f"{len(ahead)} of {len(judged)} cells ({margin})",
             "yes" if judged and len(ahead) == len(judged) else "no"),
            ("baseline faster than travelling (the tie-break)", where or "in no cell of the grid", "-")]
    if ratios:
        body.append(("baseline's TLS time within 15 % of size/cap, measured capped cells",
                     f"{num(min(ratios), 3)} to {num(max(ratios), 3)} ({len(ratios)} cells)",
                     "yes" if all(abs(r - 1) <= 0.15 for r in ratios) else "no"))
    return Table(("target", "measured", "met?"), tuple(body))


# ----------------------------------------------------------------------------- gputravel demo
def demo(src: Source) -> Table:
    """A training run's report.json (`gputravel demo`): wall time, travels, data stall, loss."""
    d = src.data
    cfg = d["config"]
    tokens = d["travels"][0]["tokens"] if d.get("travels") else 0
    batches = max(tokens - 1, 0) // (cfg["batch"] * cfg["seq_len"])  # a batch reads B*T+1 tokens (train/loader.py)
    body = (("training wall time (first step to last)", f"{num(d['wall_s'], 1)} s"),
            ("travels", f"{d['travel_count']} (each brings {tokens:,} tokens = {batches} batches)"),
            ("time the loop waited for travels (data stall)", f"**{pct(d['stall_share'], 2)}** of wall time "
             f"(target at most 1%: {'met' if d['stall_share'] <= 0.01 else 'missed'})"),
            ("loss, mean of first / last 10 steps", f"{num(d['loss_before'], 3)} -> {num(d['loss_after'], 3)}"))
    return Table(("measure", "value"), body)


def demo_steps(src: Source) -> Table:
    """A training run's report.json: the median of its travels, per step (shares of the critical
    path, as in `bench travel`), and the median total."""
    d = src.data
    steps = d["travel_median_steps_ms"]
    total = statistics.median(t["total_ms"] for t in d["travels"])
    names = [s for s in STEP_NAMES if s in steps] + [s for s in steps if s not in STEP_NAMES]
    return Table((*(STEP_NAMES.get(s, s) for s in names), "total"),
                 ((*(num(steps[s]) for s in names), num(total)),), "r")


# ----------------------------------------------------------------------------- bench scale
def scale(src: Source) -> Table:
    """`bench scale`: per cohort size, the travel's median and p90, its fixed part, the boot and
    the resident memory per holder process; x = median over the smallest cohort's median. Where
    the run has them: the control (travels to one holder of the same cohort, in alternating
    blocks), round robin over it, and the 1-minute load when the row started."""
    rows = sorted(src.data["rows"], key=lambda r: r["holders"])
    base = rows[0]["median_ms"]
    control = all(r.get("same_holder_median_ms") for r in rows)
    load = all(r.get("loadavg") for r in rows)
    body = tuple((str(r["holders"]), num(r["median_ms"]), num(r.get("p90_ms")), num(r.get("fixed_ms")),
                  num(r.get("boot_s")), num(r.get("rss_mib"), 1), num(r["median_ms"] / base),
                  *((num(r["same_holder_median_ms"]), num(r["median_ms"] / r["same_holder_median_ms"])) if control else ()),
                  *((num(r["loadavg"][0], 1),) if load else ()))
                 for r in rows)
    header = ("holders", "median travel ms", "p90 ms", "fixed ms", "boot s", "RSS MiB per holder",
              f"median x {rows[0]['holders']} holder(s)", *(("one holder (control) ms", "round robin / control")
                                                           if control else ()), *(("load at start",) if load else ()))
    return Table(header, body, "r")


def scale_buffers(src: Source) -> Table:
    """`bench scale` runs at several buffer sizes (a glob, one file each): per buffer, the
    smallest and largest cohorts' medians and fixed parts, their ratio and their difference,
    which is the cold-holder cost when it stays the same whatever the copy."""
    body = []
    files = sorted((data for _, data in src.files), key=lambda d: d["buffer_mib"])
    for data in files:
        rows = sorted(data["rows"], key=lambda r: r["holders"])
        one, many = rows[0], rows[-1]
        body.append((str(data["buffer_mib"]), num(one["median_ms"]), num(many["median_ms"]),
                     f"**{num(many['median_ms'] / one['median_ms'])}**", num(many["median_ms"] - one["median_ms"]),
                     num(one["fixed_ms"]), num(many["fixed_ms"])))
    counts = sorted(r["holders"] for r in files[0]["rows"])
    a, b = counts[0], counts[-1]
    return Table(("buffer MiB", f"{a} holder(s) ms", f"{b} holders ms", f"{b} / {a}", "difference ms",
                  f"fixed ms, {a}", f"fixed ms, {b}"), tuple(body), "r")


# ----------------------------------------------------------------------------- generic
def generic(src: Source) -> Table:
    """Any JSON with a list of records: ``cols=a,b.c`` (dotted paths into each record),
    ``headers=A,B`` (default: the paths), ``list=rows`` (the list's key), ``digits=2`` (or
    one per column: ``digits=0,3``) for the decimals of floats."""
    cols = [c for c in src.option("cols", "").split(",") if c]
    if not cols:
        raise BadInput("a generic table needs cols=field,field.sub,...")
    headers = [h for h in src.option("headers", "").split(",") if h] or cols
    if len(headers) != len(cols):
        raise BadInput("headers= must name as many columns as cols=")
    digits = _digits(src.option("digits", "2"), len(cols))
    records = src.data.get(src.option("list", "rows"))
    if not isinstance(records, list):
        raise BadInput(f"the file has no list {src.option('list', 'rows')!r}")
    return Table(tuple(headers), tuple(tuple(_cell(_dig(r, c), d) for c, d in zip(cols, digits)) for r in records))


def _digits(text: str, n: int) -> list[int]:
    try:
        digits = [int(d) for d in text.split(",")]
    except ValueError:
        raise BadInput(f"digits= takes whole numbers, not {text!r}") from None
    if len(digits) not in (1, n):
        raise BadInput("digits= gives one number, or one per column")
    return digits * n if len(digits) == 1 else digits


def _dig(record: dict, path: str) -> object:
    for key in path.split("."):
        if not isinstance(record, dict) or key not in record:
            return None
        record = record[key]
    return record


def _cell(value: object, digits: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return num(value, digits)
    return str(value)
