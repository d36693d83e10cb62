"""Kinds of table that set a run beside the paper's own figures, and the hardware profiles beside
each other: Table 1 step by step (`bench travel`), Figure 6 under both profiles, the tie-break
and Table 2 (`bench compare`), and `gputravel plan`'s worked example. The paper's figures come
from the JSON (each benchmark writes them beside its own, from bench/paper.py), never from
here. See table_kinds.py for how a kind is written.
"""

from __future__ import annotations

from gputravel.bench.compare import fmt_speedup
from gputravel.bench.table_kinds import STEP_NAMES, Source, Table, link_label, num, pct
from gputravel.errors import BadInput

EMULATED = "emulated"


def profile_of(data: dict) -> str:
    """The hardware profile a run stood for; a file without the block predates profiles: emulated."""
    hw = data.get("hardware")
    if isinstance(hw, dict):
        return str(hw.get("profile") or hw.get("name") or EMULATED)
    return str(hw) if hw else EMULATED


# ----------------------------------------------------------------------------- bench travel
#: The steps set beside the paper's, in Table 1's order; the rest are summed as "context steps".
PAPER_STEPS = ("o_cleanup", "dh_switch", "dh_copy", "tls", "o_switch")
CONTEXT_STEPS = ("dh_import", "dh_export", "o_import", "o_rotate")


def travel_paper(src: Source) -> Table:
    """`bench travel` (a run that recorded the paper's row beside each of its own): per size, the
    steps the paper times too, ours (the paper's); the context steps (ours only: the paper has
    no rotation column); the totals and their ratio."""
    body = []
    for r in src.data["rows"]:
        paper = r.get("paper")
        if not paper:
            raise BadInput(f"the {r['size_mib']} MiB row has no paper figures (a run before bench/paper.py)")
        steps, theirs = r["steps_ms"], paper["steps_ms"]
        cells = [num(steps[s]) + ("" if theirs.get(s) is None else f" ({num(theirs[s])})") for s in PAPER_STEPS]
        context = sum(steps[s] for s in CONTEXT_STEPS)
        body.append((str(r["size_mib"]), *cells, num(context), num(r["total_ms"], 1), num(paper["total_ms"], 1),
                     num(r["total_ms"] / paper["total_ms"])))
    header = ("MiB", *(STEP_NAMES[s] for s in PAPER_STEPS), "context steps", "total", "paper total", "ours / paper")
    return Table(header, tuple(body), "r")


# ----------------------------------------------------------------------------- bench compare
def _profiles(src: Source) -> list[tuple[str, dict]]:
    """The files by profile, emulated first; one file per profile."""
    found = [(profile_of(d), d) for _, d in src.files]
    names = [p for p, _ in found]
    if len(set(names)) != len(names):
        raise BadInput(f"two files of the same hardware profile: {', '.join(names)}")
    return sorted(found, key=lambda f: (f[0] != EMULATED, names.index(f[0])))


def compare_profiles(src: Source) -> Table:
    """`bench compare` under each hardware profile (a glob matching one file per profile):
    speedup per cell, emulated / **the others**, with the paper's estimate in parentheses.
    Only the cells every file measured."""
    files = _profiles(src)
    at = [{(c["size_mib"], c["bandwidth_mbit"]): c for c in d["cells"]} for _, d in files]
    common = [k for k in at[0] if all(k in a for a in at[1:])]
    if not common:
        raise BadInput("the files have no (size, bandwidth) cell in common")
    bws = list(dict.fromkeys(bw for _, bw in common))
    sizes = sorted({s for s, _ in common})

    def text(size: int, bw: float | None) -> str:
        if (size, bw) not in common:
            return "-"
        cells = [a[size, bw] for a in at]
        shown = [("~" if c.get("extrapolated") else "") + fmt_speedup(c["speedup"]) for c in cells]
        shown = [s if i == 0 and files[0][0] == EMULATED else f"**{s}**" for i, s in enumerate(shown)]
        paper = cells[-1].get("paper_speedup_estimate")
        return " / ".join(shown) + ("" if paper is None else f" ({fmt_speedup(paper)})")

    body = tuple((str(s), *(text(s, bw) for bw in bws)) for s in sizes)
    return Table(("MiB", *(link_label(bw) for bw in bws)), body, "r")


def compare_paper(src: Source) -> Table:
    """`bench compare` against the paper, per link (a run that recorded ``cells[].paper``): the
    range over the sizes of our travel / the paper's Table 1 total, our baseline / the paper's
    (from Table 2, linear in size), our speedup / the paper's estimate, and our baseline's TLS
    time / (size/cap) where measured."""
    cells = src.data["cells"]
    if not all(c.get("paper") for c in cells):
        raise BadInput("a cell has no paper figures (a run before bench/paper.py)")
    body = []
    for bw in dict.fromkeys(c["bandwidth_mbit"] for c in cells):
        at = [c for c in cells if c["bandwidth_mbit"] == bw]
        rates = [c["rate_agreement"]["ratio"] for c in at if c.get("rate_agreement")]
        measured = [c for c in at if not c.get("extrapolated")]
        body.append((link_label(bw), _span(c["paper"]["travel_ms_ratio"] for c in at),
                     _span(c["paper"]["baseline_ms_ratio"] for c in measured) + f" ({len(measured)} of {len(at)})",
                     _span(c["paper"]["speedup_ratio"] for c in at), _span(rates) if rates else "-"))
    header = ("link", "our travel / paper's", "our baseline / paper's (measured cells)", "our speedup / paper's",
              "our baseline's TLS / (size/cap)")
    return Table(header, tuple(body), "r")


def _span(values) -> str:
    values = list(values)
    if not values:
        return "-"
    low, high = num(min(values)), num(max(values))
    return f"{low}x" if low == high else f"{low}-{high}x"


def compare_tie_break(src: Source) -> Table:
    """`bench compare`: per link, where the baseline was faster, from which size travelling was,
    and (where the run estimated it) the size where the two cross, both times fitted linearly."""
    data = src.data
    estimates = {e["bandwidth_mbit"]: e["size_mib"] for e in data.get("tie_break_estimates", [])}
    body = []
    for t in data["tie_breaks"]:
        est = estimates.get(t["bandwidth_mbit"])
        body.append((link_label(t["bandwidth_mbit"]), ", ".join(map(str, t["baseline_faster_at_mib"])) or "none",
                     "-" if t.get("travel_faster_from_mib") is None else str(t["travel_faster_from_mib"]),
                     "-" if est is None else (num(est) if est < 10 else f"{est:.0f}")))
    return Table(("link", "baseline faster at (MiB)", "travelling faster from (MiB)", "estimated crossing (MiB)"),
                 tuple(body), "r")


def compare_table2(src: Source) -> Table:
    """`bench compare`'s ``table_2``: the paper's Table 2 from the run's 512 MiB cells, each share
    taken against the paper's llm.c training time at that link, the paper's figures beside."""
    rows = src.data.get("table_2")
    if not rows:
        raise BadInput("the file has no table_2 (a run before bench/paper.py, or no 512 MiB cell)")
    body = tuple((link_label(r["bandwidth_mbit"]), ("~" if r.get("extrapolated") else "") + num(r["baseline_tx_s"]),
                  pct(r["baseline_share"], 3), num(r["paper"]["baseline_tx_s"]), pct(r["paper"]["baseline_share"], 3),
                  num(r["ours_tx_s"], 3), pct(r["ours_share"], 3), num(r["paper"]["ours_tx_s"]),
                  pct(r["paper"]["ours_share"], 3)) for r in rows)
    header = ("link", "baseline Tx (s)", "share", "paper", "paper share", "ours Tx (s)", "share", "paper",
              "paper share")
    return Table(header, body, "r")


# ----------------------------------------------------------------------------- gputravel plan
def plan_worked_example(src: Source) -> Table:
    """`gputravel plan --worked-example --json` files (a glob): the slides' figures, then one row
    per file: where its constants came from, the link, the time saved per transmission and for
    the whole dataset, and that over the slides' figure."""
    files = [d for _, d in src.files]
    if not all("worked_example" in d for d in files):
        raise BadInput("a plan file without worked_example (run plan with --worked-example)")
    files.sort(key=lambda d: (not _from_paper(d), d["inputs"]["bandwidth_mbit"] is None))
    slides = files[0]["worked_example"]
    body = [("the paper's slides", "-", "-", num(slides["saved_per_transmission_s"]["paper"]),
             _days(slides["saved_s"]["paper"]), "1.00")]
    for d in files:
        inp, ex = d["inputs"], d["worked_example"]
        origin = "the paper's figures" if _from_paper(d) else f"measured here ({inp['hardware']} JSONs)"
        body.append((f"plan, {origin}", link_label(inp["bandwidth_mbit"]), f"{inp['buffer_bytes'] / (1 << 20):g} MiB",
                     num(ex["saved_per_transmission_s"]["ours"]), _days(ex["saved_s"]["ours"]),
                     num(ex["saved_s"]["ratio"])))
    return Table(("figures", "link", "buffer", "saved per transmission (s)", "saved in all", "/ the slides'"),
                 tuple(body))


def _from_paper(plan: dict) -> bool:
    return str(plan.get("sources", {}).get("travel", "")).startswith("the paper")


def _days(s: float) -> str:
    return f"{s:,.0f} s ({s / 86400:.1f} days)"
