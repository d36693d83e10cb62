"""`gputravel bench train`: the paper's Table 2 for this system, and federated learning beside it.

The same job runs once per method and bandwidth: ``travel`` and ``tls`` (the centralised
baseline) feed the loop in the orchestrator and must give identical losses (G2); ``fl`` is
FedAvg on a real Flower deployment (fl/). docs/benchmarks.md describes each row's fields.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gputravel.bench import holdout
from gputravel.bench.compare import check_links, link_kind, stamp
from gputravel.bench.train_report import check_pair, fl_row, method_row
from gputravel.cohort import capacity
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.local import Cohort
from gputravel.errors import BadInput
from gputravel.fl.config import FedAvgConfig, framework
from gputravel.fl.local import evaluate, load_arrays
from gputravel.fl.run import FlJob, check as check_fl, run_fedavg
from gputravel.jobs.training import TrainingJobConfig, default_holders, layout_for, resolve
from gputravel.net import LINK_NETNS
from gputravel.net.counters import bytes_between, link_bytes
from gputravel.protocol.hardware import EMULATED, hardware_profile
from gputravel.train.job import TrainConfig
from gputravel.train.loop import gpt_config
from gputravel.train.model import GPT
from gputravel.train.rundir import load_checkpoint

METHODS = ("travel", "tls", "fl")
SOURCE = {"travel": "travelling", "tls": "baseline"}  # the training loader of each centralised method


def bench_train_config(steps: int = 600, buffer_bytes: int = 128 << 10, *, n_layer: int = 4, n_embd: int = 128,
                       n_head: int = 4) -> TrainConfig:
    """The job every method runs: a small GPT-2, no sample, and no checkpoint until the end."""
    return TrainConfig(steps=steps, buffer_bytes=buffer_bytes, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                       sample_tokens=0, checkpoint_every=0)


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
        if not 1 <= self.eval_batches <= 256:
            raise BadInput("--eval-batches must be between 1 and 256")
        if self.holder_tokens is not None and self.holder_tokens < 1:
            raise BadInput("--holder-tokens must be positive")
        # What this machine carries, before anything starts: the buffer (travel, tls), the training.
        if set(self.methods) - {"fl"}:
            capacity.check_buffer(self.train.buffer_bytes, "--buffer-kib", 1 << 10)
        capacity.check_memory(self.train.memory_mib(), "the training needs", "use a smaller model or batch")


def run(cfg: TrainBenchConfig, *, on_row: Callable[[dict], None] | None = None) -> dict:
    kind = link_kind(cfg.link)
    if "fl" in cfg.methods:
        framework()  # Flower is installed, before anything starts
        if kind != LINK_NETNS:
            raise BadInput("the FL baseline runs Flower's processes on netns-tc links, which are not available "
                           "here (root, iproute2 and sch_tbf are needed): run without fl, or where namespaces work")
    result = {"link": kind, **stamp(), "methods": list(cfg.methods), "fl_config": cfg.fl.to_dict(),
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
                where = Path(tmp) / f"run-{i}-{method}"
                if method == "fl":
                    rep = run_fedavg(FlJob(job.train, cfg.fl, data.holders, bw, where), fedavg)
                    rows[method] = fl_row(bw, rep, _final_loss(job.train, data, fl_model=rep["model_path"]))
                else:
                    rep, moved = _centralised(job, data, kind, bw, method, where, cfg)
                    rows[method] = method_row(method, bw, rep, moved,
                                              _final_loss(job.train, data, checkpoint=where / "checkpoint.pt"))
                result["rows"].append(rows[method])
                if on_row is not None:
                    on_row(rows[method])
            result["checks"].append(check_pair(bw, rows))
    return result


def _prepare(cfg: TrainBenchConfig, tmp: Path) -> tuple[TrainingJobConfig, holdout.HeldOut]:
    t = cfg.train
    data = holdout.prepare(default_holders(cfg.holders, tmp), tmp, batch=t.batch, seq_len=t.seq_len,
                           eval_batches=cfg.eval_batches, holder_tokens=cfg.holder_tokens, iid=cfg.iid)
    job = resolve(TrainingJobConfig(train=t, holders=tuple(data.holders.items()), run_dir=str(tmp)))
    return job, data


def _centralised(job: TrainingJobConfig, data: holdout.HeldOut, kind: str, bw: float | None, method: str,
                 where: Path, cfg: TrainBenchConfig) -> tuple[dict, dict | None]:
    """One travel or tls run's report, and its holders' link bytes (None on token-bucket links)."""
    t = job.train.replace(loader=SOURCE[method])
    where.mkdir(parents=True)
    holders = tuple(HolderSpec(name, path, "tokens") for name, path in job.holders)
    cohort_cfg = CohortConfig(holders=holders, buffer_bytes=t.buffer_bytes, layout=layout_for(t.buffer_bytes),
                              tokenizer=t.tokenizer, bandwidth_mbit=bw, output_dirs=(str(where),),
                              link="netns" if kind == LINK_NETNS else "token-bucket", workdir=cfg.workdir,
                              hardware=cfg.hardware)
    with Cohort(cohort_cfg) as cohort:
        shaped = cohort.links.shaped
        before = link_bytes(shaped) if shaped is not None else None
        report = cohort.train(t.canonical_json(), str(where.resolve()))
        moved = bytes_between(before, link_bytes(shaped)) if shaped is not None else None
    return report, moved


def _final_loss(t: TrainConfig, data: holdout.HeldOut, *, checkpoint: Path | None = None,
                fl_model: str | None = None) -> float:
    """The final model on the held-out tokens, the same way for every method."""
    model = GPT(gpt_config(t))
    if checkpoint is not None:
        load_checkpoint(checkpoint, model)
    else:
        load_arrays(model, torch.load(fl_model, map_location="cpu", weights_only=True))
    return evaluate(model, data.eval_tokens, t.batch, t.seq_len, t.threads)
