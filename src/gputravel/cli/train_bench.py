"""`gputravel bench train` (the paper's Table 2, with FedAvg on Flower beside it) and
`gputravel bench fl-sweep` (where FedAvg moves fewer bytes than travelling, and where more)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from gputravel.bench import compare
from gputravel.cli.hardware import hardware_option
from gputravel.cli.output import console, numeric_table, write_results


def bench_train(
    bandwidths: str = typer.Option("4,20,100,500,uncapped", help="Link caps in Mbit/s, comma separated; 'uncapped' for none."),
    workload: str = typer.Option("gpt2", help="What trains: gpt2 (a small GPT-2 on Shakespeare), image (a CNN on "
                                              "digits) or tabular (an MLP on tumour records), on the shipped data."),
    steps: Optional[int] = typer.Option(None, help="Training steps per run (default: 600 for gpt2, 300 of 32 records "
                                                   "for image and tabular)."),
    buffer_kib: int = typer.Option(128, help="Dataset buffer, KiB."),
    resident_mib: int = typer.Option(0, help="MiB of travelled records the orchestrator keeps for the job's steps "
                                             "(the job's resident_mib; travel and tls): a kept visit does not move again."),
    holders: int = typer.Option(3, help="Data holders; the workload's shipped data is dealt among them."),
    link: str = typer.Option("auto", help="auto (netns-tc where namespaces work, else token-bucket), netns or token-bucket."),
    methods: str = typer.Option("travel,tls", help="Methods, comma separated: travel, tls, fl (FedAvg on Flower)."),
    fl_rounds: int = typer.Option(4, help="FedAvg rounds."),
    fl_local_steps: Optional[int] = typer.Option(None, help="FedAvg local steps per round (default: what gives "
                                                            "every method the same training tokens)."),
    fl_fraction: float = typer.Option(1.0, help="FedAvg: fraction of the holders sampled each round."),
    fl_drop: Optional[str] = typer.Option(None, help="HOLDER@ROUND: that holder drops out mid-round (FL)."),
    fl_drop_mode: str = typer.Option("crash", help="crash (killed outright) or leave (its SuperNode stops)."),
    eval_batches: int = typer.Option(4, help="Held-out batches per holder that final_loss is measured on."),
    iid: bool = typer.Option(False, help="Deal the holders' tokens out again, mixed (the IID control for FL)."),
    hardware: str = hardware_option(),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Draw time and bytes per method and bandwidth here (PNG)."),
) -> None:
    """The paper's Table 2: the same training fed by travelling and by the TLS baseline, and
    FedAvg on Flower beside them (--methods travel,tls,fl), for any shipped --workload; beside
    them the same training through a plain torch DataLoader over local disk."""
    from gputravel.bench import train, train_report  # lazy: imports torch (about a second), which the other commands do without
    from gputravel.fl.config import FedAvgConfig  # lazy: with the benchmark it configures

    fl = FedAvgConfig(rounds=fl_rounds, local_steps=fl_local_steps, fraction=fl_fraction, drop=fl_drop,
                      drop_mode=fl_drop_mode)
    cfg = train.TrainBenchConfig(compare.parse_bandwidths(bandwidths), link=link, holders=holders,
                                 train=train.workload_config(workload, steps, buffer_kib << 10).replace(
                                     resident_mib=resident_mib),
                                 methods=train.parse_methods(methods), fl=fl, eval_batches=eval_batches, iid=iid,
                                 hardware=hardware)
    with console.status(f"training once per method ({', '.join(cfg.methods)}) and bandwidth..."):
        result = train.run(cfg, on_row=lambda r: console.print(
            f"  {compare.bandwidth_label(r['bandwidth_mbit'])} {r['method']} done"))
    table = numeric_table(f"Training and transmission, {workload} (link: {result['link']}); final metrics on "
                          "held-out data", train_report.COLUMNS)
    for row in train_report.table_rows(result):
        table.add_row(*row)
    console.print(table)
    refs = ", ".join(f"{ms:.2f}" for ms in result["local_dataloader"]["runs_step_ms"])
    console.print(f"  local DataLoader reference, before each method: median step {refs} ms")
    for c in result["checks"]:
        if c["same_losses"] is not None:
            console.print(f"  {compare.bandwidth_label(c['bandwidth_mbit'])}: travel and tls losses "
                          f"{'identical (G2)' if c['same_losses'] else 'DIFFER'}")
    for r in result["rows"]:
        drop = (r.get("fl") or {}).get("drop")
        if drop:
            failures = "; ".join(f["reason"] for f in drop["flower_failures"] or []) or "none"
            console.print(f"  {drop['holder']} dropped out in round {drop['round']} ({drop['mode']}): that round "
                          f"averaged {', '.join(drop['round_replied'] or [])}; Flower reported: {failures}")
    if plot_path:
        console.print(f"figure written to {train_report.plot(result, plot_path)}")
    write_results(json_path, result)


def bench_fl_sweep(
    models: str = typer.Option("2x64,4x128,6x256", help="GPT-2 sizes, LAYERSxWIDTH, comma separated."),
    holder_tokens: str = typer.Option("4096,16384,65536", help="Training tokens per holder, comma separated."),
    bandwidth: float = typer.Option(20.0, help="Link cap, Mbit/s."),
    rounds: int = typer.Option(2, help="FedAvg rounds in every cell."),
    link: str = typer.Option("auto", help="auto, netns or token-bucket (FedAvg needs netns)."),
    loss_gap: bool = typer.Option(True, help="Also the non-IID loss gap at bench train's default size."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Draw bytes against data per holder here (PNG)."),
) -> None:
    """Where FedAvg moves fewer bytes than travelling and the TLS baseline, and where more."""
    from gputravel.bench import fl_sweep  # lazy: imports torch and the training benchmark

    cfg = fl_sweep.SweepConfig(fl_sweep.parse_models(models), fl_sweep.parse_tokens(holder_tokens),
                               bandwidth, rounds, link, loss_gap)
    with console.status("one bench train per cell..."):
        result = fl_sweep.run(cfg, on_cell=lambda c: console.print(
            f"  {c['holder_tokens']} tokens/holder, {c['n_layer']}x{c['n_embd']}: "
            + ", ".join(f"{m} {r['bytes_over_link']:,} B" for m, r in c["rows"].items())))
    for name, m in result["crossover"].get("models", {}).items():
        console.print(f"  {name} ({m['params']:,} params): FedAvg moves fewer bytes than TLS above "
                      f"{m['tls_parity_holder_tokens']:,.0f} tokens/holder, than travelling above "
                      f"{m['travel_parity_holder_tokens']:,.0f}")
    if plot_path:
        console.print(f"figure written to {fl_sweep.plot(result, plot_path)}")
    write_results(json_path, result)
