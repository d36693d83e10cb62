"""`gputravel demo`: the training job (jobs/training.py), with a live view."""

from __future__ import annotations

import math

import functools
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import typer
from rich.console import Group
from rich.live import Live
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.markup import escape
from rich.table import Table

from gputravel.cohort.capacity import MAX_BUFFER_MIB, MIB, check_buffer
from gputravel.errors import BadInput, number_in
from gputravel.protocol.control import STEPS
from gputravel.cli.hardware import hardware_option
from gputravel.cli.output import (check_output_dir, check_output_file, console, fail, make_output_dir, name_values,
                                  write_results)
from gputravel.manifest import Recipient, load_manifest
from gputravel.release.keys import load_public_key
from gputravel.train.job import WORKLOADS, TrainConfig

JOB = TrainConfig()  # the options' defaults are the job's (train/job.py)

# The most --steps a run may ask for: days of training even on a GPU (the demo does 300).
MAX_STEPS = 10_000_000
STEP_NAMES = {"o_cleanup": "scrub", "o_export": "O export (during the scrub)", "dh_switch": "switch to H (wait)", "dh_import": "H import",
              "dh_copy": "H copy", "dh_export": "H export", "tls": "TLS", "o_switch": "switch to O (wait)",
              "o_import": "O import", "o_rotate": "rotate"}


def _holder_data(items: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise BadInput(f"--holder-data takes NAME=PATH (shards directory, one .bin shard or text), got {item!r}")
        out.append((name, path))
    return tuple(out)


def workload_job(value: str) -> dict[str, str]:
    """--workload: a shipped workload's name, or a .py file whose text becomes part of the job."""
    if value in WORKLOADS:
        return {"workload": value}
    path = Path(value)
    if path.suffix != ".py" or not path.is_file():
        raise BadInput(f"--workload takes one of {', '.join(WORKLOADS)} or a workload .py file, got {value!r}")
    return {"workload": path.stem, "workload_code": path.read_text()}


def _script(path: Path, data: str, own_data: bool) -> dict[str, object]:
    if path.suffix != ".py" or not path.is_file():
        raise BadInput(f"--script takes a Python file, got {str(path)!r}")
    if data == "gpt2" and not own_data:
        raise BadInput("--script trains on records: name the demo data with --workload image or tabular, "
                       "or give --holder-data record datasets")
    return {"workload": path.stem, "workload_code": path.read_text(), "script": True}


def training_job(
    workload: str = typer.Option(JOB.workload, help="What trains: gpt2 (tokens), image (a CNN on 8x8 digits), tabular (an MLP on tumour records), or a workload .py file (docs/workloads.md)."),
    script: Optional[Path] = typer.Option(None, help="Your own training script as the job: its loop unchanged, its data loader gputravel.workloads.script.batches() (docs/workloads.md); --workload then names the demo data."),
    eval_every: int = typer.Option(JOB.eval_every, help="Evaluate on the holders' held-out records every N steps (records workloads; always at the end)."),
    holders: int = typer.Option(3, help="Data holders (one CVM process each); the demo data is split among them."),
    holder_data: list[str] = typer.Option([], "--holder-data", help="NAME=PATH of a holder's llm.c shards or text, or its record dataset (`gputravel data pack`) (repeatable; replaces the demo data)."),
    steps: int = typer.Option(JOB.steps, help="Training steps."),
    batch: int = typer.Option(JOB.batch, help="Batch size B."),
    seq_len: int = typer.Option(JOB.seq_len, help="Sequence length T."),
    buffer_mib: float = typer.Option(JOB.buffer_bytes / MIB, help="Dataset buffer in the GPU's protected memory, MiB (a multiple of 4 KiB, at most 1024, and what this machine's memory holds)."),
    schedule: str = typer.Option(JOB.schedule, help="Which holder the GPU visits next: round_robin or proportional."),
    seed: int = typer.Option(JOB.seed, help="Seed of the model initialisation and the sample."),
    loader: str = typer.Option(JOB.loader, help="travelling (GPU travels to holders) or local (same tokens from disk: the G2 reference)."),
    threads: int = typer.Option(JOB.threads, help="CPU threads for training (same value, same losses)."),
    run_dir: Optional[Path] = typer.Option(None, help="Where report.json, metrics.csv, loss.png, the checkpoint and the sample go (default runs/<time>)."),
    checkpoint_every: int = typer.Option(JOB.checkpoint_every, help="Save a checkpoint every N steps (and at the end); 0: only at the end."),
    resume: bool = typer.Option(False, help="Continue the run in --run-dir from its checkpoint (same options as the first run)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the report here."),
    hardware: str = hardware_option(),
    gpus: int = typer.Option(1, help="GPUs (data-parallel ranks, one orchestrator CVM each); each travels to its share of the holders."),
    servers: bool = typer.Option(False, help="With --gpus: each GPU on an emulated server of its own (network namespaces; needs root), the ranks joined by shaped links."),
    server_mbit: Optional[float] = typer.Option(None, help="With --servers: cap of each server's link to the others, Mbit/s (default uncapped)."),
    ddp_compress: str = typer.Option(JOB.ddp_compress, help="With --gpus: cast the gradients to fp16 or bf16 before the sealed all-reduce (half the bytes sealed and sent; other numerics); none: off."),
    release_to: list[str] = typer.Option([], "--release-to", help="NAME=PUBFILE: release the model to this recipient (NAME.pub from `gputravel model keygen`) once a quorum of holders signs; repeatable. Without it the model stays sealed. One GPU, travelling or baseline loader only: with --gpus > 1 or --loader local the job runs without a manifest."),
    quorum: Optional[int] = typer.Option(None, help="How many holders must sign the release (k of n; default a majority)."),
    decline: list[str] = typer.Option([], "--decline", help="HOLDER: this holder declines to sign the release (repeatable)."),
    epsilon_cap: list[str] = typer.Option([], "--epsilon-cap", help="HOLDER=EPSILON: the privacy budget this holder sets on its data (its [policy] epsilon_cap): a job that would spend more is refused before anything travels (repeatable)."),
    manifest: Optional[Path] = typer.Option(None, help="Run this job manifest (`gputravel job init`) instead of one built from these options; its job must be this demo's."),
    dp_epsilon: float = typer.Option(JOB.dp_epsilon, help="Train with DP-SGD (Opacus) to this target epsilon over the holders' records (records workloads, one GPU, every record in the buffer; docs/privacy.md); 0: off."),
    dp_delta: float = typer.Option(JOB.dp_delta, help="With --dp-epsilon: the delta the epsilon is stated at."),
    dp_clip: float = typer.Option(JOB.dp_max_grad_norm, help="With --dp-epsilon: each record's gradient clipped to this L2 norm."),
    dp_accountant: str = typer.Option(JOB.dp_accountant, help="With --dp-epsilon: the accountant counting the privacy spent: rdp or prv (gdp is refused: it can underestimate)."),
    lr: float = typer.Option(JOB.lr, help="Peak learning rate (warm-up, then cosine decay). A DP job needs a larger one: docs/privacy.md."),
    resident_mib: int = typer.Option(JOB.resident_mib, help="MiB of travelled records the orchestrator keeps in its own memory for the job's steps, so a visit kept trains again without travelling (docs/training.md); 0: every visit travels."),
    shuffle: str = typer.Option(JOB.shuffle, help="Records: visit (shuffled within each travel) or all (one shuffle over every holder's records an epoch, as DataLoader(shuffle=True) draws it; --resident-mib must hold them all)."),
) -> None:
    """Train a workload (GPT-2 by default) on the holders' data, fed by a travelling GPU.

    A local cohort runs (host, GPU, orchestrator, holders, key broker as processes); the orchestrator
    trains on each chunk the GPU brings back from a holder. On one GPU the job runs under a manifest
    every holder approves: checkpoints and model sealed, the model released by a quorum of holders."""
    from gputravel.jobs.training import (  # lazy: torch, about a second, which the other commands do without
        TrainingJobConfig, check_capacity, default_holders, run_training_job)

    if resume and run_dir is None:
        fail(BadInput("--resume needs the --run-dir of the run to continue"))
    out = run_dir or Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    # Every value checked, and the job against this machine, before anything starts.
    check_output_dir(out, "--run-dir")
    check_output_file(json_path, "--json")
    if steps > MAX_STEPS:  # the job takes any positive count
        raise BadInput(f"--steps must be at most {MAX_STEPS:,}, got {steps}")
    number_in(buffer_mib, "--buffer-mib", high=MAX_BUFFER_MIB, unit=" MiB")
    if loader != "local":  # in the GPU's protected memory: whole pages (the local loader reads from disk)
        check_buffer(round(buffer_mib * MIB), "--buffer-mib", given=buffer_mib)
    cfg = TrainingJobConfig(
        train=JOB.replace(steps=steps, batch=batch, seq_len=seq_len, buffer_bytes=round(buffer_mib * MIB),
                          schedule=schedule, seed=seed, loader=loader, threads=threads,
                          checkpoint_every=checkpoint_every, eval_every=eval_every, ddp_compress=ddp_compress,
                          dp_epsilon=dp_epsilon, dp_delta=dp_delta, dp_max_grad_norm=dp_clip,
                          dp_accountant=dp_accountant, lr=lr, resident_mib=resident_mib, shuffle=shuffle,
                          **(_script(script, workload, bool(holder_data)) if script else workload_job(workload))),  # BadInput naming the flag
        holders=_holder_data(holder_data) if holder_data else default_holders(holders, out, workload),
        run_dir=str(out), resume=resume, hardware=hardware, gpus=gpus,
        servers=servers, server_mbit=server_mbit, **_release_options(release_to, quorum, decline, manifest), caps=_caps(epsilon_cap))
    mechanism = check_capacity(cfg)  # a DP job's mechanism: the live view counts its epsilon
    make_output_dir(out, "--run-dir")  # last, as it creates the directory: writable before the run
    names = ", ".join(n for n, _ in cfg.holders)
    what = (f"GPT-2 ({cfg.train.n_layer} layers, {cfg.train.n_embd} wide), {steps} steps of {batch}x{seq_len} tokens"
            if not cfg.train.records else f"the script {script}, batches of {batch} records" if script
            else f"the {cfg.train.workload} workload, {steps} steps of {batch} records")
    console.print(f"[bold]gputravel demo[/bold]: {what}, {loader} loader, holders: {names}; "
                  f"buffer {cfg.train.buffer_bytes >> 10} KiB in the GPU's protected memory.")
    if gpus > 1:
        from gputravel.jobs.training import shares_of  # lazy: torch, as above

        shares = "; ".join(f"GPU {k}: {', '.join(s)}" for k, s in enumerate(shares_of(cfg)))
        console.print(f"{gpus} GPUs train as the ranks of one data-parallel job (encrypted ring all-reduce); {shares}.")
    if loader == "travelling":
        console.print("Booting host, GPU, holders, then the orchestrator (paper 4.1)..." if gpus == 1 else
                      "Booting each GPU's host route, GPU, holders and orchestrator rank (paper 4.1, 9)...")
    view = _LiveView(steps, "records/s" if cfg.train.records else "tokens/s", _epsilon_of(mechanism))
    with Live(view.render(), console=console, refresh_per_second=8, transient=False) as live:
        report = run_training_job(cfg, on_step=lambda e: view.update(e, live))
    if cfg.train.dp_epsilon and report.get("dp"):  # the same job without DP: the accuracy DP gave up (seconds)
        from gputravel.jobs.training import non_private_reference  # lazy: torch, as above

        console.print("Training the same job without DP (--loader local) for comparison...")
        report["dp"]["non_private"] = non_private_reference(cfg)
    _summary(report, out)
    write_results(json_path, report, "report also")


def _release_options(release_to: list[str], quorum: Optional[int], decline: list[str],
                     manifest: Optional[Path]) -> dict:
    """TrainingJobConfig's issue-28 fields from the demo's flags (BadInput naming the flag)."""
    return {"release_to": tuple(_recipient(item) for item in release_to), "quorum": quorum,
            "decline": tuple(decline), "manifest": load_manifest(manifest) if manifest is not None else None}


def _caps(items: list[str]) -> tuple[tuple[str, float], ...]:
    """--epsilon-cap HOLDER=EPSILON, each holder once."""
    out: dict[str, float] = {}
    for name, value in name_values(items, "--epsilon-cap").items():
        try:
            out[name] = float(value)
        except ValueError:
            out[name] = math.nan
        if not out[name] > 0:
            raise BadInput(f"--epsilon-cap takes HOLDER=EPSILON, a positive number, got {name}={value}")
    return tuple(out.items())


def _recipient(item: str) -> Recipient:
    """--release-to NAME=PUBFILE: a recipient and its raw X25519 key (`gputravel model keygen`'s NAME.pub)."""
    name, sep, file = item.partition("=")
    if not sep or not name or not file:
        raise BadInput(f"--release-to takes NAME=PUBFILE (NAME.pub from `gputravel model keygen`), got {item!r}")
    try:
        return Recipient.of(name, load_public_key(Path(file)))
    except BadInput as exc:
        raise BadInput(f"--release-to {name}: {str(exc).splitlines()[0]}") from None


def _epsilon_of(mechanism):
    """ε spent after k steps, for the live view of a DP job (None: no DP)."""
    if mechanism is None:
        return None
    from gputravel.train.privacy import epsilon_after  # lazy: opacus, for DP jobs only

    return functools.partial(epsilon_after, mechanism)


class _LiveView:
    def __init__(self, steps: int, unit: str = "tokens/s", epsilon_after=None) -> None:
        self.unit = unit
        self.epsilon_after, self.every, self.steps = epsilon_after, max(1, steps // 50), steps
        self.progress = Progress(TextColumn("training"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
                                 TimeElapsedColumn())
        self.task = self.progress.add_task("train", total=steps)
        self.last = None
        self.evaluated: dict = {}
        self.epsilon: float | None = None
        self._shown = 0.0

    def update(self, event, live: Live) -> None:
        self.last = event
        self.evaluated = getattr(event, "evaluated", None) or self.evaluated
        done = event.step + 1
        if self.epsilon_after is not None and (done % self.every == 0 or done == self.steps):  # a query is slow
            self.epsilon = self.epsilon_after(done)
        self.progress.update(self.task, completed=event.step + 1)
        now = time.monotonic()
        if now - self._shown > 0.1:  # redraw at most ten times a second
            self._shown = now
            live.update(self.render())

    def render(self):
        table = Table.grid(padding=(0, 2))
        for _ in range(6):
            table.add_column(justify="right")
        e = self.last
        if e is None:
            table.add_row("loss", "-", self.unit, "-", "GPU last at", "-")
        else:
            table.add_row("loss", f"{e.loss:.4f}", self.unit, f"{e.tokens_per_s:,.0f}", "GPU last at", e.holder)
            table.add_row("step", str(e.step + 1), "travels", str(e.travels), "time travelling", f"{e.stall_share:.2%}")
        if self.epsilon is not None:
            table.add_row("epsilon", f"{self.epsilon:.3f}", "", "", "", "")
        if self.evaluated:  # the held-out metrics at the last evaluation, per holder and over all
            table.add_row("held-out", "", "", "", "", "")
            for who in dict.fromkeys(k.rpartition(".")[0] for k in self.evaluated):
                shown = [(k.rpartition(".")[2], v) for k, v in self.evaluated.items() if k.rpartition(".")[0] == who]
                cells = [c for name, v in shown[:2] for c in (name, f"{v:.2%}" if name == "accuracy" else f"{v:.4f}")]
                table.add_row(who, *cells, *[""] * (5 - len(cells)))
        return Panel(Group(self.progress, table), title="GPU Travelling: training", expand=False)


def _summary(report: dict, out: Path) -> None:
    med = report.get("travel_median_steps_ms") or {}
    travels = [t for t in report["travels"] if "total_ms" in t]
    if med and travels:
        table = Table(title=f"A travel, step by step\n(median ms of {len(travels)})")
        table.add_column("step")
        table.add_column("ms", justify="right")
        for key in [k for k in STEPS if k in med] or sorted(med):  # a baseline run has its own steps
            table.add_row(STEP_NAMES.get(key, key), f"{med[key]:.2f}")
        totals = sorted(t["total_ms"] for t in travels)
        table.add_row("[bold]total[/bold]", f"[bold]{totals[len(totals) // 2]:.2f}[/bold]")
        console.print(table)
    console.print(f"loss {report['loss_before']:.3f} -> {report['loss_after']:.3f} (means of the first and last 10 steps); "
                  f"data stall {report['stall_share']:.2%} of {report['wall_s']:.1f} s "
                  f"({report['travel_count']} fetches; {report.get('first_pass_s', 0.0) * 1e3:.0f} ms of it each "
                  "holder's first travels).")
    if report.get("eval"):
        table = Table(title="Held-out evaluation (each holder's own records, never trained on)")
        keys = [k for k in report["eval"]["all"] if k != "records"]
        for col in ("holder", *keys, "records"):
            table.add_column(col, justify="left" if col == "holder" else "right")
        rows = [*report["eval"]["per_holder"].items(), ("all holders", report["eval"]["all"])]
        for name, m in rows:
            table.add_row(name, *[f"{m[k]:.2%}" if k == "accuracy" else f"{m[k]:.4f}" for k in keys], str(m["records"]))
        console.print(table)
    if report.get("sample"):
        console.print(Panel(report["sample"].strip() or "(empty)", title="sample", expand=False))
    for r in report.get("ranks", ()):
        console.print(f"GPU {r['gpu']}: {r['travel_count']} fetches from {', '.join(r['holders'])}; "
                      f"its last batch loss {r['final_loss']:.3f}; travel log {r['audit_log']}")
    _dp_summary(report)
    iso = report.get("isolation")
    if iso is not None:  # a travelling run: what kept the emulated CVMs apart
        parties = len(iso["parties"])
        console.print(f"process isolation on: {parties} parties, each its own uid, non-dumpable" if iso["on"]
                      else f"[yellow]process isolation OFF[/yellow]: {iso['reason']}")
    files = ", ".join(p.name for p in sorted(out.iterdir()) if p.is_file())
    console.print(f"run directory {out}: {files}")
    _release_summary(report)


def _dp_summary(report: dict) -> None:
    """The privacy spent, and what it cost beside the same job without DP."""
    dp = report.get("dp")
    if not dp:
        return
    console.print(f"DP-SGD: epsilon {dp['epsilon_spent']:.3f} spent of {dp['target_epsilon']:g} at delta "
                  f"{dp['delta']:g} ({dp['accountant']} accountant; noise multiplier {dp['noise_multiplier']:.3f}, "
                  f"each of the {dp['records']} records sampled with probability {dp['sample_rate']:.4f}, "
                  f"gradients clipped to {dp['max_grad_norm']:g}).")
    private = (report.get("eval") or {}).get("all", {}).get("accuracy")
    public = (dp.get("non_private") or {}).get("accuracy")
    if private is not None and public is not None:
        console.print(f"held-out accuracy {private:.2%} with DP (epsilon {dp['epsilon_spent']:.2f}), "
                      f"{public:.2%} without (the same job, --loader local)")


def _release_summary(report: dict) -> None:
    """Who signed the release, who declined, and where the model is (never a key)."""
    job, release = report.get("manifest"), report.get("release")
    if not job or not isinstance(release, dict):
        return
    files = release.get("files", {})
    if job["model"] == "sealed":  # nothing was asked of the holders: say how to release it instead
        console.print(f"job {job['digest'][:16]}... approved by every holder; the model stays sealed to the "
                      f"orchestrator: {escape(files.get('sealed', ''))}")
        console.print("release it to a recipient with --release-to NAME=PUBFILE (`gputravel model keygen NAME`)")
        return
    console.print(f"job {job['digest'][:16]}... approved by every holder; {len(release['signed'])} of "
                  f"{len(job['holders'])} signed the release (quorum {job['quorum']}): {', '.join(release['signed']) or 'none'}")
    for name, why in sorted(release["declined"].items()):
        console.print(f"  {escape(name)} declined: {escape(why)}")
    if release.get("released_to") and "release" in files:
        names = ", ".join(release["released_to"])
        console.print(f"model released to {names}: {escape(files['release'])}")
        console.print(escape(f"open it with: gputravel model open {files['release']} --key NAME.key --out model.pt"))
    elif "sealed" in files:
        console.print(f"model sealed to the orchestrator (short of the quorum): {escape(files['sealed'])}")


