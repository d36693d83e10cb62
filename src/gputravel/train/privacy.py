"""DP-SGD through Opacus (issue 29), with accounting that is true of the sampling done.

Opacus's accountants assume Poisson sampling over the whole dataset: each step takes each record
independently with probability q. So a DP job keeps every holder's training records resident
(they must fit the job's buffer together; refused otherwise) and each step draws its own Poisson
sample over all of them (:class:`Resident`). The sample and the noise come from generators seeded
per step from a secret key drawn inside the training process: the job's seed is in the manifest,
and noise or a sample anyone could recompute would protect nothing. See docs/privacy.md.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch

from gputravel.data.records import as_tensors
from gputravel.errors import BadInput, HolderLost
from gputravel.train.job import TrainConfig
from gputravel.train.loader import Fetched, TravellingLoader
from gputravel.train.schedule import Visit

KEY_BYTES = 32
MIB = 1 << 20


def step_seed(key: bytes, purpose: str, step: int) -> int:
    """A 64-bit seed for one step's `purpose` ("sample", "noise"), from the job's secret key."""
    return int.from_bytes(hmac.new(key, f"{purpose}/{step}".encode(), hashlib.sha256).digest()[:8], "little")


def poisson_sample(key: bytes, step: int, records: int, rate: float) -> torch.Tensor:
    """Step `step`'s sample: the indices of the records taken, each independently with probability `rate`."""
    gen = torch.Generator().manual_seed(step_seed(key, "sample", step))
    return (torch.rand(records, generator=gen, dtype=torch.float64) < rate).nonzero().flatten()


def check_job(cfg: TrainConfig, gpus: int = 1) -> None:
    """What DP-SGD cannot account for honestly, refused naming the key (before anything starts)."""
    if cfg.dp_epsilon and gpus > 1:
        raise BadInput(f"--dp-epsilon: DP-SGD trains on one GPU (its Poisson sample is over every holder's records "
                       f"in one buffer), not {gpus}: leave --gpus out")


def check_fits(cfg: TrainConfig, sizes: Mapping[str, int], record_bytes: int) -> int:
    """The training records of all holders (N), if they fit the job's buffer together and a batch is
    at most N; BadInput saying what to raise otherwise."""
    records = sum(sizes.values())
    need = records * record_bytes
    if need > cfg.buffer_bytes:
        mib = max(4 << 10, 1 << (need - 1).bit_length()) / MIB  # a power of two: whole pages, short in MiB
        raise BadInput(f"--dp-epsilon: the holders' {records} training records take {need} bytes, the job's buffer "
                       f"holds {cfg.buffer_bytes}: DP-SGD samples over every record at once, so raise --buffer-mib "
                       f"to {mib:g} or more (or train without DP)")
    if cfg.dp_delta * records >= 1:  # a mechanism that publishes one record in full meets delta = 1/N
        raise BadInput(f"--dp-delta {cfg.dp_delta:g}: at 1/N ({records} training records) or above it admits a "
                       f"release of whole records; take it well below {1 / records:.2g}")
    if not 0 < cfg.batch <= records:
        raise BadInput(f"--batch {cfg.batch}: a DP job's expected batch is at most the holders' {records} training "
                       "records")
    return records


def check_model(model: torch.nn.Module, workload: str) -> None:
    """Opacus's verdict on the workload's model: a layer it cannot train privately, named."""
    from opacus.validators import ModuleValidator  # lazy: opacus, for DP jobs only

    was = model.training
    model.train()  # Opacus validates a model in training mode
    try:
        for name, layer in model.named_modules():
            check = ModuleValidator.VALIDATORS.get(type(layer))
            errors = check(layer) if check is not None and any(p.requires_grad for p in layer.parameters()) else []
            if errors:
                raise BadInput(f"workload {workload!r}: Opacus cannot train layer {name or 'model'!r} "
                               f"({type(layer).__name__}) with DP-SGD ({str(errors[0]).splitlines()[0]}): replace "
                               "it (BatchNorm by GroupNorm; opacus.validators.ModuleValidator.fix does so)")
        left = ModuleValidator.validate(model, strict=False)  # anything the per-layer walk missed
        if left:
            raise BadInput(f"workload {workload!r}: Opacus cannot train it with DP-SGD "
                           f"({str(left[0]).splitlines()[0]})")
    finally:
        model.train(was)


def noise_multiplier(cfg: TrainConfig, rate: float) -> float:
    """The noise multiplier spending dp_epsilon at dp_delta in cfg.steps steps sampled at `rate`
    (by the job's accountant)."""
    from opacus.accountants.utils import get_noise_multiplier  # lazy: opacus, for DP jobs only

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Optimal order is the largest alpha", UserWarning)
            return float(get_noise_multiplier(target_epsilon=cfg.dp_epsilon, target_delta=cfg.dp_delta,
                                              sample_rate=rate, steps=cfg.steps, accountant=cfg.dp_accountant))
    except ValueError as exc:  # "The privacy budget is too low."
        raise BadInput(f"--dp-epsilon {cfg.dp_epsilon:g}: no noise reaches it at --dp-delta {cfg.dp_delta:g} over "
                       f"{cfg.steps} steps ({exc}): raise it, or train fewer steps") from None


@dataclass(frozen=True)
class Mechanism:
    """The DP-SGD a job runs: what the report states beside the ε spent."""

    target_epsilon: float
    delta: float
    accountant: str
    noise_multiplier: float
    sample_rate: float
    max_grad_norm: float


class Private:
    """The model and optimizer wrapped by Opacus (per-record gradients, clipping, noise) and the
    accountant of what the steps run so far spent. `model` and `optimizer` stay the bare ones:
    checkpoints hold them as a job without DP does."""

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer, records: int,
                 key: bytes, device: str) -> None:
        from opacus import GradSampleModule  # lazy: opacus, for DP jobs only
        from opacus.accountants import create_accountant
        from opacus.optimizers import DPOptimizer

        self.mechanism = mechanism_of(cfg, records)
        self.key, self.records = key, records
        try:
            self.module = GradSampleModule(model, loss_reduction="mean")
        except NotImplementedError as exc:  # a layer with no per-record gradient: said before anything travels
            raise BadInput(f"Opacus cannot compute per-record gradients of this model ({exc})") from None
        self.noise = torch.Generator(device=device)
        # secure_mode: noise robust to floating-point attacks (Opacus's _generate_noise notes).
        self.optimizer = DPOptimizer(optimizer, noise_multiplier=self.mechanism.noise_multiplier,
                                     max_grad_norm=cfg.dp_max_grad_norm, expected_batch_size=cfg.batch,
                                     loss_reduction="mean", generator=self.noise, secure_mode=True)
        self.accountant = create_accountant(mechanism=cfg.dp_accountant)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor] | None, lr: float, step: int, loss_of: Callable,
             guard: Callable) -> float:
        """One DP-SGD step on the step's sample (None: it drew no record; the noise is added all the
        same, as Opacus does for an empty batch); the loss, NaN for an empty sample."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.noise.manual_seed(step_seed(self.key, "noise", step))
        self.optimizer.zero_grad(set_to_none=True)
        if batch is None:
            for p in self.optimizer.params:  # no record: every per-record gradient is an empty stack
                p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)  # type: ignore[attr-defined]
            value = math.nan
        else:
            loss = loss_of(self.module, *batch)
            with guard("backward"), warnings.catch_warnings():
                # torch's note that the first layer's input needs no gradient: Opacus's hooks need none
                warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
                loss.backward()
            value = loss.item()
        with guard("optimizer step"):
            self.optimizer.step()
        self.accountant.step(noise_multiplier=self.mechanism.noise_multiplier, sample_rate=self.mechanism.sample_rate)
        return value

    def spent(self) -> float:
        """ε spent at δ by the steps run (resumed ones included)."""
        if not self.accountant.history:
            return 0.0
        with warnings.catch_warnings():  # "optimal order is the largest alpha": a true bound, if not the tightest
            warnings.filterwarnings("ignore", "Optimal order is the largest alpha", UserWarning)
            return float(self.accountant.get_epsilon(delta=self.mechanism.delta))

    def report(self) -> dict[str, Any]:
        m = self.mechanism
        return {"epsilon_spent": self.spent(), "delta": m.delta, "accountant": m.accountant,
                "target_epsilon": m.target_epsilon, "noise_multiplier": m.noise_multiplier,
                "sample_rate": m.sample_rate, "max_grad_norm": m.max_grad_norm, "records": self.records}

    def checkpoint(self, sealed: bool) -> dict[str, Any]:
        """What a resume needs: the accountant's history, and the key only in a sealed checkpoint
        (a plaintext one would hand the host the samples and noise)."""
        return {"history": [list(h) for h in self.accountant.history], **({"key": self.key.hex()} if sealed else {})}

    def resume(self, stored: object, step: int, where: str) -> None:
        """The accountant's history (and key) from a checkpoint at `step`; BadInput if it is not there."""
        history = stored.get("history") if isinstance(stored, dict) else None
        if not isinstance(history, list) or sum(int(h[2]) for h in history) != step:
            raise BadInput(f"checkpoint {where} does not record the privacy spent by its {step} steps: start afresh")
        self.accountant.history = [(float(s), float(q), int(n)) for s, q, n in history]
        key = stored.get("key") if isinstance(stored, dict) else None
        if isinstance(key, str):
            self.key = bytes.fromhex(key)


def epsilon_after(mechanism: Mechanism, steps: int) -> float:
    """ε at δ that `steps` steps of `mechanism` spend: the live view's, which sees only step numbers
    (the same count the job's accountant makes, its noise and rate being fixed for the job)."""
    from opacus.accountants import create_accountant  # lazy: opacus, for DP jobs only

    accountant = create_accountant(mechanism=mechanism.accountant)
    accountant.history = [(mechanism.noise_multiplier, mechanism.sample_rate, steps)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Optimal order is the largest alpha", UserWarning)
        return float(accountant.get_epsilon(delta=mechanism.delta)) if steps else 0.0


def mechanism_of(cfg: TrainConfig, records: int) -> Mechanism:
    """The DP-SGD a job over `records` training records runs (its noise from its target)."""
    rate = cfg.batch / records
    return Mechanism(cfg.dp_epsilon, cfg.dp_delta, cfg.dp_accountant, noise_multiplier(cfg, rate), rate,
                     cfg.dp_max_grad_norm)


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


class Resident(TravellingLoader):
    """A DP job's loader: every holder's training records travel once, in name order, and stay
    resident; step s then yields the records of its Poisson sample (None when it drew none).
    The local source gives the same records in the same order, so the same batches (G2)."""

    def __init__(self, *args: Any, key: bytes, rate: float, start: int = 0, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.key, self.rate, self.start = key, rate, start
        self.records: np.ndarray | None = None

    def __iter__(self) -> Iterator[Any]:
        records = self.resident()
        step = self.start
        while True:
            picked = poisson_sample(self.key, step, len(records), self.rate).numpy()
            step += 1
            yield self.batching.to_batch(as_tensors(records[picked], torch.from_numpy)) if len(picked) else None

    def resident(self) -> np.ndarray:
        """All holders' training records, travelled once (a copy: the buffer is scrubbed by the next travel)."""
        if self.records is not None:
            return self.records
        parts = []
        for holder, total in sorted(self.scheduler.sizes.items()):
            offset = 0
            while offset < total:
                visit = Visit(holder, offset, min(self.scheduler.capacity, total - offset))
                t0 = time.perf_counter()
                try:
                    parts.append(np.array(self.source.fetch(visit)))
                except HolderLost as exc:  # N would change, and with it the sampling the accounting assumes
                    raise BadInput(f"holder {holder!r} was lost while the DP job's records travelled ({exc}): "
                                   "every holder's records must be resident; run the job again") from None
                finally:
                    self.stall_seconds += time.perf_counter() - t0
                self.fetches += 1
                if self.on_fetch is not None:
                    self.on_fetch(Fetched(visit, time.perf_counter() - t0, getattr(self.source, "last_report", None)))
                offset += visit.ntokens
        self.records = np.concatenate(parts)
        return self.records
