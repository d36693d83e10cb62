"""What a holder computes in FedAvg, and the held-out evaluation every method is scored on.

Every method starts from the same weights (train.loop.build_model). A local round trains the
holder's next batches from the global weights with a fresh optimizer (FedAvg exchanges weights
only), the learning rate following the centralised schedule stretched over the holder's steps.
A records workload (issue 27) batches as the loop does (``Shuffled`` within each visit) and is
scored as the loop scores it (``evaluate``/``summarise`` on each holder's held-out records).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gputravel.errors import BadInput
from gputravel.train.job import TrainConfig
from gputravel.train.loader import LocalSource, Shuffled, TravellingLoader, batch_at
from gputravel.train.loop import build_model, evaluate as evaluate_records, gpt_config, lr_at, summarise, train_step
from gputravel.train.loop import workload_of
from gputravel.train.model import GPT
from gputravel.train.schedule import LoaderState
from gputravel.workloads import Workload


def initial_model(cfg: TrainConfig) -> torch.nn.Module:
    """The model every method starts from, built as train.loop builds it."""
    model, _ = build_model(cfg, "cpu")
    return model


def parameter_count(cfg: TrainConfig) -> int:
    """Distinct parameters (a tied matrix once): what FedAvg sends each way, per holder."""
    workload = workload_of(cfg)
    with torch.device("meta"):
        model = GPT(gpt_config(cfg)) if workload.tokens else workload.module.model(workload.schema)  # type: ignore[union-attr]
    return sum(p.numel() for p in model.parameters())


def _tied(model: torch.nn.Module) -> set[str]:
    """state_dict names whose tensor an earlier name already holds (GPT-2's lm_head is its wte)."""
    seen: set[tuple] = set()
    tied: set[str] = set()
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if key in seen:
            tied.add(name)
        seen.add(key)
    return tied


def model_arrays(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights to send: the model's state_dict tensors by name, whatever the model, a tied one once."""
    tied = _tied(model)
    return {name: t.detach().cpu().clone() for name, t in model.state_dict().items() if name not in tied}


def load_arrays(model: torch.nn.Module, arrays: Mapping[str, torch.Tensor]) -> None:
    """Put received weights into ``model``; BadInput unless they are exactly its weights."""
    try:
        missing, unexpected = model.load_state_dict(dict(arrays), strict=False)
    except RuntimeError as e:
        raise BadInput(f"the received weights do not fit the model: {e}") from None
    if unexpected or set(missing) - _tied(model):
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
    next_window: int  # where the holder's next round starts (tokens)
    loader: dict | None = None  # records: the holder's loader state, where its next round starts


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


def records_loader(cfg: TrainConfig, workload: Workload, source: LocalSource,
                   state: Mapping | None = None) -> TravellingLoader:
    """The loop's loader over records read from disk (LocalSource.of): visits as
    the scheduler orders them, records shuffled within each as the loop shuffles them."""
    batching = Shuffled(cfg.batch, cfg.seed, lambda t: workload.inputs(t, "cpu"))
    return TravellingLoader(source, cfg.batch, cfg.seq_len, cfg.buffer_bytes, policy=cfg.schedule,
                            state=LoaderState.from_dict(state) if state else None, batching=batching)


def local_train_records(cfg: TrainConfig, arrays: Mapping[str, torch.Tensor], source: LocalSource, *,
                        state: Mapping | None, steps: int, schedule: TrainConfig, schedule_offset: int,
                        threads: int) -> LocalResult:
    """``steps`` steps on the holder's records from loader ``state`` on (None: its first batch)."""
    torch.set_num_threads(threads)
    workload = workload_of(cfg)
    model, optimizer = build_model(cfg, "cpu", workload)  # a fresh optimizer, as for GPT-2
    load_arrays(model, arrays)
    loader = records_loader(cfg, workload, source, state)
    batches = iter(loader)
    model.train()
    losses = []
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        x, y = next(batches)
        losses.append(train_step(model, optimizer, x, y, lr_at(schedule, schedule_offset + i), loss_of=workload.loss))
    compute, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return LocalResult(model_arrays(model), losses, compute, cpu, 0, loader.state.to_dict())


def held_out_metrics(cfg: TrainConfig, model: torch.nn.Module, holders: Sequence[tuple[str, str]],
                     threads: int | None = None) -> dict:
    """``final_metrics`` of a records workload: each holder's held-out records scored as the loop
    scores them at its last step, per holder and over all holders; the same for every method."""
    torch.set_num_threads(threads or cfg.threads)
    workload = workload_of(cfg)
    loader = records_loader(cfg, workload, LocalSource.of(cfg, holders))
    return summarise(evaluate_records(workload, model, loader))
