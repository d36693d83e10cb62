"""`gputravel bench train`: the paper's Table 2 for this system, and federated learning beside it.

The same job runs once per method and bandwidth: ``travel`` and ``tls`` (the centralised
baseline) feed the loop in the orchestrator and must give identical losses (G2); ``fl`` is
FedAvg on a real Flower deployment (fl/). docs/benchmarks.md describes each row's fields.

``workload`` (issue 27): GPT-2 on the Shakespeare presses, or a records workload (image,
tabular) on its shipped records dealt to the holders, each scored on every holder's held-out
records. ``local_dataloader`` is the reference step time: the same model on the same records
through a plain torch DataLoader from local disk, in the same run (bench/local_reference.py),
measured again just before each method (``runs_step_ms``; a row's ``local_step_ms``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gputravel.bench import holdout, local_reference
from gputravel.bench.compare import check_links, link_kind, stamp
from gputravel.bench.train_report import check_pair, fl_row, method_row
from gputravel.cohort import capacity
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.local import Cohort
from gputravel.errors import BadInput
from gputravel.fl.config import FedAvgConfig, framework
from gputravel.files import RECORDS, TOKENS
from gputravel.fl.local import evaluate, held_out_metrics, load_arrays
from gputravel.fl.run import FlJob, check as check_fl, run_fedavg
from gputravel.jobs.training import TrainingJobConfig, default_holders, layout_for, resolve
from gputravel.net import LINK_NETNS
from gputravel.net.counters import bytes_between, link_bytes
from gputravel.protocol.hardware import EMULATED, hardware_profile
from gputravel.train.job import TrainConfig
from gputravel.train.loop import build_model, gpt_config
from gputravel.train.model import GPT
from gputravel.train.rundir import load_checkpoint
from gputravel.workloads import SHIPPED

METHODS = ("travel", "tls", "fl")
SOURCE = {"travel": "travelling", "tls": "baseline"}  # the training loader of each centralised method
RECORD_STEPS, RECORD_BATCH = 300, 32  # a records workload's job: its shipped data is a few hundred records a holder


def bench_train_config(steps: int = 600, buffer_bytes: int = 128 << 10, *, n_layer: int = 4, n_embd: int = 128,
                       n_head: int = 4) -> TrainConfig:
    """The job every method runs: a small GPT-2, no sample, and no checkpoint until the end."""
    return TrainConfig(steps=steps, buffer_bytes=buffer_bytes, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                       sample_tokens=0, checkpoint_every=0)


def records_train_config(workload: str, steps: int = RECORD_STEPS, buffer_bytes: int = 128 << 10) -> TrainConfig:
    """A records workload's job: the workload's own model, batches of 32 records, no checkpoint until the end.
    One thread: a model this small gains nothing from two, and two stall whenever another process
    holds one of a shared machine's two cores (steps of a few ms took 3-7x longer, 2026-11-29)."""
    return TrainConfig(workload=workload, steps=steps, batch=RECORD_BATCH, buffer_bytes=buffer_bytes,
                       sample_tokens=0, checkpoint_every=0, threads=1)


def workload_config(workload: str, steps: int | None, buffer_bytes: int) -> TrainConfig:
    """`--workload`'s job: GPT-2 as before (600 steps), or a records workload (300 steps)."""
    if workload not in SHIPPED:
        raise BadInput(f"--workload takes {', '.join(SHIPPED)}, got {workload!r}")
    if workload == "gpt2":
        return bench_train_config(600 if steps is None else steps, buffer_bytes)
    return records_train_config(workload, RECORD_STEPS if steps is None else steps, buffer_bytes)


def parse_methods(text: str) -> tuple[str, ...]:
    """'travel,tls,fl' -> ("travel", "tls", "fl"), in that order, each once."""
    asked = [m.strip().lower() for m in text.split(",") if m.strip()]
    bad = [m for m in asked if m not in METHODS]
    if bad or not asked:
        raise BadInput(f"--methods takes {', '.join(METHODS)} (comma separated), got {text!r}")
    return tuple(m for m in METHODS if m in asked)


@dataclass(frozen=True)
class TrainBenchConfig:
    bandwidths: tuple[float | None, ...]
    train: TrainConfig = field(default_factory=bench_train_config)
    holders: int = 3  # the shipped Shakespeare presses, one holder each
    link: str = "auto"
    workdir: str | None = None
    methods: tuple[str, ...] = ("travel", "tls")
    fl: FedAvgConfig = field(default_factory=FedAvgConfig)
    eval_batches: int = 4  # held-out batches per holder, for final_loss
    holder_tokens: int | None = None  # cut every holder's training tokens to this many
    iid: bool = False  # deal the holders' tokens out again, mixed (the FL loss-gap control)
    hardware: str = EMULATED  # protocol/hardware.py: travel and tls runs only (FedAvg moves no GPU)

    def __post_init__(self) -> None:
        check_links(self.bandwidths, self.link)
        if not self.methods or any(m not in METHODS for m in self.methods):
            raise BadInput(f"--methods takes {', '.join(METHODS)}")
        hardware_profile(self.hardware)  # BadInput for an unknown profile
        if self.train.records and (self.holder_tokens is not None or self.iid):
            raise BadInput("--holder-tokens and --iid deal GPT-2's tokens; a records workload's holders keep their records")
        if not 1 <= self.eval_batches <= 256:
            raise BadInput("--eval-batches must be between 1 and 256")
        if self.holder_tokens is not None and self.holder_tokens < 1:
            raise BadInput("--holder-tokens must be positive")
        # What this machine carries, before anything starts: the buffer (travel, tls), the training.
        if set(self.methods) - {"fl"}:
            capacity.check_buffer(self.train.buffer_bytes, "--buffer-kib", 1 << 10)
        need = self.train.memory_mib()
        capacity.check_memory(need, "the training needs", "use a smaller model or batch")


def run(cfg: TrainBenchConfig, *, on_row: Callable[[dict], None] | None = None) -> dict:
    kind = link_kind(cfg.link)
    if "fl" in cfg.methods:
        framework()  # Flower is installed, before anything starts
        if kind != LINK_NETNS:
            raise BadInput("the FL baseline runs Flower's processes on netns-tc links, which are not available "
                           "here (root, iproute2 and sch_tbf are needed): run without fl, or where namespaces work")
    result = {"link": kind, **stamp(), "workload": cfg.train.workload, "methods": list(cfg.methods),
              "fl_config": cfg.fl.to_dict(),
              "eval_batches": cfg.eval_batches, "holder_tokens": cfg.holder_tokens, "iid": cfg.iid,
              "hardware": hardware_profile(cfg.hardware).to_json(), "rows": [], "checks": []}
    with tempfile.TemporaryDirectory(prefix="gputravel-train-bench-", dir=cfg.workdir) as tmp:
        job, data = _prepare(cfg, Path(tmp))
        fedavg = check_fl(FlJob(job.train, cfg.fl, data.holders, None, Path(tmp))) if "fl" in cfg.methods else None
        result.update(config=job.train.to_dict(), holders_train_tokens=data.train_tokens,
                      fl_plan=None if fedavg is None else fedavg.to_dict())
        for i, bw in enumerate(cfg.bandwidths):
            rows = {}
            for method in cfg.methods:
                # The reference just before each method: on a shared machine the load drifts between runs.
                local = local_reference.measure(job.train, job.holders, data)
                result.setdefault("local_dataloader", {**local, "runs_step_ms": []})["runs_step_ms"].append(
                    local["step_ms"])
                rows[method] = row = _method(cfg, job, data, kind, bw, method, Path(tmp) / f"run-{i}-{method}", fedavg)
                row["local_step_ms"] = local["step_ms"]
                row["step_ms_vs_local"] = row["step_ms"] / local["step_ms"] if row["step_ms"] and local["step_ms"] else None
                result["rows"].append(row)
                if on_row is not None:
                    on_row(rows[method])
            result["checks"].append(check_pair(bw, rows))
    return result


def _method(cfg: TrainBenchConfig, job: TrainingJobConfig, data: holdout.HeldOut, kind: str, bw: float | None,
            method: str, where: Path, fedavg) -> dict:
    """One method's row at one bandwidth."""
    if method == "fl":
        rep = run_fedavg(FlJob(job.train, cfg.fl, data.holders, bw, where), fedavg)
        return fl_row(bw, rep, _final_metrics(job, data, fl_model=rep["model_path"]))
    rates: list[float] = []
    rep, moved = _centralised(job, data, kind, bw, method, where, cfg, on_step=lambda e: rates.append(e.tokens_per_s))
    step_ms = local_reference.median_step_ms(local_reference.step_seconds(job.train, rates))
    return method_row(method, bw, rep, moved, _final_metrics(job, data, checkpoint=where / "checkpoint.pt"), step_ms)


def _prepare(cfg: TrainBenchConfig, tmp: Path) -> tuple[TrainingJobConfig, holdout.HeldOut]:
    t = cfg.train
    if t.records:  # each holder keeps its records whole; its CVM holds out its share (files.EVAL_SHARE)
        data = holdout.prepare_records(default_holders(cfg.holders, tmp, t.workload))
        return resolve(TrainingJobConfig(train=t, holders=tuple(data.holders.items()), run_dir=str(tmp))), data
    data = holdout.prepare(default_holders(cfg.holders, tmp), tmp, batch=t.batch, seq_len=t.seq_len,
                           eval_batches=cfg.eval_batches, holder_tokens=cfg.holder_tokens, iid=cfg.iid)
    job = resolve(TrainingJobConfig(train=t, holders=tuple(data.holders.items()), run_dir=str(tmp)))
    return job, data


def _centralised(job: TrainingJobConfig, data: holdout.HeldOut, kind: str, bw: float | None, method: str,
                 where: Path, cfg: TrainBenchConfig, on_step=None) -> tuple[dict, dict | None]:
    """One travel or tls run's report, and its holders' link bytes (None on token-bucket links)."""
    t = job.train.replace(loader=SOURCE[method])
    where.mkdir(parents=True)
    holders = tuple(HolderSpec(name, path, RECORDS if t.records else TOKENS) for name, path in job.holders)
    cohort_cfg = CohortConfig(holders=holders, buffer_bytes=t.buffer_bytes, layout=layout_for(t.buffer_bytes),
                              tokenizer="" if t.records else t.tokenizer, schema=t.record_schema,
                              bandwidth_mbit=bw, output_dirs=(str(where),),
                              link="netns" if kind == LINK_NETNS else "token-bucket", workdir=cfg.workdir,
                              hardware=cfg.hardware)
    with Cohort(cohort_cfg) as cohort:
        shaped = cohort.links.shaped
        before = link_bytes(shaped) if shaped is not None else None
        report = cohort.train(t.canonical_json(), str(where.resolve()), on_step=on_step)
        moved = bytes_between(before, link_bytes(shaped)) if shaped is not None else None
    return report, moved


def _final_metrics(job: TrainingJobConfig, data: holdout.HeldOut, *, checkpoint: Path | None = None,
                   fl_model: str | None = None) -> dict:
    """The final model on the held-out data, the same way for every method: {"loss"} for GPT-2 on
    its held-out tokens; a records workload's metrics per holder and over all ("per_holder", "all")."""
    t = job.train
    model = build_model(t, "cpu")[0] if t.records else GPT(gpt_config(t))
    if checkpoint is not None:
        load_checkpoint(checkpoint, model)
    else:
        load_arrays(model, torch.load(fl_model, map_location="cpu", weights_only=True))
    if t.records:
        return held_out_metrics(t, model, job.holders)
    return {"all": {"loss": evaluate(model, data.eval_tokens, t.batch, t.seq_len, t.threads)}}
