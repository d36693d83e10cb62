"""`gputravel bench train`: the paper's Table 2 for this system.

The same training job (GPT-2 on the holders' tokens, same seed, same schedule) runs once fed
by GPU Travelling and once fed by the centralised TLS baseline, on links of each bandwidth.
Training runs inside the orchestrator CVM either way; only the way each chunk reaches the
dataset buffer differs (``TrainConfig.loader``: "travelling" or "baseline").

Reported per bandwidth and method, as the paper's Table 2: transmission time (the loader's
waits for data: travels, or baseline transfers), training time (the rest of the run), and
the transmission share of the whole. Since both methods put the same bytes in the buffer,
the losses must be identical; the result says whether they were.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from gputravel.errors import BadInput
from gputravel.net import LINK_NETNS
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.local import Cohort
from gputravel.jobs.training import TrainingJobConfig, default_holders, layout_for, resolve
from gputravel.train.loop import TrainConfig
from gputravel.bench.compare import link_kind, machine

SOURCES = ("travelling", "baseline")

#: The paper's Table 2 (llm.c GPT-2, one 512 MiB transmission): training (s), Tx (s), Tx share.
PAPER_TABLE2 = {
    4.0: {"baseline": (1230.00, 1115.88, 0.47568), "travelling": (1230.26, 1.01, 0.00082)},
    20.0: {"baseline": (1231.39, 230.84, 0.15787), "travelling": (1229.39, 1.03, 0.00084)},
    100.0: {"baseline": (1231.17, 60.36, 0.04674), "travelling": (1230.57, 1.02, 0.00083)},
    500.0: {"baseline": (1230.73, 15.86, 0.01272), "travelling": (1229.67, 0.98, 0.00080)},
    None: {"baseline": (1229.36, 7.34, 0.00594), "travelling": (1231.46, 0.98, 0.00079)},
}


def bench_train_config(steps: int = 600, buffer_bytes: int = 128 << 10) -> TrainConfig:
    """The job both methods feed: a small GPT-2 (4 layers, 128 wide), no sample at the end."""
    return TrainConfig(steps=steps, buffer_bytes=buffer_bytes, n_layer=4, n_head=4, n_embd=128, sample_tokens=0)


@dataclass(frozen=True)
class TrainBenchConfig:
    bandwidths: tuple[float | None, ...]
    train: TrainConfig = field(default_factory=bench_train_config)
    holders: int = 3  # the shipped Shakespeare presses, one holder each
    link: str = "auto"
    workdir: str | None = None

    def __post_init__(self) -> None:
        if not self.bandwidths or any(b is not None and not 0 < b <= 100_000 for b in self.bandwidths):
            raise BadInput("bandwidths must be in (0, 100000] Mbit/s, or 'uncapped'")
        if self.link not in ("auto", "netns", "token-bucket"):
            raise BadInput("--link must be auto, netns or token-bucket")


def run(cfg: TrainBenchConfig, *, on_row: Callable[[dict], None] | None = None) -> dict:
    kind = link_kind(cfg.link)
    result = {"link": kind, "machine": machine(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "config": cfg.train.to_dict(), "rows": []}
    with tempfile.TemporaryDirectory(prefix="gputravel-train-bench-", dir=cfg.workdir) as tmp:
        job = resolve(TrainingJobConfig(train=cfg.train, holders=default_holders(cfg.holders, Path(tmp)), run_dir=tmp))
        for bw in cfg.bandwidths:
            runs = {src: _one(job, kind, bw, src, cfg.workdir) for src in SOURCES}
            row = _row(bw, runs)
            result["rows"].append(row)
            if on_row is not None:
                on_row(row)
    return result


def _one(job: TrainingJobConfig, kind: str, bw: float | None, source: str, workdir: str | None) -> dict:
    t = replace(job.train, loader=source)
    holders = tuple(HolderSpec(name, path, "tokens") for name, path in job.holders)
    cohort_cfg = CohortConfig(holders=holders, buffer_bytes=t.buffer_bytes, layout=layout_for(t.buffer_bytes),
                              tokenizer=t.tokenizer, bandwidth_mbit=bw,
                              link="netns" if kind == LINK_NETNS else "token-bucket", workdir=workdir)
    with Cohort(cohort_cfg) as cohort:
        return cohort.train(json.dumps(t.to_dict()))


def summarise(report: dict) -> dict:
    """Table 2's columns from one training report: transmission = the loader's waits for data."""
    tx = report["stall_s"]
    wall = report["wall_s"]
    return {"training_s": wall - tx, "tx_s": tx, "tx_share": tx / wall if wall else 0.0,
            "fetches": report["travel_count"], "final_loss": report["final_loss"]}


def _row(bw: float | None, runs: dict[str, dict]) -> dict:
    row = {"bandwidth_mbit": bw, **{src: summarise(rep) for src, rep in runs.items()}}
    row["same_losses"] = runs["travelling"]["losses"] == runs["baseline"]["losses"]
    paper = PAPER_TABLE2.get(None if bw is None else float(bw))
    row["paper"] = None if paper is None else {
        src: {"training_s": v[0], "tx_s": v[1], "tx_share": v[2]} for src, v in paper.items()}
    return row
