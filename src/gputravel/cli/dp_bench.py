"""`gputravel bench dp` (issue 29): utility against epsilon (bench/dp.py)."""

from __future__ import annotations

import shlex
import sys
import tempfile
from pathlib import Path
from typing import Optional

import typer

from gputravel.cli.output import check_output_file, console, numeric_table, write_results


def bench_dp(
    workload: str = typer.Option("tabular", help="What trains on its shipped data: tabular (an MLP on tumour records) or image (a CNN on digits)."),
    epsilons: str = typer.Option("1,3,8,inf", help="Target epsilons, comma separated; inf: the same job without DP."),
    steps: int = typer.Option(150, help="Training steps per run."),
    batch: int = typer.Option(128, help="Expected batch: each record is sampled with probability batch / records."),
    lr: float = typer.Option(0.1, help="Learning rate (AdamW; the same for every row)."),
    clip: float = typer.Option(1.0, help="Each record's gradient clipped to this L2 norm."),
    delta: float = typer.Option(1e-5, help="The delta each epsilon is stated at."),
    accountant: str = typer.Option("rdp", help="rdp, prv or gdp."),
    repeats: int = typer.Option(3, help="Runs per epsilon (seeds 0, 1, ...); accuracy is their mean."),
    holders: int = typer.Option(3, help="Data holders; the shipped data is dealt among them."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Draw accuracy against epsilon here (PNG)."),
) -> None:
    """Held-out accuracy of DP-SGD at each target epsilon, beside the same job without DP."""
    from gputravel.bench import dp  # lazy: torch and opacus, for this benchmark only

    check_output_file(json_path, "--json")
    check_output_file(plot_path, "--plot")
    cfg = dp.DpBenchConfig(dp.parse_epsilons(epsilons), workload=workload, holders=holders, steps=steps, batch=batch,
                           lr=lr, clip=clip, delta=delta, accountant=accountant, repeats=repeats)
    with tempfile.TemporaryDirectory(prefix="gputravel-bench-dp-") as work, console.status("training..."):
        result = dp.run(cfg, Path(work), progress=lambda line: console.print(f"  {line}"))
    result["command"] = "gputravel " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    table = numeric_table(f"{workload}: held-out accuracy against epsilon (delta {delta:g}, {accountant}, "
                          f"mean of {repeats})", ["target epsilon", "epsilon spent", "noise multiplier", "accuracy"])
    for r in result["rows"]:
        private = r["target_epsilon"] is not None
        table.add_row(f"{r['target_epsilon']:g}" if private else "no DP",
                      f"{r['epsilon_spent']:.3f}" if private else "-",
                      f"{r['noise_multiplier']:.3f}" if private else "-", f"{r['accuracy']:.2%}")
    console.print(table)
    if plot_path:
        console.print(f"figure written to {dp.plot(result, plot_path)}")
    write_results(json_path, result)
