"""What a holder computes in FedAvg, and the held-out evaluation every method is scored on.

Every method starts from the same weights (train.loop.build_model). A local round trains the
holder's next batches from the global weights with a fresh optimizer (FedAvg exchanges weights
only), the learning rate following the centralised schedule stretched over the holder's steps.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from gputravel.errors import BadInput
from gputravel.train.job import TrainConfig
from gputravel.train.loader import batch_at
from gputravel.train.loop import build_model, gpt_config, lr_at, train_step
from gputravel.train.model import GPT

TIED = "lm_head.weight"  # the same Parameter as transformer.wte.weight


def initial_model(cfg: TrainConfig) -> GPT:
    """The model every method starts from, built as train.loop builds it."""
    model, _ = build_model(cfg, "cpu")
    return model


def parameter_count(cfg: TrainConfig) -> int:
    """Distinct parameters (the tied matrix once): what FedAvg sends each way, per holder."""
    with torch.device("meta"):
        model = GPT(gpt_config(cfg))
    return sum(p.numel() for p in model.parameters())


def model_arrays(model: GPT) -> dict[str, torch.Tensor]:
    """The weights to send, by name; parameters() yields the tied matrix once."""
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


def load_arrays(model: GPT, arrays: Mapping[str, torch.Tensor]) -> None:
    """Put received weights into ``model``; BadInput unless they are exactly its weights."""
    try:
        missing, unexpected = model.load_state_dict(dict(arrays), strict=False)
    except RuntimeError as e:
        raise BadInput(f"the received weights do not fit the model: {e}") from None
    if unexpected or set(missing) - {TIED}:
        raise BadInput(f"the received weights do not fit the model (missing {sorted(missing)}, "
                       f"unexpected {sorted(unexpected)})")


def schedule_config(cfg: TrainConfig, holder_steps: int) -> TrainConfig:
    """One holder's schedule: the centralised run's stretched over its ``holder_steps``."""
    warmup = max(1, round(cfg.warmup_steps * holder_steps / cfg.steps)) if cfg.warmup_steps else 0
    return cfg.replace(steps=holder_steps, warmup_steps=min(warmup, holder_steps))


def windows(tokens: np.ndarray, batch: int, seq_len: int) -> int:
    """How many whole (x, y) batches a token stream holds."""
    return max(0, (len(tokens) - 1) // (batch * seq_len))


@dataclass(frozen=True)
class LocalResult:
    arrays: dict[str, torch.Tensor]
    losses: list[float]
    compute_s: float  # wall time of the local steps
    cpu_s: float  # CPU time of the local steps (this process, all threads)
    next_window: int  # where the holder's next round starts


def local_train(cfg: TrainConfig, arrays: Mapping[str, torch.Tensor], tokens: np.ndarray, *, first_window: int,
                steps: int, schedule: TrainConfig, schedule_offset: int, threads: int) -> LocalResult:
    """``steps`` steps on the holder's batches from ``first_window`` on, wrapping at the end."""
    n = windows(tokens, cfg.batch, cfg.seq_len)
    if steps > n:
        raise BadInput(f"{steps} local steps, but the holder's data holds only {n} batches")
    torch.set_num_threads(threads)
    model = GPT(gpt_config(cfg))
    load_arrays(model, arrays)
    optimizer = model.configure_optimizer(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    model.train()
    losses = []
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        x, y = batch_at(tokens, (first_window + i) % n, cfg.batch, cfg.seq_len)
        losses.append(train_step(model, optimizer, x, y, lr_at(schedule, schedule_offset + i)))
    compute, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return LocalResult(model_arrays(model), losses, compute, cpu, (first_window + steps) % n)


@torch.no_grad()
def evaluate(model: GPT, eval_tokens: Mapping[str, np.ndarray], batch: int, seq_len: int, threads: int) -> float:
    """``final_loss``: mean cross-entropy over every holder's held-out batches, the same for every method."""
    torch.set_num_threads(threads)
    model.eval()
    losses = []
    for name, tokens in sorted(eval_tokens.items()):
        n = windows(tokens, batch, seq_len)
        if n == 0:
            raise BadInput(f"holder {name!r} has no held-out batch of {batch} x {seq_len}")
        for j in range(n):
            x, y = batch_at(tokens, j, batch, seq_len)
            losses.append(model(x, y)[1].item())
    return sum(losses) / len(losses)
