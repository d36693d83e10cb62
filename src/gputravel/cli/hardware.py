"""The shared `--hardware` option, and what `bench compare` prints beside the paper (bench/paper.py)."""

from __future__ import annotations

import typer

from gputravel.protocol.hardware import EMULATED, PROFILES
from gputravel.cli.output import console, numeric_table

HELP = (f"The hardware the run stands for: {' or '.join(PROFILES)}. 'emulated' injects nothing; 'paper-h100' "
        "holds each PCIe switch, the dataset read, the GPU write and the context exchange to the paper's "
        "Table 1 times (docs/fidelity.md). The JSON names every injected cost.")


def hardware_option():
    return typer.Option(EMULATED, "--hardware", help=HELP)


def link_label(bw: float | None) -> str:
    return "uncapped" if bw is None else f"{bw:g} Mbit/s"


def print_against_paper(result: dict) -> None:
    """Figure 6 cell by cell (ours / the paper's estimate), the tie-breaks, and Table 2."""
    hw = result.get("hardware", {}).get("profile", EMULATED)
    cells = [c for c in result["cells"] if c.get("paper")]
    if cells:
        table = numeric_table(f"Against the paper's Figure 6 (estimated from Tables 1 and 2); hardware: {hw}",
                              ("MiB", "Mbit/s", "travel", "paper", "x", "baseline", "paper", "x", "speedup", "paper"))
        for c in cells:
            p = c["paper"]
            table.add_row(str(c["size_mib"]), link_label(c["bandwidth_mbit"]), f"{c['travel_ms']:.1f}", f"{p['travel_ms']:.1f}",
                          f"{p['travel_ms_ratio']:.2f}", f"{c['baseline_ms']:.1f}", f"{p['baseline_ms']:.1f}",
                          f"{p['baseline_ms_ratio']:.2f}", f"{c['speedup']:.2f}", f"{p['speedup']:.2f}")
        console.print(table)
    for t in result.get("tie_break_estimates", []):
        where = "-" if t["size_mib"] is None else f"{t['size_mib']:.1f} MiB"
        console.print(f"  tie-break at {link_label(t['bandwidth_mbit'])} (linear fit over the sizes measured): {where}; "
                      "the paper: around 4 MiB at 500 Mbit/s")
    for r in result.get("table_2", []):
        p = r["paper"]
        console.print(f"  Table 2, {link_label(r['bandwidth_mbit'])}: baseline Tx {r['baseline_tx_s']:.2f} s "
                      f"({r['baseline_share']:.3%} of {r['training_s']:.0f} s of llm.c training; paper {p['baseline_tx_s']:.2f} s, "
                      f"{p['baseline_share']:.3%}), ours {r['ours_tx_s']:.2f} s ({r['ours_share']:.3%}; paper "
                      f"{p['ours_tx_s']:.2f} s, {p['ours_share']:.3%})")
