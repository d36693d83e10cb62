"""DP-SGD through Opacus (issue 29), with accounting that is true of the sampling done.

Opacus's accountants assume Poisson sampling over the whole dataset: each step takes each record
independently with probability q. So a DP job keeps every holder's training records resident
(they must fit the job's buffer together; refused otherwise) and each step draws its own Poisson
sample over all of them (:class:`Resident`). The sample and the noise come from generators seeded
per step from a secret key drawn inside the training process: the job's seed is in the manifest,
and noise or a sample anyone could recompute would protect nothing. See docs/privacy.md.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import hmac
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch

from gputravel.data.records import RecordSchema, as_tensors
from gputravel.errors import BadInput, HolderLost
from gputravel.train.job import TrainConfig
from gputravel.train.loader import TravellingLoader, zero
from gputravel.workloads import Workload

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


PROBE_RECORDS = 4  # the made-up batch the independence check runs


def check_independent(workload: Workload, model: torch.nn.Module) -> None:
    """DP-SGD bounds a record's influence by C only if its per-record gradient is its own: the
    workload's inputs, forward and loss must treat a batch's records independently. Checked on a
    few made-up records of the job's schema (no holder's) and a copy of the model, with the job's
    random state untouched; BadInput naming what couples the records, before anything travels. On
    the CPU: a GPU's TF32 kernels round a batch and a record alone differently."""
    assert workload.schema is not None
    probe = copy.deepcopy(model).to("cpu")
    probe.train()  # Opacus's hooks record in training mode only; dropout's masks differ by batch shape
    for layer in probe.modules():
        if isinstance(layer, torch.nn.modules.dropout._DropoutNd):
            layer.eval()
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the workload's on made-up records (a one-record std, say): noise here
        torch.manual_seed(0)
        fields = synthetic(workload.schema, PROBE_RECORDS, seed=0)
        coupled = _coupling(workload, probe, fields, "cpu")
    if coupled:
        raise BadInput(f"workload {workload.name!r}: {coupled}; DP-SGD bounds each record's influence only if "
                       "inputs, forward and loss treat the records of a batch independently (docs/privacy.md)")


def synthetic(schema: RecordSchema, count: int, seed: int) -> dict[str, torch.Tensor]:
    """`count` made-up records of `schema`, a tensor a field: small normal floats; an integer field's
    values below its class count when it names classes, any byte in a uint8 field, else 0 or 1."""
    rng, out = np.random.default_rng(seed), {}
    for f in schema.fields:
        shape, kind = (count, *f.shape), np.dtype(f.dtype)
        if kind.kind == "f":
            values = rng.standard_normal(shape)
        else:
            values = rng.integers(0, len(f.names) or (256 if f.dtype == "uint8" else 2), shape)
        out[f.name] = torch.from_numpy(values.astype(kind))
    return out


def _coupling(workload: Workload, probe: torch.nn.Module, fields: dict[str, torch.Tensor], device: str) -> str:
    """What makes a record's gradient depend on the others ('' if nothing seen): inputs, forward,
    loss, or the per-record gradients themselves (a custom autograd function, say)."""
    from opacus import GradSampleModule  # lazy: opacus, for DP jobs only

    n = PROBE_RECORDS
    x, y = workload.inputs(fields, device)
    alone = [workload.inputs({k: v[i : i + 1] for k, v in fields.items()}, device) for i in range(n)]
    if len(x) != n or len(y) != n:
        return f"inputs gives {len(x)} rows for a batch of {n} records (one row a record, no augmented copies)"
    if not all(_same(x[i], a[0][0]) and _same(y[i], a[1][0]) for i, a in enumerate(alone)):
        return "inputs makes a record's row depend on the other records of its batch (batch statistics?)"
    plain = copy.deepcopy(probe)  # a record's gradient alone, away from Opacus's hooks
    with torch.no_grad(), workload.guard("forward"):
        out, solo = plain(x), [plain(a[0]) for a in alone]
    if len(out) != n or not all(len(o) == 1 and _same(out[i], o[0]) for i, o in enumerate(solo)):
        return "forward makes a record's output depend on the other records of its batch"
    with torch.no_grad():
        whole, parts = workload.loss(plain, x, y), [workload.loss(plain, *a) for a in alone]
    if not _same(whole, torch.stack(parts).mean()):
        return "loss is not the mean of a loss a record (it couples the records of a batch)"
    module = GradSampleModule(probe, loss_reduction="mean")
    rows = _grad_samples(workload, module, x, y)
    if isinstance(rows, str):
        return rows
    params = [p for p in plain.parameters() if p.requires_grad]
    for i, a in enumerate(alone):
        own = torch.autograd.grad(workload.loss(plain, *a), params, allow_unused=True)
        if not all(_same(r[i], torch.zeros_like(r[i]) if g is None else g)
                   for r, g in zip(rows.values(), own, strict=True)):
            return "a record's per-record gradient is not the gradient of that record alone (custom autograd?)"
    fresh = synthetic(workload.schema, 1, seed=1)  # type: ignore[arg-type]
    other = {k: torch.cat([v[:-1], fresh[k]]) for k, v in fields.items()}
    moved = _grad_samples(workload, module, *workload.inputs(other, device))
    if isinstance(moved, str) or not all(_same(rows[k][:-1], moved[k][:-1]) for k in rows):
        return "changing one record of a batch changes the per-record gradients of the others"
    return ""


def _grad_samples(workload: Workload, module: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor] | str:
    """Each parameter's per-record gradients on (x, y), or what is wrong with their rows."""
    for p in module.parameters():
        p.grad_sample, p.grad = None, None
    workload.loss(module, x, y).backward()
    rows = {}
    for name, p in module._module.named_parameters():
        if not p.requires_grad:
            continue
        got = p.grad_sample
        got = torch.zeros((len(x), *p.shape)) if got is None else sum(got) if isinstance(got, list) else got
        if len(got) != len(x):
            return f"forward gives parameter {name!r} {len(got)} per-record gradients for {len(x)} records"
        rows[name] = got.detach().clone()
    return rows


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float rounding (a batch and one record take different kernels); NaN is never equal."""
    if a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b.to(a.dtype))
    a, b = a.detach().double(), b.detach().double()
    return bool(torch.isfinite(a).all() and torch.isfinite(b).all()) and \
        float((a - b).norm()) <= 1e-4 * max(float(a.norm()), float(b.norm())) + 1e-6


@contextlib.contextmanager
def _alpha_at_the_edge() -> Iterator[None]:
    """Opacus's RDP warning that the optimal order is the largest alpha tried, silenced: the epsilon
    is then a true bound, if not the tightest."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Optimal order is the largest alpha", UserWarning)
        yield


def noise_multiplier(cfg: TrainConfig, rate: float) -> float:
    """The noise multiplier spending dp_epsilon at dp_delta in cfg.steps steps sampled at `rate`
    (by the job's accountant)."""
    from opacus.accountants.utils import get_noise_multiplier  # lazy: opacus, for DP jobs only

    try:
        with _alpha_at_the_edge():
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
                 key: bytes, device: str, holders: tuple[str, ...] = ()) -> None:
        from opacus import GradSampleModule  # lazy: opacus, for DP jobs only
        from opacus.accountants import create_accountant
        from opacus.optimizers import DPOptimizer

        self.mechanism = mechanism_of(cfg, records)
        self.key, self.records, self.holders = key, records, tuple(sorted(holders))
        self.workload, self.steps = cfg.workload, cfg.steps
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
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
             guard: Callable, drawn: int | None = None) -> float:
        """One DP-SGD step on the step's sample (None: it drew no record; the noise is added all the
        same, as Opacus does for an empty batch) of `drawn` records (default: the batch's targets);
        the loss, NaN for an empty sample."""
        if self.taken() >= self.steps:  # the job's steps spend its target ε: one more would pass it
            raise BadInput(f"--dp-epsilon {self.mechanism.target_epsilon:g}: the job's {self.steps} steps spend it; "
                           "a further step would spend more, so none is taken")
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
            self._check_rows(len(batch[1]) if drawn is None else drawn)
        with guard("optimizer step"):
            self.optimizer.step()
        self.accountant.step(noise_multiplier=self.mechanism.noise_multiplier, sample_rate=self.mechanism.sample_rate)
        return value

    def taken(self) -> int:
        """The steps the accountant counts (resumed ones included)."""
        return sum(int(h[2]) for h in self.accountant.history)

    def _check_rows(self, drawn: int) -> None:
        """Each record of the sample must have one per-record gradient: more rows (a record duplicated
        by inputs, reshaped into several by the model) would each be clipped to C, the record not."""
        for name, p in self.named:
            grads = getattr(p, "grad_sample", None)
            rows = {len(g) for g in grads} if isinstance(grads, list) else {len(grads)} if grads is not None else set()
            if rows and rows != {drawn}:
                got = "/".join(map(str, sorted(rows)))
                raise BadInput(f"workload {self.workload!r}: parameter {name!r} got {got} "
                               f"per-record gradients for the {drawn} records drawn: inputs, forward and loss must "
                               "keep one row per record for DP-SGD to clip each record's gradient")

    def spent(self) -> float:
        """ε spent at δ by the steps run (resumed ones included)."""
        if not self.accountant.history:
            return 0.0
        with _alpha_at_the_edge():
            return float(self.accountant.get_epsilon(delta=self.mechanism.delta))

    def report(self) -> dict[str, Any]:
        m = self.mechanism
        return {"epsilon_spent": self.spent(), "delta": m.delta, "accountant": m.accountant,
                "target_epsilon": m.target_epsilon, "noise_multiplier": m.noise_multiplier,
                "sample_rate": m.sample_rate, "max_grad_norm": m.max_grad_norm, "records": self.records}

    def checkpoint(self, sealed: bool) -> dict[str, Any]:
        """What a resume needs: the accountant's history, the records sampled over (N and the holders),
        and the key only in a sealed checkpoint (a plaintext one would hand the host the samples and noise)."""
        return {"history": [list(h) for h in self.accountant.history], "records": self.records,
                "holders": list(self.holders), **({"key": self.key.hex()} if sealed else {})}

    def resume(self, stored: object, step: int, where: str) -> None:
        """The accountant's history (and key) from a checkpoint at `step`, over the same records; BadInput
        if it is not there, was written over other records, or is not the job's mechanism."""
        if not isinstance(stored, dict) or not isinstance(stored.get("history"), list):
            raise BadInput(f"checkpoint {where} does not record the privacy spent by its {step} steps: start afresh")
        # Another N or holder set would reuse the key (the same noise) over other records, with another sigma.
        was = (stored.get("records"), stored.get("holders"))
        if was != (self.records, list(self.holders)):
            said = f"{was[0]} training records of {_names(was[1])}" if was[0] is not None else "unrecorded records"
            raise BadInput(f"checkpoint {where} sampled over {said}; this job has {self.records} of "
                           f"{_names(list(self.holders))}: resume with the holders and data it trained on, "
                           "or start afresh")
        self.accountant.history = self._history(stored["history"], step, where)
        key = stored.get("key")
        if isinstance(key, str):
            self.key = bytes.fromhex(key)

    def _history(self, history: list, step: int, where: str) -> list[tuple[float, float, int]]:
        """A stored history believed only if every entry is this job's mechanism (sigma and q recomputed
        from the job and N), finite, and its steps sum to the checkpoint's."""
        m, out = self.mechanism, []
        for entry in history:
            ok = isinstance(entry, (list, tuple)) and len(entry) == 3 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in entry)
            if not ok or not all(math.isfinite(v) for v in entry) or not isinstance(entry[2], int) or entry[2] < 1 \
                    or not math.isclose(entry[0], m.noise_multiplier, rel_tol=1e-12) \
                    or not math.isclose(entry[1], m.sample_rate, rel_tol=1e-12):
                raise BadInput(f"checkpoint {where}: its privacy history is not this job's mechanism (noise "
                               f"multiplier {m.noise_multiplier:.6g}, sample rate {m.sample_rate:.6g}): start afresh")
            out.append((float(entry[0]), float(entry[1]), int(entry[2])))
        if sum(n for _, _, n in out) != step:
            raise BadInput(f"checkpoint {where} does not record the privacy spent by its {step} steps: start afresh")
        return out


def _names(holders: object) -> str:
    return ", ".join(map(str, holders)) if isinstance(holders, list) and holders else "no holders named"


def epsilon_after(mechanism: Mechanism, steps: int) -> float:
    """ε at δ that `steps` steps of `mechanism` spend: the live view's, which sees only step numbers
    (the same count the job's accountant makes, its noise and rate being fixed for the job)."""
    from opacus.accountants import create_accountant  # lazy: opacus, for DP jobs only

    accountant = create_accountant(mechanism=mechanism.accountant)
    accountant.history = [(mechanism.noise_multiplier, mechanism.sample_rate, steps)]
    with _alpha_at_the_edge():
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
        self.drawn = 0  # the records of the step last yielded: DP-SGD checks one per-record gradient each

    def __iter__(self) -> Iterator[Any]:
        records = self.resident()
        holders = sorted(self.scheduler.sizes)
        step = self.start
        while True:
            # A holder that left ends the job (its goodbye read before each step): going on without it
            # would draw this step's noise, which a rerun over every holder draws again, over other data.
            gone = sorted(self.departed(holders))
            if gone:
                zero(records)
                raise HolderLost(gone[0], "it left the cohort", during="a DP-SGD job, whose sample and noise "
                                 "cover every holder's records: the job stops here, to resume once it is back")
            # Each record taken at rate q, independently, as the accounting over N assumes.
            picked = poisson_sample(self.key, step, len(records), self.rate).numpy()
            step += 1
            self.drawn = len(picked)
            yield self.batching.to_batch(as_tensors(records[picked], torch.from_numpy)) if len(picked) else None

    def close(self) -> None:
        super().close()
        if self.records is not None:
            zero(self.records)
            self.records = None

    def resident(self) -> np.ndarray:
        """All holders' training records, travelled once (a copy: the buffer is scrubbed by the next travel)."""
        if self.records is None:  # N would change with a holder lost, and with it the sampling the accounting assumes
            self.records = self.travel_all("every holder's records must be resident for DP-SGD")
        return self.records
