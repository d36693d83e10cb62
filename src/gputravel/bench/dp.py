"""`gputravel bench dp` (issue 29): what DP-SGD costs in utility, at each target epsilon.

Every row trains the same job on the workload's shipped data, with the local loader (the G2
reference: travelling draws the same samples, so trains the same model, given the same key), and
scores it on the holders' held-out records; the non-private row (epsilon "inf") is the same job
without DP. Each epsilon runs `repeats` times, with the seeds 0, 1, ...: accuracy is their mean.
The DP key is fixed per seed so that a rerun gives the same numbers: a benchmark, not a release.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from gputravel.bench.compare import parse_list, stamp
from gputravel.data.records import common_schema
from gputravel.errors import BadInput
from gputravel.train.job import TrainConfig
from gputravel.train.loader import LocalSource
from gputravel.train.loop import train

SHIPPED = ("image", "tabular")


def parse_epsilons(text: str) -> tuple[float | None, ...]:
    """"1,3,8,inf" -> (1.0, 3.0, 8.0, None): None is the non-private run."""
    out = parse_list(text.lower(), lambda x: None if x in ("inf", "none") else float(x),
                     f"--epsilons: expected numbers or inf, got {text!r}")
    if any(e is not None and not 0 < e < math.inf for e in out):
        raise BadInput(f"--epsilons: expected positive numbers or inf, got {text!r}")
    if not out:
        raise BadInput("--epsilons: expected at least one epsilon (e.g. 1,3,8,inf)")
    return out


@dataclass(frozen=True)
class DpBenchConfig:
    epsilons: tuple[float | None, ...]
    workload: str = "tabular"
    holders: int = 3
    steps: int = 150
    batch: int = 128  # the expected batch: each record sampled with probability batch / N
    lr: float = 0.1  # AdamW under DP noise needs a far larger step than the demo's 1e-3 (docs/privacy.md)
    warmup_steps: int = 10
    clip: float = 1.0
    delta: float = 1e-5
    accountant: str = "rdp"
    repeats: int = 3
    buffer_bytes: int = 256 << 10  # every training record resident (the demo's data: ~58 KiB of tumours)

    def __post_init__(self) -> None:
        if self.workload not in SHIPPED:
            raise BadInput(f"--workload: expected one of {', '.join(SHIPPED)} (DP trains on records), "
                           f"got {self.workload!r}")
        if self.repeats < 1:
            raise BadInput(f"--repeats: expected 1 or more, got {self.repeats}")


def run(cfg: DpBenchConfig, workdir: Path, progress: Callable[[str], None] = lambda _: None) -> dict:
    from gputravel.data.demo_records import demo_holders  # lazy: Pillow, for the shipped data only

    holders = demo_holders(cfg.workload, cfg.holders, workdir)
    base = TrainConfig(workload=cfg.workload, record_schema=common_schema(holders).canonical_json(), steps=cfg.steps,
                       batch=cfg.batch, lr=cfg.lr, warmup_steps=cfg.warmup_steps, buffer_bytes=cfg.buffer_bytes,
                       checkpoint_every=0, loader="local", dp_delta=cfg.delta, dp_max_grad_norm=cfg.clip,
                       dp_accountant=cfg.accountant)
    rows = []
    for eps in cfg.epsilons:
        runs = []
        for seed in range(cfg.repeats):
            job = base.replace(seed=seed, dp_epsilon=eps or 0.0)
            t0 = time.perf_counter()
            key = hashlib.sha256(f"gputravel bench dp/{seed}".encode()).digest()
            result = train(job, LocalSource.of(job, holders), dp_key=key)
            runs.append({"seed": seed, "accuracy": result.evals[-1]["all"]["accuracy"],
                         "epsilon_spent": result.dp["epsilon_spent"] if result.dp else None,
                         "noise_multiplier": result.dp["noise_multiplier"] if result.dp else None,
                         "sample_rate": result.dp["sample_rate"] if result.dp else None,
                         "wall_s": time.perf_counter() - t0})
            progress(f"epsilon {eps if eps is not None else 'inf'}, seed {seed}: accuracy {runs[-1]['accuracy']:.3f}")
        spent = [r["epsilon_spent"] for r in runs if r["epsilon_spent"] is not None]
        rows.append({"target_epsilon": eps, "epsilon_spent": max(spent) if spent else None,
                     "delta": cfg.delta, "accuracy": statistics.fmean(r["accuracy"] for r in runs),
                     "accuracy_min": min(r["accuracy"] for r in runs), "accuracy_max": max(r["accuracy"] for r in runs),
                     "noise_multiplier": runs[0]["noise_multiplier"], "sample_rate": runs[0]["sample_rate"],
                     "runs": runs})
    return {**stamp(), "config": {**asdict(cfg), "epsilons": list(cfg.epsilons)},
            "held_out_records": result.evals[-1]["all"]["records"], "rows": rows}


def plot(result: dict, path: Path) -> Path:
    """Held-out accuracy against the epsilon spent (log scale), the non-private run as a line."""
    from matplotlib.figure import Figure  # lazy: matplotlib, for the plot only

    fig = Figure(figsize=(5.2, 3.6), dpi=110)
    ax = fig.add_subplot()
    private = [r for r in result["rows"] if r["target_epsilon"] is not None]
    xs = [r["epsilon_spent"] for r in private]
    ax.errorbar(xs, [r["accuracy"] for r in private], fmt="o-",
                yerr=[[r["accuracy"] - r["accuracy_min"] for r in private],
                      [r["accuracy_max"] - r["accuracy"] for r in private]], capsize=3, label="DP-SGD (Opacus)")
    for r in result["rows"]:
        if r["target_epsilon"] is None:
            ax.axhline(r["accuracy"], color="grey", linestyle="--", label="no DP")
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{x:.2g}" for x in xs])
    ax.minorticks_off()
    ax.set_xlabel(f"epsilon spent (delta {result['config']['delta']:g}, {result['config']['accountant']})")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(f"{result['config']['workload']} workload: utility against epsilon")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    return path
