"""`gputravel plan`: a consortium's what-if (the model: bench/plan.py), from benchmark JSONs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from gputravel.bench import plan as model
from gputravel.cli.hardware import hardware_option
from gputravel.errors import BadInput
from gputravel.files import MISSING, not_data
from gputravel.protocol.hardware import EMULATED
from gputravel.cli.output import console, numeric_table, write_results

# Where benchmark JSONs measured on this machine are kept (the first that exist are read).
RESULT_DIRS = (Path("docs/results"), Path("docs/benchmarks-data"))


def plan_command(
    dataset: Optional[str] = typer.Option(None, help="Dataset size per holder, with a unit: 44TiB, 300GiB."),
    holders: Optional[int] = typer.Option(None, help="Number of data holders (default 1)."),
    buffer: Optional[str] = typer.Option(None, help="Dataset buffer in the GPU, with a unit (default 512MiB)."),
    bandwidth: Optional[str] = typer.Option(None, help="Each holder's link to the orchestrator, Mbit/s, or 'uncapped' "
                                                       "(default 100)."),
    hardware: str = hardware_option(),
    tokens_per_s: Optional[float] = typer.Option(None, help="Training throughput, tokens per second."),
    step_s: Optional[float] = typer.Option(None, help="Or: seconds per training step (with --tokens-per-step)."),
    tokens_per_step: Optional[int] = typer.Option(None, help="Tokens per training step (B x T)."),
    bytes_per_token: float = typer.Option(2.0, help="Bytes per token in the dataset (llm.c shards: 2)."),
    model_size: Optional[str] = typer.Option(None, help="Model size with a unit, for the FL estimate (GPT-2 124M in "
                                                        "fp32: 475MiB); none: no FL estimate."),
    fl_rounds: int = typer.Option(1, help="FL rounds in all (each: every holder receives and sends the model)."),
    epochs: int = typer.Option(1, help="Passes over every holder's dataset."),
    source: str = typer.Option("auto", help="Where the constants come from: results (benchmark JSONs measured here, "
                                            "with the same --hardware), paper (the paper's figures; paper-h100 only), "
                                            "or auto (results when there are, else the paper's)."),
    results: Optional[list[Path]] = typer.Option(None, "--results", help="Benchmark JSON files or directories to read "
                                                                        "(repeatable; default docs/results, else docs/benchmarks-data)."),
    worked_example: bool = typer.Option(False, help="The paper's worked example (FineWeb 44 TiB, GPT-2 with llm.c, "
                                                    "256 MiB, 500 Mbit/s, paper-h100, the paper's figures): inputs "
                                                    "and --source not given are its."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the prediction as JSON here."),
) -> None:
    """Predict what moving a consortium's data costs: travelling, the TLS baseline and FL.

    Transmission time and its share of training, bytes over the slow link, number of travels.
    The constants come from benchmark JSONs measured on this machine or from the paper's
    figures; the output says which."""
    if worked_example and source == "auto":
        source = "paper"  # the example reproduces the paper's figures unless --source says otherwise
    ex = model.worked_example_input() if worked_example else None  # its inputs for those not given
    if ex is None and dataset is None:
        raise BadInput("give --dataset (per holder, e.g. 44TiB), or --worked-example")
    speed = {"tokens_per_s": tokens_per_s, "step_s": step_s, "tokens_per_step": tokens_per_step}
    if ex and tokens_per_s is None and step_s is None:
        speed["tokens_per_s"] = ex.tokens_per_s  # the example's; otherwise PlanInput says what to give
    inp = model.PlanInput(
        dataset_bytes=model.parse_size(dataset, "--dataset") if dataset else ex.dataset_bytes,
        holders=holders or (ex.holders if ex else 1),
        buffer_bytes=model.parse_size(buffer, "--buffer") if buffer else (ex.buffer_bytes if ex else 512 * model.MIB),
        bandwidth_mbit=model.parse_bandwidth(bandwidth) if bandwidth else (ex.bandwidth_mbit if ex else 100.0),
        hardware=ex.hardware if ex and hardware == EMULATED else hardware,
        model_bytes=model.parse_size(model_size, "--model-size") if model_size else (ex.model_bytes if ex else 0),
        bytes_per_token=bytes_per_token, fl_rounds=fl_rounds, epochs=epochs, **speed)
    constants = model.constants_from(_read_results(results), inp.hardware, source)
    out = model.predict(inp, constants)
    if worked_example:
        out["worked_example"] = model.against_worked_example(out)
    _print(out)
    write_results(json_path, out, "prediction")


def _read_results(paths: Optional[list[Path]]) -> list[tuple[str, dict]]:
    """Every benchmark JSON under ``paths`` (default: the first of RESULT_DIRS that has any)."""
    if paths:
        missing = [str(p) for p in paths if not_data(p) == MISSING]
        if missing:
            raise BadInput(f"--results not found: {', '.join(missing)}")
        for p in paths:  # a FIFO would block the read
            if not_data(p) is not None:
                raise BadInput(f"--results {p} {not_data(p)}")
        files = [f for p in paths for f in (sorted(p.glob("*.json")) if p.is_dir() else [p])]
    else:
        files = next((sorted(d.glob("*.json")) for d in RESULT_DIRS if d.is_dir() and any(d.glob("*.json"))), [])
    found = []
    for f in files:
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError, RecursionError):  # RecursionError: nested too deeply
            continue  # not a benchmark's JSON: nothing to take from it
        if isinstance(doc, dict) and model.kind_of(doc):
            found.append((str(f), doc))
    return found


def _print(out: dict) -> None:
    inp = out["inputs"]
    bw = "uncapped" if inp["bandwidth_mbit"] is None else f"{inp['bandwidth_mbit']:g} Mbit/s"
    console.print(f"[bold]gputravel plan[/bold]: {inp['holders']} holder(s) x {model.fmt_bytes(inp['dataset_bytes'])}, "
                  f"{inp['epochs']} epoch(s), buffer {model.fmt_bytes(inp['buffer_bytes'])}, link {bw} "
                  f"(goodput {out['constants']['goodput_mbit']:.1f} Mbit/s), hardware {inp['hardware']}; training "
                  f"{model.fmt_duration(out['training_s'])} at {inp['tokens_per_s_used']:,.0f} tokens/s.")
    table = numeric_table("Predicted transmission (the training waits for it)",
                          ("method", "per transmission", "transmissions", "transmission", "share of training",
                           "bytes over the link"))
    for name, label in (("travelling", "GPU Travelling"), ("baseline", "TLS baseline"), ("fl", "FL (a model)")):
        m = out.get(name)
        if m is None:
            continue
        per = "-" if m["per_transmission_s"] is None else model.fmt_duration(m["per_transmission_s"])
        count = f"{m['count']:,} {'rounds' if name == 'fl' else 'travels' if name == 'travelling' else 'transfers'}"
        table.add_row(label, per, count, model.fmt_duration(m["transmission_s"]), f"{m['share']:.3%}",
                      model.fmt_bytes(m["bytes_over_link"]))
    console.print(table)
    console.print(f"travelling saves {out['saved_per_transmission_s']:.2f} s per buffer, "
                  f"{model.fmt_duration(out['saved_s'])} in all.")
    if "fl" in out:
        console.print(f"FL: {out['fl']['model']}.")
    for what, where in out["sources"].items():
        console.print(f"  {what} constants: {where}")
    example = out.get("worked_example")
    if example:
        s, t = example["saved_per_transmission_s"], example["saved_s"]
        console.print(f"the paper's worked example: {s['paper']:.0f} s saved per 256 MiB and {t['paper']:,.0f} s "
                      f"({model.fmt_duration(t['paper'])}) for 44 TiB; this model: {s['ours']:.2f} s and "
                      f"{t['ours']:,.0f} s ({model.fmt_duration(t['ours'])}): {s['ratio']:.2f}x the paper's.")
