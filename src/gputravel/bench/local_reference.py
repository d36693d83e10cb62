"""The step time `bench train` sets the travelling loader against (issue 27): the same model on
the same training data through a plain ``torch.utils.data.DataLoader`` over local disk, as a
stock PyTorch script would train it, with the job's batch size, steps, schedule and threads.

A step is timed as the loop times it (train/loop.py's ``tokens_per_s``): from asking for the
batch to the optimizer's step, so a wait for data counts in both. Records are the dataset's
items and the workload's ``inputs`` make each batch's tensors (the collate function), the work
the loop does per batch too.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from gputravel.bench.holdout import HeldOut
from gputravel.data.holder_tokens import load_tokens
from gputravel.data.records import load_records, split_arrays
from gputravel.errors import BadInput
from gputravel.files import EVAL_SHARE
from gputravel.train.job import TrainConfig
from gputravel.train.loop import build_model, lr_at, train_step, workload_of


def median_step_ms(seconds: Sequence[float]) -> float | None:
    return statistics.median(seconds) * 1e3 if seconds else None


def step_seconds(t: TrainConfig, tokens_per_s: Sequence[float]) -> list[float]:
    """The loop's step times from its StepEvents' throughput (records or tokens per second)."""
    per_batch = t.batch if t.records else t.batch * t.seq_len
    return [per_batch / r for r in tokens_per_s if r > 0]


def dataset(t: TrainConfig, holders: Sequence[tuple[str, str]], data: HeldOut) -> np.ndarray | TensorDataset:
    """Every holder's training data as one dataset: its records (each holder's split, as its CVM
    splits it), a record an item; or GPT-2's windows of the training tokens."""
    if t.records:
        return np.concatenate([split_arrays(load_records(path), EVAL_SHARE)[0] for _, path in holders])
    tokens = np.concatenate([np.asarray(load_tokens(path).tokens, dtype=np.int64) for path in data.holders.values()])
    n = (len(tokens) - 1) // t.seq_len
    whole = torch.from_numpy(tokens)
    return TensorDataset(whole[: n * t.seq_len].view(n, t.seq_len), whole[1 : n * t.seq_len + 1].view(n, t.seq_len))


def measure(t: TrainConfig, holders: Sequence[tuple[str, str]], data: HeldOut) -> dict:
    """``t.steps`` steps through a shuffling DataLoader (epochs as needed); the median step time."""
    torch.set_num_threads(t.threads)
    ds = dataset(t, holders, data)
    if len(ds) < t.batch:
        raise BadInput(f"the holders' training data makes {len(ds)} examples, fewer than one batch of {t.batch}")
    workload = workload_of(t)
    # Records become tensors a batch at a time, by the workload's inputs, as the loop makes them.
    collate = (lambda rows: workload.batch(np.array(rows, dtype=ds.dtype), "cpu")) if t.records else None
    loader = DataLoader(ds, batch_size=t.batch, shuffle=True, drop_last=True, collate_fn=collate,  # type: ignore[arg-type]
                        generator=torch.Generator().manual_seed(t.seed))
    model, optimizer = build_model(t, "cpu", workload)
    model.train()
    seconds, losses, batches = [], [], iter(loader)
    wall = time.perf_counter()
    for step in range(t.steps):
        t0 = time.perf_counter()
        try:
            x, y = next(batches)
        except StopIteration:  # the next epoch, reshuffled
            batches = iter(loader)
            x, y = next(batches)
        losses.append(train_step(model, optimizer, x, y, lr_at(t, step), loss_of=workload.loss))
        seconds.append(time.perf_counter() - t0)
    return {"step_ms": median_step_ms(seconds), "steps": t.steps, "batch": t.batch, "examples": len(ds),
            "wall_s": time.perf_counter() - wall, "train_loss_tail": sum(losses[-10:]) / len(losses[-10:])}
