"""`gputravel cohort init`, `serve ROLE --config FILE` and `status --config FILE`: a cohort as a
consortium deploys it, one service per party (issue 16, docs/deploy.md)."""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from gputravel.cli.output import Commands, console, named_subcommand
from gputravel.cli.train import workload_job
from gputravel.cohort.capacity import check_buffer
from gputravel.cohort.stopping import catch_term
from gputravel.files import MISSING, not_data
from gputravel.service.config import load_service
from gputravel.service.init import init_cohort
from gputravel.service.job import make_identity, set_job
from gputravel.service.status import cohort_status
from gputravel.train.job import TrainConfig

JOB = TrainConfig().to_dict()  # the defaults of a training job, for the options' help

__all__ = ["cohort_app", "serve_command", "status_command"]

cohort_app = typer.Typer(pretty_exceptions_show_locals=False, no_args_is_help=True, add_completion=False, cls=Commands, callback=named_subcommand,
                         help="A cohort as a consortium deploys it: one config file and one service per party.")


Role = enum.Enum("Role", {p: p for p in ("host", "gpu", "holder", "orchestrator", "broker")}, type=str)  # serve's


def _holder(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise typer.BadParameter(f"expected NAME=PATH, got {text!r}", param_hint="--holder")
    why = not_data(path)  # a FIFO, socket or device is refused here, not by the holder's service later
    if why is not None and why != MISSING:  # a missing path: init_cohort says so
        raise typer.BadParameter(f"{name}={path}: {why}", param_hint="--holder")
    return name, path


@cohort_app.command("init")
def init(
    directory: Path = typer.Argument(..., help="A new (or empty) directory for the cohort's files."),
    holders: list[str] = typer.Option(..., "--holder", help="A data holder: NAME=PATH of its data; repeat."),
    gpus: int = typer.Option(1, min=1, help="GPUs, one stack each (host, gpu-K, orchestrator rank K; host-K.toml, orchestrator-K.toml for K >= 1), the holders dealt into one share per GPU."),
    steps: Optional[int] = typer.Option(None, min=1, help=f"Training steps of the job (default {JOB['steps']})."),
    buffer_kib: Optional[int] = typer.Option(None, min=4, help=f"The dataset buffer in the GPU, KiB (default {JOB['buffer_bytes'] >> 10}; a multiple of 4, at most 1048576)."),
    workload: str = typer.Option("gpt2", help="What trains: gpt2 (tokens), image, tabular, or a workload .py file, whose text goes into the job (docs/workloads.md)."),
) -> None:
    """Write one config file per party (the key broker's too), the public trust anchors and empty state directories."""
    pairs = [_holder(h) for h in holders]
    job = workload_job(workload)
    undo_term = catch_term("cohort init was undone")  # SIGTERM unwinds it too, as Ctrl-C does
    try:
        if buffer_kib is not None:  # before anything is written: what this machine's GPU can hold
            check_buffer(buffer_kib << 10, "--buffer-kib", 1 << 10)
        written = init_cohort(directory, pairs, gpus=gpus, steps=steps, job=job,
                              buffer_bytes=None if buffer_kib is None else buffer_kib << 10)
    finally:
        undo_term()
    root = written[0].parent
    console.print(escape(f"cohort written to {root}:"), soft_wrap=True)
    for path in written:
        console.print(f"  {escape(path.name)}", soft_wrap=True)
    console.print("  trust/ (public trust anchors), public/, run/, state/ (one private directory per party)")
    console.print(escape("start each party with `gputravel serve ROLE --config FILE` (docs/deploy.md)"), soft_wrap=True)


@cohort_app.command("identity")
def identity(
    config: Path = typer.Option(..., "--config", help="A holder's or the key broker's TOML file."),
) -> None:
    """Make this party's own identity in its state directory (kept across restarts) and publish its public half."""
    made = make_identity(config)
    what = "certificate SHA-384" if made.what == "certificate" else "key"
    console.print(escape(f"{made.party}: {what} {made.fingerprint} ({'kept from before' if made.kept else 'made now'}"
                         f"), published at {made.published}"), soft_wrap=True)
    console.print(escape(f"tell each holder this {made.what}'s fingerprint yourself: it confirms it with `gputravel job "
                         f"approve {'--signer NAME=SHA384' if made.what == 'certificate' else '--broker FINGERPRINT'}`"),
                  soft_wrap=True)


@cohort_app.command("job")
def set_job_command(
    directory: Path = typer.Argument(..., help="The cohort's directory (`gputravel cohort init`)."),
    manifest: Path = typer.Option(..., help="The job manifest (`gputravel job init --cohort D`), naming each "
                                            "signer's certificate and the key broker as they published them."),
    workload: str = typer.Option("gpt2", help="The workload the manifest pins by name and digest: gpt2, image, "
                                              "tabular, or its .py file."),
) -> None:
    """Make a job manifest the orchestrator's job; each holder then approves it with `gputravel job approve`."""
    from gputravel.manifest import load_manifest  # lazy: pydantic models, for manifests only

    m = load_manifest(manifest)
    for path in set_job(directory, m, job=workload_job(workload)):
        console.print(f"  {escape(path.name)}", soft_wrap=True)
    console.print(escape(f"job {m.digest_hex()}: each holder approves it with `gputravel job approve {manifest} "
                         "--holder-config holder-NAME.toml`"), soft_wrap=True)


def serve_command(
    role: Role = typer.Argument(..., help="Which party this service is: host, gpu, holder, orchestrator or broker."),
    config: Path = typer.Option(..., "--config", help="That party's TOML file, written by `gputravel cohort init`."),
) -> None:
    """Run one party in the foreground until SIGTERM or SIGINT (the orchestrator: until its job ends)."""
    from gputravel.service.serve import serve  # lazy: loads the party's engine (torch for the orchestrator)

    code = serve(role.value, Path(config))
    raise typer.Exit(code or 0)


def _status_table(found: dict) -> Table:
    table = Table(title=f"status of {found['party']} ({found['config']})", show_header=False, pad_edge=False)
    table.add_column("what")
    table.add_column("value")
    for name, state in found["services"].items():
        table.add_row(name, "[green]up[/green]" if state == "up" else escape(state))
    for key, value in found.items():
        if key not in ("services", "party", "config", "running"):
            shown = value if isinstance(value, str) else json.dumps(value)
            table.add_row(escape(key), escape(shown))
    return table


def status_command(
    config: Path = typer.Option(..., "--config", help="Any party's TOML file."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """What this party may know: which services are up, the members, where the GPU is, the travels."""
    found = cohort_status(load_service(config))
    if as_json:
        print(json.dumps(found, indent=2))
        return
    console.print(_status_table(found))
    if not found["running"]:
        console.print("nothing is running: start the services with `gputravel serve ROLE --config FILE`")
