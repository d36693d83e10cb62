"""One FedAvg job on a Flower deployment, from the checks before it starts to its report.

Its times match a training run's: ``wall_s`` is the rounds (set-up is ``setup_s``); ``tx_s`` per
round is the round's time less its slowest holder's compute (the links and Flower's round trip;
``tx_floor_s`` the links alone); ``training_s`` the rest; ``holder_compute_s`` every holder's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gputravel.data.holder_tokens import load_tokens
from gputravel.errors import BadInput, RemoteError
from gputravel.fl.config import FedAvgConfig, FedAvgPlan, drop_target, framework, plan
from gputravel.fl.deploy import FlowerDeployment
from gputravel.files import write_json
from gputravel.net.counters import bytes_between
from gputravel.train.job import TrainConfig

CONNECT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class FlJob:
    train: TrainConfig  # the job the centralised methods train (train/job.py): FedAvg's model, batches and schedule
    fl: FedAvgConfig
    holders: Mapping[str, str]  # name -> the holder's training tokens, or its record dataset (its ClientApp reads it)
    bandwidth_mbit: float | None
    workdir: Path


def check(job: FlJob) -> FedAvgPlan:
    """Everything that can be wrong with the job, before any process or namespace exists."""
    if job.train.dp_epsilon:  # each client would train on its own data alone: not the job's accounting
        raise BadInput("dp_epsilon: the FedAvg baseline trains without DP-SGD; run it with dp_epsilon = 0")
    framework()  # Flower is installed
    if job.train.records:
        from gputravel.train.loader import LocalSource  # lazy: torch, for records only

        sizes = dict(LocalSource.of(job.train, sorted(job.holders.items())).sizes())  # training records, as split
    else:
        sizes = {name: len(load_tokens(path)) for name, path in sorted(job.holders.items())}
    return plan(job.fl, steps=job.train.steps, batch=job.train.batch, seq_len=job.train.seq_len, holder_tokens=sizes,
                records=job.train.records)


def run_fedavg(job: FlJob, fedavg: FedAvgPlan | None = None) -> dict:
    """The job's report, with the final weights' path."""
    fedavg = fedavg or check(job)
    out, progress = job.workdir / "out", job.workdir / "progress"
    out.mkdir(parents=True, exist_ok=True)
    progress.mkdir(exist_ok=True)
    job_path = job.workdir / "job.json"
    write_json(job_path, {"train": job.train.to_dict(), "plan": fedavg.to_dict(), "fl": job.fl.to_dict(),
                          "out_dir": str(out), "progress_dir": str(progress), "connect_timeout_s": CONNECT_TIMEOUT_S})
    dropper = _Dropper(job.fl, progress)
    t0 = time.perf_counter()
    with FlowerDeployment(job.holders, job.bandwidth_mbit, job.workdir / "deployment") as deployment:
        before = deployment.link_bytes()
        run_id = deployment.submit(job.workdir / "app", job_path)
        status = deployment.wait(out / "status.json", CONNECT_TIMEOUT_S + 60 + job.fl.round_timeout_s * fedavg.rounds,
                                 on_poll=lambda: dropper.poll(deployment))
        moved = bytes_between(before, deployment.link_bytes())
        total_s = time.perf_counter() - t0
        flower = next((r for r in deployment.runs() if r.get("run-id") == run_id), {})
    if status.get("status") != "done":
        raise RemoteError(f"the FedAvg ServerApp failed: {status.get('reason', status)}")
    record = json.loads((out / "rounds.json").read_text())
    return _report(job, fedavg, record, moved, total_s, flower, dropper, out / "model.pt")


class _Dropper:
    """Makes the planned holder drop out once its ClientApp has started that round's steps."""

    def __init__(self, fl: FedAvgConfig, progress: Path) -> None:
        self.mode = fl.drop_mode
        self.target = drop_target(fl.drop) if fl.drop else None
        self.marker = progress / f"{self.target[0]}-round-{self.target[1]}" if self.target else None
        self.done_at: float | None = None

    def poll(self, deployment: FlowerDeployment) -> None:
        if self.target and self.done_at is None and self.marker.exists():
            deployment.drop(self.target[0], self.mode)
            self.done_at = time.time()


def _report(job: FlJob, fedavg: FedAvgPlan, record: dict, moved: dict, total_s: float, flower: dict,
            dropper: _Dropper, model: Path) -> dict:
    names = list(fedavg.holders)  # sorted; a reply's holder-index points into it
    rounds = [_round(r, names) for r in record["rounds"]]
    tx = sum(r["tx_s"] for r in rounds)
    wall = record["wall_s"]
    cap = job.bandwidth_mbit
    busiest = max(b.total for b in moved.values())
    return {
        "framework": framework(), "plan": fedavg.to_dict(), "fl": job.fl.to_dict(),
        "rounds": len(rounds), "round_log": rounds, "wall_s": wall, "tx_s": tx, "training_s": wall - tx,
        "setup_s": total_s - wall, "tx_floor_s": None if cap is None else busiest * 8 / (cap * 1e6),
        "holder_compute_s": sum(h["compute_s"] for r in rounds for h in r["holders"]),
        "holder_cpu_s": sum(h["cpu_s"] for r in rounds for h in r["holders"]),
        "holder_compute_by_holder_s": {n: sum(h["compute_s"] for r in rounds for h in r["holders"] if h["holder"] == n)
                                       for n in names},
        "bytes_over_link": sum(b.total for b in moved.values()),
        "bytes_by_holder": {n: {"up": b.up, "down": b.down} for n, b in moved.items()},
        "flower_counted_bytes": (flower.get("network-traffic") or {}).get("total-bytes"),
        "phases_s": _phases(rounds), "drop": _drop(dropper, rounds), "model_path": str(model),
    }


def _round(r: dict, names: list[str]) -> dict:
    holders = [_holder_round(x, r, names) for x in r["replies"]]
    wall = r["end"] - r["start"]
    slowest = max((h["compute_s"] for h in holders), default=0.0)
    return {"round": r["round"], "wall_s": wall, "tx_s": wall - slowest, "sampled": len(r["sampled_nodes"]),
            "replied": [h["holder"] for h in holders], "holders": holders, "failures": r["failures"],
            "missing_nodes": r["missing_nodes"]}


def _holder_round(x: dict, r: dict, names: list[str]) -> dict:
    """One holder's round in phases: the model coming down until its ClientApp started, the
    ClientApp's start-up, its local steps, and the update going up until the round ended."""
    return {"holder": names[int(x["holder-index"])], "node": x["node"], "compute_s": x["compute-s"],
            "cpu_s": x["cpu-s"], "loss_first": x["loss-first"], "loss_last": x["loss-last"],
            "phases_s": {"to_clientapp": x["t-process"] - r["start"], "clientapp_start": x["t-train-start"] - x["t-process"],
                         "local_steps": x["t-train-end"] - x["t-train-start"], "to_round_end": r["end"] - x["t-train-end"]}}


def _phases(rounds: list[dict]) -> dict:
    """Each phase of a holder's round, the mean over holders and rounds (s)."""
    entries = [h["phases_s"] for r in rounds for h in r["holders"]]
    return {k: sum(e[k] for e in entries) / len(entries) for k in entries[0]} if entries else {}


def _drop(dropper: _Dropper, rounds: list[dict]) -> dict | None:
    """What Flower did about the holder that dropped out, that round and after."""
    if dropper.target is None:
        return None
    holder, at = dropper.target
    this = next((r for r in rounds if r["round"] == at), None)
    return {"holder": holder, "round": at, "mode": dropper.mode, "dropped": dropper.done_at is not None,
            "round_replied": None if this is None else this["replied"],
            "flower_failures": None if this is None else this["failures"],
            "later_rounds_replied": {r["round"]: r["replied"] for r in rounds if r["round"] > at}}
