"""`gputravel bench scale`: the travel's cost as the cohort grows (bench/scale.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from gputravel.bench import scale
from gputravel.cli.output import console, numeric_table, write_results

COLUMNS = ("holders", "median ms", "p90 ms", "fixed ms", "x 1 holder", "same holder ms", "boot s", "RSS MiB",
           "private MiB")


def bench_scale(
    holders: str = typer.Option("1,8,32,64", help="Holder counts, comma separated: one cohort each."),
    travels: int = typer.Option(200, help="Timed travels per row, round robin over the holders (after a warm-up "
                                          "travel to each); as many to one holder, the control, in alternating "
                                          "blocks of 8."),
    buffer_mib: int = typer.Option(1, help="Dataset buffer, MiB; each holder holds one buffer of data."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
) -> None:
    """Travel time, fixed overhead, boot time and memory per holder, as the number of holders grows."""
    command = f"gputravel bench scale --holders {holders} --travels {travels} --buffer-mib {buffer_mib}"
    table = numeric_table("GPU Travelling with more holders (round robin; medians unless named)", COLUMNS)
    counts = scale.parse_holders(holders)
    with console.status("booting a cohort per row..."):
        result = scale.run(counts, travels, buffer_mib, command=command, on_row=lambda r: console.print(
            f"  {r['holders']} holders: median {r['median_ms']:.2f} ms, booted in {r['boot_s']:.1f} s"))
    for r in result["rows"]:
        ratio = f"{r['vs_1_holder']:.2f}" if r["vs_1_holder"] else "-"
        table.add_row(str(r["holders"]), f"{r['median_ms']:.2f}", f"{r['p90_ms']:.2f}", f"{r['fixed_ms']:.2f}", ratio,
                      f"{r['same_holder_median_ms']:.2f}", f"{r['boot_s']:.1f}", f"{r['rss_mib']:.0f}",
                      f"{r['rss_private_mib']:.0f}")
    console.print(table)
    loads = ", ".join(f"{r['loadavg'][0]:.1f}" for r in result["rows"])
    console.print(f"target: the median at 64 holders within 1.2 x that of 1 holder. {result['machine']}; "
                  f"1-minute load at each row's start: {loads}")
    write_results(json_path, {**result, "command": f"{command} --json {json_path}"})
