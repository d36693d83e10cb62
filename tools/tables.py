"""The tables of docs/benchmarks.md, written by cog (the `cogapp` package, the `dev` extra) from
the JSON behind them in docs/results/, so a table and its data cannot drift apart.

Each table is a cog block calling one function here with its data, relative to the document
(a glob may hold one ``*``: its files are grouped by what ``*`` matched, less a trailing run
number, which orders the runs of a group)::

    <!-- [[[cog t.travel("results/bench-travel-2026-11-24.json") ]]] -->
    (the table, then a line naming its data: written by cog)
    <!-- [[[end]]] -->

``cog -r docs/benchmarks.md`` rewrites every table; ``cog --check docs/benchmarks.md`` (run by
tests/test_results_tables.py) fails when one differs from its data. ``plot=`` adds a link to a
figure. A function reads only the fields it needs, so a benchmark may add fields freely.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

STEPS = {"o_cleanup": "scrub", "o_export": "O export", "dh_switch": "switch to H", "dh_import": "H import",
         "dh_copy": "H copy", "dh_export": "H export", "tls": "TLS", "o_switch": "switch to O",
         "o_import": "O import", "o_rotate": "O rotate"}  # the paper's names (Table 1)
PAPER_STEPS = ("o_cleanup", "dh_switch", "dh_copy", "tls", "o_switch")  # beside the paper's, in its order
CONTEXT_STEPS = ("dh_import", "dh_export", "o_import", "o_rotate")  # ours only


# ----------------------------------------------------------------------------- shared
def num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x * 100:.{digits}f} %"


def link(bw: float | None) -> str:
    return "uncapped" if bw is None else f"{bw:g} Mbit/s"


def ms(x: float) -> str:
    return f"{x:.1f} ms" if x < 1000 else f"{x / 1e3:.1f} s"


def speed(x: float) -> str:
    return f"{x:.2f}x" if x < 10 else f"{x:,.0f}x"


def yes(ok: bool | None, no: str = "NO") -> str:
    return "-" if ok is None else ("yes" if ok else no)


def load(source: str) -> list[tuple[dict, str, int | None]]:
    """Each file of the source: its JSON, the group its * matched and its run number."""
    import cog  # cog's module of the run under way (a fresh one per run)

    base = Path(cog.inFile).resolve().parent
    natural = lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]  # noqa: E731
    paths = sorted(base.glob(source), key=natural) if "*" in source else [base / source]
    if not paths or not all(p.is_file() for p in paths):
        raise FileNotFoundError(f"no data file at {source} (relative to {base})")
    head, _, tail = source.partition("*")
    out = []
    for p in paths:
        star = p.relative_to(base).as_posix()[len(head): -len(tail) or None] if "*" in source else ""
        m = re.fullmatch(r"(.*?)-?(\d+)", star)
        out.append((json.loads(p.read_text()), *((m[1], int(m[2])) if m else (star, None))))
    return out


def profile(d: dict) -> str:
    """The hardware profile a run stood for; a file without the block predates them: emulated."""
    hw = d.get("hardware")
    return str(hw.get("profile") or hw.get("name") or "emulated") if isinstance(hw, dict) else str(hw or "emulated")


def data_line(source: str, datas: list[dict]) -> str:
    """Where the table comes from, with the facts its files record about their runs."""
    where = f"Data: [{source}]({source})" if len(datas) == 1 else f"Data: the {len(datas)} files `{source}`"
    facts = []
    for key in ("command", "machine", "link"):
        values = list(dict.fromkeys(str(d[key]) for d in datas if d.get(key)))
        if values:
            facts.append(f"{key} {values[0]}" + (f" (and {len(values) - 1} other)" if len(values) > 1 else ""))
    dates = sorted(re.sub(r"^(\d{4}-\d\d-\d\d)T(\d\d:\d\d).*", r"\1 \2 UTC", d["date"])
                   for d in datas if d.get("date"))
    if dates:
        first, last = dates[0], dates[-1]
        facts.append(first if first == last else f"{first.removesuffix(' UTC')} to {last[11:]}"
                     if first[:10] == last[:10] else f"{first} to {last}")
    if any(d.get("hardware") for d in datas):  # a file without it ran emulated: said beside one naming it
        facts.append("hardware profile " + ", ".join(dict.fromkeys(profile(d) for d in datas)))
    return where + ("; " + "; ".join(facts) if facts else "") + "."


def table(align: str = "l", many: bool = False):
    """Make ``fn(data or files, **options) -> (header, rows)`` a cog block's function
    ``fn(source, plot=None, **options)``: it writes the table (``align="r"``: numbers right
    of the first column), the data line and the figure's link."""
    def wrap(fn):
        def block(source: str, *args, plot: str | None = None, **kw) -> None:
            import cog

            files = load(source)
            if not many and len(files) != 1:
                raise ValueError(f"{fn.__name__} takes one file, {source} matched {len(files)}")
            header, rows = fn(files if many else files[0][0], *args, **kw)
            rule = ["---"] + [("---:" if align == "r" else "---")] * (len(header) - 1)
            md = "\n".join("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
                           for cells in (header, rule, *rows))
            lines = ["", md, "", data_line(source, [d for d, _, _ in files])]
            cog.out("\n".join(lines + ([f"Figure: [{plot}]({plot})."] if plot else [])) + "\n")
        block.__doc__ = fn.__doc__
        return block
    return wrap


def _groups(files: list, labels: dict[str, str]) -> dict[str, list[tuple[int, dict]]]:
    """The files of each labelled group, by run number, in the labels' order."""
    return {g: sorted([(run or 0, d) for d, grp, run in files if grp == g], key=lambda f: f[0]) for g in labels}


# ----------------------------------------------------------------------------- bench travel
@table("r")
def travel(d):
    """Per-step medians per buffer size (paper Table 1)."""
    steps = list(d["rows"][0]["steps_ms"])
    return (("MiB", *(STEPS.get(s, s) for s in steps), "total", "fixed", "copy GB/s"),
            [(str(r["size_mib"]), *(num(r["steps_ms"][s]) for s in steps), num(r["total_ms"]), num(r["fixed_ms"]),
              num(r["copy_gbps"])) for r in d["rows"]])


def _limit(d: dict) -> tuple[float, str]:
    """The copy's limit: the two-core pipeline where the run measured it."""
    if d.get("pipeline_limit_gbps"):
        return d["pipeline_limit_gbps"], "two-core pipeline limit"
    return d["crypto_limit_gbps"], "crypto limit"


@table()
def travel_targets(d, size=None):
    """The targets at the largest size (or ``size``): copy against the limit, fixed, scrub share."""
    r = d["rows"][-1] if size is None else next(r for r in d["rows"] if r["size_mib"] == size)
    limit, name = _limit(d)
    ratio, scrub, copy = r["copy_gbps"] / limit, r["steps_ms"]["o_cleanup"], r["steps_ms"]["dh_copy"]
    rows = [(f"copy throughput >= 0.8 x {name}", f"{num(r['copy_gbps'])} GB/s = **{num(ratio)} x** {num(limit)} GB/s",
             yes(ratio >= 0.8, "no"))]
    if name != "crypto limit":
        rows.append(("(for reference) copy against the one-core crypto limit",
                     f"{num(r['copy_gbps'] / d['crypto_limit_gbps'])} x {num(d['crypto_limit_gbps'])} GB/s", "-"))
    return (f"target ({r['size_mib']} MiB)", "measured", "met?"), rows + [
        ("fixed overhead <= 3 ms", f"**{num(r['fixed_ms'])} ms**", yes(r["fixed_ms"] <= 3, "no")),
        ("scrub <= 10% of the copy", f"{num(scrub)} / {num(copy)} = **{pct(scrub / copy)}**",
         yes(scrub <= 0.1 * copy, "no"))]


@table("r", many=True)
def ab_travel(files, labels, each=False):
    """A/B of `bench travel` runs at their largest size: per group (``labels``: group -> label)
    the medians of its runs (ratios taken within each run), or with ``each`` one row per run."""
    piped = all(d.get("pipeline_limit_gbps") for d, _, _ in files)

    def measures(d):
        r = d["rows"][-1]
        return [d["crypto_limit_gbps"], *([d["pipeline_limit_gbps"]] if piped else []), r["copy_gbps"],
                r["copy_gbps"] / _limit(d)[0], r["fixed_ms"], r["steps_ms"]["o_cleanup"] / r["steps_ms"]["dh_copy"],
                r["total_ms"]]
    groups = _groups(files, labels)
    if each:
        body = [(f"{labels[g]}, {n}", measures(d)) for n in sorted({n for g in groups.values() for n, _ in g})
                for g in labels for run, d in groups[g] if run == n]
    else:
        body = [(labels[g], [statistics.median(c) for c in zip(*(measures(d) for _, d in groups[g]), strict=True)])
                for g in labels]
    header = ("code", "crypto limit GB/s", *(("pipeline limit GB/s",) if piped else ()), "copy GB/s", "copy / limit",
              "fixed overhead ms", "scrub share of the copy", "travel total ms")
    return header, [(label, *map(num, v[:-3]), num(v[-3]), pct(v[-2]), num(v[-1], 1)) for label, v in body]


@table("r", many=True)
def ab_codec(files, labels):
    """A/B of `bench codec` runs, two groups: per message bytes and median µs, A / B."""
    keys = ("bytes", "encode_us", "decode_us", "round_trip_us")
    med = [{r["message"]: {k: statistics.median(x[k] for _, d in grp for x in d["rows"] if x["message"] == r["message"])
                           for k in keys} for r in grp[0][1]["rows"]} for grp in _groups(files, labels).values()]
    (la, lb), (a, b) = labels.values(), med
    return (("message", f"bytes {la} / {lb}", *(f"{k} µs {la} / {lb}" for k in ("encode", "decode", "round trip"))),
            [(m, f"{a[m]['bytes']:.0f} / {b[m]['bytes']:.0f}", *(f"{num(a[m][k])} / {num(b[m][k])}" for k in keys[1:]))
             for m in a if m in b])


@table("r")
def travel_paper(d):
    """Per size, the steps the paper times too, ours (the paper's); the context steps (ours
    only); the totals and their ratio."""
    rows = []
    for r in d["rows"]:
        steps, theirs = r["steps_ms"], r["paper"]["steps_ms"]
        rows.append((str(r["size_mib"]), *(num(steps[s]) + ("" if theirs.get(s) is None else f" ({num(theirs[s])})")
                                          for s in PAPER_STEPS), num(sum(steps[s] for s in CONTEXT_STEPS)),
                     num(r["total_ms"], 1), num(r["paper"]["total_ms"], 1),
                     num(r["total_ms"] / r["paper"]["total_ms"])))
    return ("MiB", *(STEPS[s] for s in PAPER_STEPS), "context steps", "total", "paper total", "ours / paper"), rows


# ----------------------------------------------------------------------------- bench ddp, demo, scale
@table("r")
def ddp(d):
    """Iteration and all-reduce medians, x = encrypted / plain (none for one GPU's all-reduce); where
    the run measured it (issue 31), the all-reduce's limit and each sealed variant over it."""
    rows, limited = [], all("allreduce_limit_ms" in r for r in d["rows"])
    for r in d["rows"]:
        it, ar = r["iter_ms"], r["allreduce_ms"]
        kinds = ("plain", "encrypted_naive", "encrypted")
        model = r["model"] + (f" ({r['compress']})" if r.get("compress") else "")  # gradients sent compressed
        cells = [str(r["gpus"]), model, *(num(it[k], 1) for k in kinds), num(it["encrypted"] / it["plain"]),
                 *(num(ar[k]) for k in kinds), "-" if r["gpus"] == 1 else num(ar["encrypted"] / ar["plain"])]
        if limited:
            over = r["allreduce_vs_limit"]
            cells += [num(r["aes_gbps_per_core"]), num(r["allreduce_limit_ms"]),
                      *(("-" if r["gpus"] == 1 else num(over[k])) for k in kinds[1:])]
        rows.append(tuple(cells))
    header = ("GPUs", "model", "iteration plain", "naive", "encrypted", "x", "all-reduce plain", "naive", "encrypted",
              "x")
    return header + (("AES GB/s a core", "limit", "naive / limit", "encrypted / limit") if limited else ()), rows


@table("r", many=True)
def ddp_where(files):
    """Interleaved `bench ddp` runs (issue 31), a row per run and GPU count past one: each
    all-reduce's median (gloo's with its 10th-90th percentiles), the limit and each sealed ring
    over it, the training iteration's ratio; then the CPU every rank spent on one all-reduce,
    summed, against the AES the run's rate accounts for (the limit less the plain all-reduce,
    times the cores the ranks share)."""
    rows = []
    for d, _, run in sorted(files, key=lambda f: f[2] or 0):
        for r in (r for r in d["rows"] if r["gpus"] > 1):
            ar, cpu, over = r["allreduce_ms"], r["allreduce_cpu_ms"], r["allreduce_vs_limit"]
            lo, hi = r["allreduce_spread_ms"]["plain"]
            aes = (r["allreduce_limit_ms"] - ar["plain"]) * min(r["gpus"], d["cores"])
            rows.append((
                str(run or 1), str(r["gpus"]), f"{num(ar['plain'], 1)} ({num(lo, 1)}-{num(hi, 1)})",
                *(num(ar[k], 1) for k in ("ring_unsealed", "encrypted_naive", "encrypted")),
                num(r["allreduce_limit_ms"], 1), num(over["encrypted_naive"]), num(over["encrypted"]),
                num(r["iter_ms"]["encrypted"] / r["iter_ms"]["plain"]),
                *(num(cpu[k], 1) for k in ("plain", "ring_unsealed", "encrypted_naive")), num(aes, 1),
                num(cpu["encrypted_naive"] - cpu["ring_unsealed"], 1)))
    return ("run", "GPUs", "gloo (p10-p90)", "ring unsealed", "naive", "pipelined", "limit", "naive / limit",
            "pipelined / limit", "iteration pipelined / plain", "CPU gloo", "CPU unsealed", "CPU naive",
            "AES at the rate", "CPU sealing"), rows


@table()
def demo(d):
    """A training run's report.json: wall time, travels, data stall, loss."""
    cfg, tokens = d["config"], d["travels"][0]["tokens"] if d.get("travels") else 0
    batches = max(tokens - 1, 0) // (cfg["batch"] * cfg["seq_len"])  # a batch reads B*T+1 tokens
    return ("measure", "value"), [
        ("training wall time (first step to last)", f"{num(d['wall_s'], 1)} s"),
        ("travels", f"{d['travel_count']} (each brings {tokens:,} tokens = {batches} batches)"),
        ("time the loop waited for travels (data stall)", (f"**{pct(d['stall_share'], 2)}** of wall time "
                                                            f"(target at most 1%: "
                                                            f"{'met' if d['stall_share'] <= 0.01 else 'missed'})")),
        ("loss, mean of first / last 10 steps", f"{num(d['loss_before'], 3)} -> {num(d['loss_after'], 3)}")]


@table("r")
def demo_steps(d):
    """A training run's report.json: its travels' median per step, and the median total."""
    steps = d["travel_median_steps_ms"]
    names = [s for s in STEPS if s in steps] + [s for s in steps if s not in STEPS]
    return ((*(STEPS.get(s, s) for s in names), "total"),
            [(*(num(steps[s]) for s in names), num(statistics.median(t["total_ms"] for t in d["travels"])))])


@table("r")
def scale(d):
    """Per cohort size: the travel's median, p90, fixed part, boot, RSS per holder, x the smallest
    cohort's median; where the run has them the control (one holder of the same cohort) and the load."""
    rows = sorted(d["rows"], key=lambda r: r["holders"])
    control, load = all(r.get("same_holder_median_ms") for r in rows), all(r.get("loadavg") for r in rows)
    return (("holders", "median travel ms", "p90 ms", "fixed ms", "boot s", "RSS MiB per holder",
             f"median x {rows[0]['holders']} holder(s)", *(("one holder (control) ms", "round robin / control")
                                                          if control else ()), *(("load at start",) if load else ())),
            [(str(r["holders"]), num(r["median_ms"]), *(num(r.get(k)) for k in ("p90_ms", "fixed_ms", "boot_s")),
              num(r.get("rss_mib"), 1), num(r["median_ms"] / rows[0]["median_ms"]),
              *((num(r["same_holder_median_ms"]), num(r["median_ms"] / r["same_holder_median_ms"])) if control else ()),
              *((num(r["loadavg"][0], 1),) if load else ())) for r in rows])


@table("r", many=True)
def scale_buffers(files):
    """`bench scale` at several buffer sizes: per buffer the smallest and largest cohorts' medians
    and fixed parts, their ratio and difference (the cold-holder cost, if the same for any copy)."""
    rows, datas = [], sorted((d for d, _, _ in files), key=lambda d: d["buffer_mib"])
    for d in datas:
        by_size = sorted(d["rows"], key=lambda r: r["holders"])
        one, many = by_size[0], by_size[-1]
        rows.append((str(d["buffer_mib"]), num(one["median_ms"]), num(many["median_ms"]),
                     f"**{num(many['median_ms'] / one['median_ms'])}**", num(many["median_ms"] - one["median_ms"]),
                     num(one["fixed_ms"]), num(many["fixed_ms"])))
    a, b = min(r["holders"] for r in datas[0]["rows"]), max(r["holders"] for r in datas[0]["rows"])
    return ("buffer MiB", f"{a} holder(s) ms", f"{b} holders ms", f"{b} / {a}", "difference ms", f"fixed ms, {a}",
            f"fixed ms, {b}"), rows


@table()
def generic(d, key, cols):
    """Any list of records ``d[key]``; ``cols``: (field, header, decimals of a float) each."""
    def cell(v, digits):
        return "-" if v is None else yes(v, "no") if isinstance(v, bool) else \
            num(v, digits) if isinstance(v, float) else str(v)
    return tuple(h for _, h, _ in cols), [tuple(cell(r.get(f), n) for f, _, n in cols) for r in d[key]]


# ----------------------------------------------------------------------------- bench compare
def _grid(d, text):
    """Sizes down, bandwidths across in the order the run measured them."""
    at = {(c["size_mib"], c["bandwidth_mbit"]): c for c in d["cells"]}
    bws = list(dict.fromkeys(bw for _, bw in at))
    return (("MiB", *map(link, bws)),
            [(str(s), *(text(at[s, bw]) if (s, bw) in at else "-" for bw in bws)) for s in sorted({s for s, _ in at})])


def _x(c: dict) -> str:
    return "~" if c.get("extrapolated") else ""  # the baseline was extrapolated linearly in size, not run


@table("r")
def compare_time(d):
    """Time per transmission, travel / baseline."""
    return _grid(d, lambda c: f"{ms(c['travel_ms'])} / {_x(c)}{ms(c['baseline_ms'])}")


@table("r")
def compare_speedup(d):
    """Speedup (baseline / travel), the paper's estimate in parentheses."""
    return _grid(d, lambda c: _x(c) + speed(c["speedup"]) + ("" if c.get("paper_speedup_estimate") is None
                                                            else f" ({speed(c['paper_speedup_estimate'])})"))


@table()
def compare_targets(d):
    """The issue's targets over the whole grid."""
    cells = d["cells"]
    judged = [c for c in cells if c.get("paper_speedup_estimate") is not None]
    ahead = [c for c in judged if c["speedup"] >= c["paper_speedup_estimate"]]
    low = min(judged, key=lambda c: c["speedup"] / c["paper_speedup_estimate"])
    where = ", ".join(f"{c['size_mib']} MiB at {link(c['bandwidth_mbit'])}" for c in cells if c["speedup"] < 1)
    ratios = [c["rate_agreement"]["ratio"] for c in cells if c.get("rate_agreement")]
    rows = [("travelling at least as fast as the paper's estimated speedup, every cell",
             (f"{len(ahead)} of {len(judged)} cells (lowest margin: {low['size_mib']} MiB at "
              f"{link(low['bandwidth_mbit'])}, {speed(low['speedup'])} vs {speed(low['paper_speedup_estimate'])})"),
             yes(len(ahead) == len(judged), "no")),
            ("baseline faster than travelling (the tie-break)", where or "in no cell of the grid", "-")]
    if ratios:
        rows.append(("baseline's TLS time within 15 % of size/cap, measured capped cells",
                     f"{num(min(ratios), 3)} to {num(max(ratios), 3)} ({len(ratios)} cells)",
                     yes(all(abs(r - 1) <= 0.15 for r in ratios), "no")))
    return ("target", "measured", "met?"), rows


@table("r", many=True)
def compare_profiles(files):
    """One file per hardware profile: speedup per cell, emulated / **the others**, the paper's
    estimate in parentheses; only the cells every file measured."""
    files = sorted(((profile(d), d) for d, _, _ in files), key=lambda f: f[0] != "emulated")
    at = [{(c["size_mib"], c["bandwidth_mbit"]): c for c in d["cells"]} for _, d in files]
    common = [k for k in at[0] if all(k in a for a in at[1:])]

    def text(key):
        shown = [_x(a[key]) + speed(a[key]["speedup"]) for a in at]
        shown = [s if i == 0 and files[0][0] == "emulated" else f"**{s}**" for i, s in enumerate(shown)]
        paper = at[-1][key].get("paper_speedup_estimate")
        return " / ".join(shown) + ("" if paper is None else f" ({speed(paper)})")
    bws = list(dict.fromkeys(bw for _, bw in common))
    return (("MiB", *map(link, bws)), [(str(s), *(text((s, bw)) if (s, bw) in common else "-" for bw in bws))
                                       for s in sorted({s for s, _ in common})])


def _span(values) -> str:
    v = [num(x) for x in sorted(values)]
    return "-" if not v else f"{v[0]}x" if v[0] == v[-1] else f"{v[0]}-{v[-1]}x"


@table("r")
def compare_paper(d):
    """Per link, the range over the sizes of our travel, baseline and speedup over the paper's,
    and our baseline's TLS time / (size/cap) where measured."""
    rows = []
    for bw in dict.fromkeys(c["bandwidth_mbit"] for c in d["cells"]):
        at = [c for c in d["cells"] if c["bandwidth_mbit"] == bw]
        run = [c for c in at if not c.get("extrapolated")]
        rows.append((link(bw), _span(c["paper"]["travel_ms_ratio"] for c in at),
                     _span(c["paper"]["baseline_ms_ratio"] for c in run) + f" ({len(run)} of {len(at)})",
                     _span(c["paper"]["speedup_ratio"] for c in at),
                     _span(c["rate_agreement"]["ratio"] for c in at if c.get("rate_agreement"))))
    return ("link", "our travel / paper's", "our baseline / paper's (measured cells)", "our speedup / paper's",
            "our baseline's TLS / (size/cap)"), rows


@table("r")
def compare_tie_break(d):
    """Per link, where the baseline was faster, from which size travelling was, and where the two
    cross (both times fitted linearly) if the run estimated it."""
    est = {e["bandwidth_mbit"]: e["size_mib"] for e in d.get("tie_break_estimates", [])}
    return ("link", "baseline faster at (MiB)", "travelling faster from (MiB)", "estimated crossing (MiB)"), [
        (link(t["bandwidth_mbit"]), ", ".join(map(str, t["baseline_faster_at_mib"])) or "none",
         "-" if t.get("travel_faster_from_mib") is None else str(t["travel_faster_from_mib"]),
         "-" if (e := est.get(t["bandwidth_mbit"])) is None else num(e) if e < 10 else f"{e:.0f}")
        for t in d["tie_breaks"]]


@table("r")
def compare_table2(d):
    """The paper's Table 2 from the run's 512 MiB cells, the paper's figures beside."""
    return ("link", "baseline Tx (s)", "share", "paper", "paper share", "ours Tx (s)", "share", "paper",
            "paper share"), [
        (link(r["bandwidth_mbit"]), _x(r) + num(r["baseline_tx_s"]), pct(r["baseline_share"], 3),
         num(r["paper"]["baseline_tx_s"]), pct(r["paper"]["baseline_share"], 3), num(r["ours_tx_s"], 3),
         pct(r["ours_share"], 3), num(r["paper"]["ours_tx_s"]), pct(r["paper"]["ours_share"], 3)) for r in d["table_2"]]


@table(many=True)
def plan_worked_example(files):
    """`gputravel plan --worked-example --json` files: the slides' figures, then one row per file."""
    def paper(p):
        return str(p.get("sources", {}).get("travel", "")).startswith("the paper")
    plans = sorted((d for d, _, _ in files), key=lambda d: (not paper(d), d["inputs"]["bandwidth_mbit"] is None))
    days = lambda s: f"{s:,.0f} s ({s / 86400:.1f} days)"  # noqa: E731
    slides = plans[0]["worked_example"]
    return ("figures", "link", "buffer", "saved per transmission (s)", "saved in all", "/ the slides'"), [
        ("the paper's slides", "-", "-", num(slides["saved_per_transmission_s"]["paper"]),
         days(slides["saved_s"]["paper"]), "1.00")] + [
        ("plan, " + ("the paper's figures" if paper(p) else f"measured here ({p['inputs']['hardware']} JSONs)"),
         link(p["inputs"]["bandwidth_mbit"]), f"{p['inputs']['buffer_bytes'] / (1 << 20):g} MiB",
         num(ex["saved_per_transmission_s"]["ours"]), days(ex["saved_s"]["ours"]), num(ex["saved_s"]["ratio"]))
        for p in plans for ex in [p["worked_example"]]]


# ----------------------------------------------------------------------------- bench train, fl-sweep
def runs(d: dict) -> dict:
    """{link: ({method: record}, same_losses)} from either format of `bench train`: the first had
    a row per link with a record per method (travelling, baseline), the present one a row per
    method (travel, tls, fl) and link, with same_losses in ``checks``."""
    out: dict = {}
    if d["rows"] and "method" not in d["rows"][0]:
        for r in d["rows"]:
            out[r["bandwidth_mbit"]] = ({{"travelling": "travel", "baseline": "tls"}.get(k, k): {**v, "paper": (
                r.get("paper") or {}).get(k)} for k, v in r.items() if isinstance(v, dict) and "tx_s" in v},
                r.get("same_losses"))
        return out
    checks = {c["bandwidth_mbit"]: c.get("same_losses") for c in d.get("checks", [])}
    for r in d["rows"]:
        out.setdefault(r["bandwidth_mbit"], ({}, checks.get(r["bandwidth_mbit"])))[0][r["method"]] = r
    return out


@table("r")
def train(d):
    """The paper's Table 2 for this system: the TLS baseline and travelling per link, the paper's
    shares beside."""
    rows = []
    for bw, (m, same) in runs(d).items():
        b, o = m["tls"], m["travel"]
        rows.append((link(bw), num(b["training_s"]), num(b["tx_s"], 3), pct(b["tx_share"], 3), num(o["training_s"]),
                     num(o["tx_s"], 3), pct(o["tx_share"], 3), pct((b.get("paper") or {}).get("tx_share"), 3),
                     pct((o.get("paper") or {}).get("tx_share"), 3), yes(same)))
    return ("link", "baseline training (s)", "baseline Tx (s)", "baseline Tx %", "ours training (s)", "ours Tx (s)",
            "ours Tx %", "paper baseline Tx %", "paper ours Tx %", "same losses"), rows


@table(many=True)
def train_methods(files):
    """One row per method and link: time, bytes over the links, holder compute, held-out loss,
    FL's rounds and framework; over repeated runs the last run's values, the range in brackets."""
    per_run = [runs(d) for d, _, run in sorted(files, key=lambda f: f[2] or 1)]
    rows = []
    for bw, (methods, _) in per_run[-1].items():
        checks = [r[bw][1] for r in per_run if bw in r]
        for m in [m for m in ("travel", "tls", "fl") if m in methods] + sorted(set(methods) - {"travel", "tls", "fl"}):
            recs = [r[bw][0][m] for r in per_run if bw in r and m in r[bw][0]]
            rec, g2 = recs[-1], "-"
            if m in ("travel", "tls") and any(c is not None for c in checks):
                g2 = yes(all(checks)) + (f" ({sum(map(bool, checks))} of {len(checks)} runs)" * (len(checks) > 1))
            rows.append(({"fl": "fl (FedAvg)"}.get(m, m), link(bw), _ranged(recs, "training_s", num),
                         _ranged(recs, "tx_s", lambda v: num(v, 3)), _ranged(recs, "bytes_over_link", "{:,}".format),
                         _ranged(recs, "holder_compute_s", lambda v: num(v, 1)),
                         _ranged(recs, "final_loss", lambda v: num(v, 4)),
                         str(rec.get("rounds") or "-"), str(rec.get("framework") or "-"), g2))
    return ("method", "link", "training (s)", "Tx (s)", "bytes over the links", "holder compute (s)",
            "final loss (held out)", "rounds", "framework", "same losses as the other (G2)"), rows


def _ranged(recs: list[dict], key: str, fmt) -> str:
    """The last run's value, and in brackets the range over all runs where they differ."""
    if recs[-1].get(key) is None:
        return "-"
    vs = [r[key] for r in recs if r.get(key) is not None]
    return fmt(recs[-1][key]) + (f" [{fmt(min(vs))}-{fmt(max(vs))}]" if len({*map(fmt, vs)}) > 1 else "")


@table()
def fl_rounds(d):
    """FedAvg's rounds (``round_log``): time, the holders sampled and replying, Flower's failures."""
    fl = next(r for r in d["rows"] if r.get("method") == "fl")["fl"]
    return ("round", "time (s)", "Tx (s)", "holders sampled", "replied", "failures (Flower's words)"), [
        (str(r["round"]), num(r["wall_s"], 1), num(r.get("tx_s"), 1), str(r["sampled"]), ", ".join(r["replied"]),
         "; ".join(f.get("reason", "?") for f in r.get("failures", [])) or "-") for r in fl["round_log"]]


@table("r")
def fl_sweep(d, field="bytes_over_link"):
    """Per data size (tokens per holder), one field for travel and tls (whatever the model) and
    FedAvg per model."""
    cells, model = d["cells"], lambda c: f"{c['n_layer']}x{c['n_embd']}"
    models = list(dict.fromkeys(model(c) for c in sorted(cells, key=lambda c: c["params"])))
    cols = [(m, None) for m in ("travel", "tls") if any(m in c["rows"] for c in cells)] + [("fl", n) for n in models]

    def value(v):
        return "-" if v is None else f"{v:,}" if isinstance(v, int) else num(v, 3) if isinstance(v, float) else str(v)
    rows = []
    for size in sorted({c["holder_tokens"] for c in cells}):
        at = [c for c in cells if c["holder_tokens"] == size]
        recs = [next((c["rows"][m] for c in at if m in c["rows"] and n in (None, model(c))), {}) for m, n in cols]
        rows.append((f"{size:,}", *(value(r.get(field)) for r in recs)))
    return ("tokens / holder", *(m if n is None else f"FedAvg {n}" for m, n in cols)), rows


@table("r")
def fl_crossover(d):
    """Per model, FedAvg's bytes per holder and round, and the tokens per holder at which it would
    move as few bytes as the TLS baseline or travelling."""
    x = d["crossover"]

    def tokens(n):
        return f"{n / 1e9:,.2f}G" if n >= 1e9 else f"{n / 1e6:,.2f}M" if n >= 1e6 else f"{n:,.0f}"
    return ("model", "parameters", "FedAvg bytes per holder and round", "x twice the fp32 model",
            f"parity with tls: tokens / holder ({x['rounds']} rounds)",
            f"parity with travelling: tokens / holder ({x['rounds']} rounds)"), [
        (name, f"{m['params']:,}", f"{m['fl_bytes_per_holder_round']:,.0f}", num(m["overhead"]),
         tokens(m["tls_parity_holder_tokens"]), tokens(m["travel_parity_holder_tokens"]))
        for name, m in sorted(x["models"].items(), key=lambda kv: kv[1]["params"])]


@table("r")
def fl_loss_gap(d):
    """Held-out loss of travelling (centralised) and FedAvg on non-IID and IID holders, and each
    method's last training losses."""
    names = {"non_iid": "non-IID (one press per holder)", "iid": "IID (presses mixed)"}
    return ("data", "travel (centralised)", "FedAvg", "gap", "travel: last training losses",
            "FedAvg: holders' last local losses"), [
        (names.get(k, k), num(t["final_loss"], 4), num(f["final_loss"], 4),
         f"{f['final_loss'] - t['final_loss']:+.3f}", *(num(x.get("train_loss_tail"), 3) for x in (t, f)))
        for k, t, f in ((k, v["travel"], v["fl"]) for k, v in d["loss_gap"].items())]


@table("r")
def train_workload(d):
    """`bench train --workload` (issue 27): per method the median step against the plain local
    DataLoader's (measured in the same run), the data-stall share, the bytes over the links and
    the final model's held-out metrics over all holders."""
    local = d["local_dataloader"]
    refs = local.get("runs_step_ms") or [local["step_ms"]]
    rows = [("local DataLoader (reference, before each method)", "local disk", " / ".join(num(x) for x in refs), "1.00",
             "-", "-", "-", "-", "-")]
    for bw, (methods, same) in runs(d).items():
        for m in [m for m in ("travel", "tls", "fl") if m in methods]:
            r = methods[m]
            final = (r.get("final_metrics") or {}).get("all") or {}
            rows.append(({"fl": "fl (FedAvg)"}.get(m, m), link(bw), num(r.get("step_ms")), num(r.get("step_ms_vs_local")),
                         pct(r.get("stall_share"), 2), "-" if r.get("bytes_over_link") is None
                         else f"{r['bytes_over_link']:,}", num(final.get("loss"), 4), pct(final.get("accuracy")),
                         yes(same) if m in ("travel", "tls") else "-"))
    return ("method", "link", "median step (ms)", "x local DataLoader", "stall share", "bytes over the links",
            "held-out loss", "held-out accuracy", "same losses (G2)"), rows


@table(many=True)
def train_workload_targets(files):
    """Issue 27's targets per workload: the travelling loader's median step against the local
    DataLoader's measured just before it (at most 1.05x), and its stall share (at most 1 %), over the
    whole job and after the first pass (each holder's first travels; runs before it was measured, or with
    nothing but the first pass travelled: -)."""
    def met(share: float | None) -> str:
        return "-" if share is None else ("met" if share <= 0.01 else "**missed**")

    rows = []
    for d, _, _ in files:
        job = d.get("config") or {}
        kept = f"{job['resident_mib']} MiB" if job.get("resident_mib") else "none"
        for r in (r for r in d["rows"] if r.get("method") == "travel"):
            ratio, stall, steady = r.get("step_ms_vs_local"), r.get("stall_share"), r.get("steady_stall_share")
            first = r.get("first_pass_s")
            rows.append((d.get("workload", "gpt2"), f"{job.get('steps', '-')}", kept, link(r["bandwidth_mbit"]),
                         f"{num(r.get('step_ms'))} / {num(r.get('local_step_ms'))} ms = {num(ratio)}x",
                         "-" if ratio is None else ("met" if round(ratio, 2) <= 1.05 else "**missed**"),
                         pct(stall, 2), met(stall), "-" if first is None else num(first * 1e3, 1),
                         pct(steady, 2), met(steady)))
    return ("workload", "steps", "records kept", "link", "travel step / DataLoader step", "within 1.05x",
            "stall share (whole job)", "at most 1 %", "first pass (ms)", "stall share after it", "at most 1 %"), rows


#: Records of the image workload's model held fixed, larger than its data: uint8 pixels and an int64 label.
LARGER_IMAGES = (("28 x 28 grey", "[1,28,28]"), ("224 x 224 grey", "[1,224,224]"),
                 ("224 x 224 x 3 colour", "[3,224,224]"))
#: A dataset buffer whose manifest pieces (1 MiB, the largest) hold a 224 x 224 x 3 record, for the row
#: that does not fit the runs' 128 KiB pieces.
WIDER_BUFFER = 1 << 20


def _records_rates(d: dict) -> dict:
    """A `bench train --workload ... --resident-mib` run's byte rates (each record crosses once):
    FedAvg's per holder and round, TLS's over the holders' laid-out datasets (training records in
    whole-record pieces, zero-padded, then the held-out ones: files.py), and a travel's."""
    from gputravel.data.records import RecordSchema, Units
    from gputravel.protocol.layout import layout_for, manifest_piece_bytes
    from gputravel.workloads import load_workload

    job, rows = d["config"], {r["method"]: r for r in d["rows"]}
    schema = RecordSchema.from_json(job["record_schema"])
    model = load_workload(d["workload"]).module.model(schema)
    units = Units(schema.record_bytes, manifest_piece_bytes(layout_for(job["buffer_bytes"])))
    train = d["holders_train_tokens"]
    held = {h: m["records"] for h, m in rows["tls"]["final_metrics"]["per_holder"].items()}
    laid_out = sum(units.split_bytes(train[h], held[h]) for h in train)
    plan, tls = d["fl_plan"], rows["tls"]["bytes_over_link"]
    per_round = rows["fl"]["bytes_over_link"] / (plan["rounds"] * len(plan["holders"]))
    return {"record_bytes": schema.record_bytes, "params": sum(p.numel() for p in model.parameters()),
            "rounds": plan["rounds"], "buffer_bytes": job["buffer_bytes"], "fl_per_round": per_round,
            "tls_per_record": tls / (sum(train.values()) + sum(held.values())), "tls_framing": tls / laid_out,
            "travel_per_travel": rows["travel"]["bytes_over_link"] / rows["travel"]["fetches"]}


@table("r")
def fl_records_crossover(d):
    """Per record size, the records per holder at which FedAvg would move as few bytes as the TLS
    baseline or travelling: the shipped records from the run's rates, larger images arithmetic on
    the image run's rates with its model held fixed, laid out as a holder lays them out (whole
    records to a manifest piece, zero-padded: TLS's measured framing over a record's share of its
    piece; a travel brings the records a buffer's pieces hold). A record larger than a piece: -."""
    from gputravel.data.records import RecordSchema, Units
    from gputravel.protocol.layout import layout_for, manifest_piece_bytes

    def size(n: float) -> str:
        return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.2f} MB" if n >= 1e6 else f"{n / 1e3:,.1f} KB"

    def kib(n: int) -> str:
        return f"{n >> 20:,} MiB" if n % (1 << 20) == 0 else f"{n >> 10:,} KiB"

    x = _records_rates(d)
    buffer = x["buffer_bytes"]
    records = [("8 x 8 grey" if d["workload"] == "image" else "30 float32 features", x["record_bytes"],
                "shipped, run", buffer)]
    if d["workload"] == "image":
        def image(shape: str) -> int:
            return RecordSchema.parse(f"image: uint8{shape}; label: int64[]").record_bytes
        records += [(name, image(shape), "arithmetic", buffer) for name, shape in LARGER_IMAGES]
        records += [(name, image(shape), f"arithmetic, {kib(WIDER_BUFFER)} buffer", WIDER_BUFFER)
                    for name, shape in LARGER_IMAGES[-1:]]
    fl_bytes = x["rounds"] * x["fl_per_round"]  # one holder's, the whole job
    travels = fl_bytes / x["travel_per_travel"]  # the travels that move as many bytes
    rows = []
    for name, rec, kind, buf in records:
        piece = manifest_piece_bytes(layout_for(buf))
        fixed = (name, f"{rec:,}", kind, f"{kib(buf)} / {kib(piece)}", f"{x['params']:,}",
                 f"{x['fl_per_round']:,.0f}", num(x["fl_per_round"] / (2 * 4 * x["params"])))
        if rec > piece:  # Units refuses it: no layout of this buffer carries the record
            rows.append((*fixed, "-", "-", f"{x['travel_per_travel']:,.0f}", "-", "-"))
            continue
        units = Units(rec, piece)
        tls_rec = x["tls_framing"] * piece / units.per_piece  # its share of its piece, padding included
        tls = f"{tls_rec:,.1f}" + (f" (as run: {x['tls_per_record']:,.1f})" if kind.startswith("shipped") else "")
        per_travel, tls_n = units.capacity(buf), fl_bytes / tls_rec
        rows.append((*fixed, f"{per_travel:,} ({pct(units.per_piece * rec / piece, 2)})", tls,
                     f"{x['travel_per_travel']:,.0f}", f"{tls_n:,.0f} ({size(tls_n * rec)})",
                     f"{travels * per_travel:,.0f} ({size(travels * per_travel * rec)})"))
    return ("record", "bytes a record", "records", "buffer / piece", "parameters", "FedAvg bytes per holder and round",
            "x twice the fp32 model", "records a travel (piece filled)", "TLS bytes per record",
            "travel bytes per travel", f"parity with tls: records / holder ({x['rounds']} rounds)",
            f"parity with travelling: records / holder ({x['rounds']} rounds)"), rows
