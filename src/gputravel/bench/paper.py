"""The paper's figures (protocol/hardware.py) beside ours: Table 1, Figure 6 and Table 2. Sans-IO.

Figure 6 is a picture, so its cells are *estimated*: a travel takes Table 1's total at that
size, the baseline Table 2's 512 MiB time at that link scaled linearly to the size. With no
fixed cost per transfer, that puts the 500 Mbit/s tie-break near 11 MiB (the text: "around 4 MiB").
"""

from __future__ import annotations

from gputravel.protocol.hardware import TABLE_1, TABLE_1_COLUMNS, TABLE_2, TABLE_2_BUFFER_MIB, table_1

#: Our step (protocol/control.STEPS) -> the Table 1 columns it stands for (our copy is the
#: paper's read and GPU write at once; the paper has no column for the rotation).
STEP_COLUMNS = {
    "o_cleanup": ("O-Clean Up",), "o_export": ("O-Export Key",), "dh_switch": ("DH-PCIe Switching",),
    "dh_import": ("DH-Import Key",), "dh_copy": ("DH-Read Dataset", "DH-GPU Write"), "dh_export": ("DH-Export Key",),
    "tls": ("SSL Overheads",), "o_switch": ("O-PCIe Switching",), "o_import": ("O-Import Key",), "o_rotate": (),
}
#: Table 1's total (ms), by size. (TABLE_2's rows: training s, baseline Tx s, share %, then travelling's.)
PAPER_TRAVEL_MS = {size: row[TABLE_1_COLUMNS.index("Total Time")] for size, row in TABLE_1.items()}


def table_1_row(size_mib: int) -> dict | None:
    """The paper's row at this size, in our step names (None off the table)."""
    if size_mib not in TABLE_1:
        return None
    steps = {step: sum(table_1(size_mib, c) for c in cols) if cols else None for step, cols in STEP_COLUMNS.items()}
    return {"total_ms": PAPER_TRAVEL_MS[size_mib], "steps_ms": steps}


def paper_speedup(size_mib: int, bandwidth_mbit: float | None) -> float | None:
    """The paper's speedup at a Figure 6 cell, estimated; None off the grid."""
    cell = figure_6_cell(size_mib, bandwidth_mbit)
    return None if cell is None else cell["speedup"]


def figure_6_cell(size_mib: int, bandwidth_mbit: float | None) -> dict | None:
    travel = PAPER_TRAVEL_MS.get(size_mib)
    key = None if bandwidth_mbit is None else float(bandwidth_mbit)
    if travel is None or key not in TABLE_2:
        return None
    baseline = TABLE_2[key][1] * 1e3 * size_mib / TABLE_2_BUFFER_MIB
    return {"travel_ms": travel, "baseline_ms": baseline, "speedup": baseline / travel, "estimated": True}


def against_paper(cell: dict) -> dict | None:
    """One measured compare cell beside the paper's estimate, with ours / paper's."""
    paper = figure_6_cell(cell["size_mib"], cell["bandwidth_mbit"])
    if paper is None:
        return None
    ratios = {f"{k}_ratio": cell[k] / paper[k] for k in ("travel_ms", "baseline_ms", "speedup")}
    return {**paper, **ratios}


def table_2(cells: list[dict]) -> list[dict]:
    """Table 2 for this run: per link measured at 512 MiB, each method's share of the paper's
    llm.c training time (we have no H100 to train on)."""
    rows = []
    at_512 = (c for c in cells if c["size_mib"] == TABLE_2_BUFFER_MIB)
    for c in sorted(at_512, key=lambda c: float("inf") if c["bandwidth_mbit"] is None else c["bandwidth_mbit"]):
        bw = c["bandwidth_mbit"]
        key = None if bw is None else float(bw)
        if key not in TABLE_2:
            continue
        p = TABLE_2[key]
        train_s, b_tx, o_tx = p[0], c["baseline_ms"] / 1e3, c["travel_ms"] / 1e3
        rows.append({
            "bandwidth_mbit": bw, "training_s": train_s,
            "baseline_tx_s": b_tx, "baseline_share": b_tx / (train_s + b_tx), "extrapolated": c["extrapolated"],
            "ours_tx_s": o_tx, "ours_share": o_tx / (train_s + o_tx), "saved_s": b_tx - o_tx,
            "paper": {"baseline_tx_s": p[1], "baseline_share": p[2] / 100, "ours_tx_s": p[4], "ours_share": p[5] / 100,
                      "saved_s": p[1] - p[4]},
            "baseline_tx_ratio": b_tx / p[1], "ours_tx_ratio": o_tx / p[4],
        })
    return rows


def tie_break_mib(cells: list[dict], bandwidth_mbit: float | None) -> float | None:
    """Where both methods' least-squares lines a + b x size cross at this link; None: fewer than
    two sizes, or no crossing at a positive size."""
    row = [c for c in cells if c["bandwidth_mbit"] == bandwidth_mbit]
    if len({c["size_mib"] for c in row}) < 2:
        return None
    ta, tb = _fit([(c["size_mib"], c["travel_ms"]) for c in row])
    ba, bb = _fit([(c["size_mib"], c["baseline_ms"]) for c in row])
    if bb <= tb:
        return None  # the baseline grows no faster than a travel: no crossing ahead
    size = (ta - ba) / (bb - tb)
    return size if size > 0 else None


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope
