"""A user's training script as the job (issue 27, workloads/script.py): its loop runs as it is,
fed by the one loader, so its batches are the travelled records (or, --loader local, the same
records from disk, in the same order: G2 holds for scripts too)."""

from __future__ import annotations


import math
import time
from pathlib import Path
from typing import Any, Callable

import torch

from gputravel.data.records import RecordSchema, as_tensors
from gputravel.errors import BadInput, HolderLost
from gputravel.train.job import TrainConfig
from gputravel.train.loader import ChunkSource, Fetched, Shuffled, TravellingLoader
from gputravel.train.loop import StepEvent, TrainResult, state_bytes, train, travel_entry
from gputravel.train.model import pick_device
from gputravel.train.rundir import Kept, RunDir
from gputravel.train.whole import Whole, check_kept
from gputravel.workloads.script import Feed, run_script


def run_job(cfg: TrainConfig, source: ChunkSource, **kw: Any) -> TrainResult:
    """The job: a script when it is one, else the loop (train/loop.py `train`, which takes `kw`)."""
    if not cfg.script:
        return train(cfg, source, **kw)
    if kw.get("ranks") is not None or kw.get("resume_from") is not None:
        raise BadInput("a script runs on one GPU and from its start: no --gpus, no --resume")
    return train_script(cfg, source, run_dir=kw.get("run_dir"), on_step=kw.get("on_step"), kept=kw.get("kept"))


def train_script(cfg: TrainConfig, source: ChunkSource, *, run_dir: Path | None = None,
                 on_step: Callable[[StepEvent], None] | None = None, kept: Kept | None = None) -> TrainResult:
    """Run the script as the job; with `kept` (a job manifest's outputs) its plot only where metrics may
    be kept, and the model it hands `keep()` back for sealing and release."""
    kept = kept or Kept()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)  # what the script's own model draws first, as the loop's does
    device = pick_device()
    result = TrainResult(losses=[])
    last = {"holder": ""}

    def fetched(f: Fetched) -> None:
        if not f.held:
            last["holder"] = f.visit.holder
        if not f.kept:  # a kept visit did not travel
            result.travels.append(travel_entry(f))

    def on_device(fields: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(device) for k, v in fields.items()}

    def tensors(records: Any) -> dict[str, torch.Tensor]:
        return on_device(as_tensors(records, torch.from_numpy))

    kind, args = TravellingLoader, {}
    if cfg.shuffle == "all":  # batches() as the stock DataLoader(shuffle=True) draws them, torch's generator
        check_kept(cfg.resident_mib, source.sizes(), RecordSchema.from_json(cfg.record_schema).record_bytes)
        kind, args = Whole, {"seed": None}
    loader = kind(source, cfg.batch, cfg.seq_len, cfg.buffer_bytes, policy=cfg.schedule, on_fetch=fetched,
                  device=device, batching=Shuffled(cfg.batch, cfg.seed, on_device, device),
                  resident_bytes=cfg.resident_mib << 20, **args)
    t0 = time.perf_counter()

    def held() -> Any:
        for holder in sorted(loader.scheduler.sizes):
            try:
                for records in loader.held_out(holder):
                    yield holder, tensors(records)
            except HolderLost:  # lost in an evaluation travel: the script sees the others
                continue

    def on_log(values: dict[str, float]) -> None:
        result.losses.append(values.get("loss", math.nan))
        now = time.perf_counter() - t0
        if on_step is not None:
            on_step(StepEvent(step=len(result.losses) - 1, loss=result.losses[-1], tokens_per_s=0.0,
                              holder=last["holder"], travels=loader.fetches,
                              stall_share=loader.stall_seconds / now if now else 0.0, elapsed_s=now,
                              evaluated={}))

    feed = Feed(loader, held, on_log)
    try:
        run_script(cfg.workload, cfg.workload_code, feed)
    finally:
        loader.close()  # records kept for the script's run live no longer
    if kept.weights:
        if feed.kept is None:
            raise BadInput(f"script {cfg.workload!r} handed no model to gputravel.workloads.script.keep(model): a "
                           "job with a manifest seals and releases the model its script keeps")
        result.weights = state_bytes(feed.kept)
    result.wall_seconds = time.perf_counter() - t0
    result.stall_seconds, result.first_pass_seconds = loader.stall_seconds, loader.first_pass_seconds
    result.state = loader.state.to_dict()
    if run_dir is not None and result.losses and kept.metrics:
        RunDir(run_dir).plot_losses(list(range(1, len(result.losses) + 1)), result.losses,
                                    title=f"script {cfg.workload} ({cfg.loader} loader)")
    return result
