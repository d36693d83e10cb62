"""The training job: the workload (GPT-2, or the consortium's own, issue 27) trained on batches
from the one loader, wherever they come from.

The same `train` runs ``--loader travelling`` (in the orchestrator CVM) and ``--loader local``:
with the same seed, order and thread count their losses and metrics are bit-identical on CPU (G2).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import io
import math
import statistics
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from gputravel.data.tokenizer import get_tokenizer
from gputravel.errors import BadInput, HolderLost
from gputravel.train.job import TrainConfig
from gputravel.train.loader import ChunkSource, Fetched, Shuffled, TravellingLoader
from gputravel.train.model import GPT, GPTConfig, pick_device
from gputravel.train.whole import Whole, check_kept
from gputravel.train.privacy import Private, Resident, check_fits, check_independent, check_job, check_model, new_key
from gputravel.train.ranks import DataParallel, Ranks
from gputravel.train.rundir import Kept, RunDir, Sealing, checkpoint_extra, load_checkpoint
from gputravel.train.schedule import LoaderState
from gputravel.workloads import Workload, gpt_loss, load_workload

__all__ = ["StepEvent", "TrainResult", "build_model", "gpt_config", "lr_at", "make_report", "train", "train_step",
           "workload_of"]


class Anchor(Protocol):
    """State kept outside the checkpoint that must go on with it (the orchestrator's travel log):
    each checkpoint stores ``record()``; a resume hands it to ``resume()``, which raises if that
    state is not there to go on with."""

    def record(self) -> dict[str, object] | None: ...

    def resume(self, recorded: object) -> None: ...


@dataclass(frozen=True)
class StepEvent:
    step: int
    loss: float
    tokens_per_s: float
    holder: str  # whose data this batch came from
    travels: int
    stall_share: float
    elapsed_s: float
    # Held-out metrics evaluated at this step, "HOLDER.METRIC" and "all.METRIC" (else empty).
    evaluated: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainResult:
    losses: list[float]
    travels: list[dict] = field(default_factory=list)
    stall_seconds: float = 0.0
    first_pass_seconds: float = 0.0  # of the stall, the travels that brought units for the first time
    wall_seconds: float = 0.0
    sample: str = ""
    state: dict = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)  # holders lost during travels, with why
    stopped: bool = False  # asked to stop before cfg.steps: checkpointed where it stopped
    evals: list[dict] = field(default_factory=list)  # held-out metrics per holder and overall, by step
    weights: bytes = b""  # the trained state_dict as torch.save writes it, when Kept.weights asked for it
    dp: dict | None = None  # a DP job's mechanism and the ε its steps spent (train/privacy.py)

    @property
    def stall_share(self) -> float:
        return self.stall_seconds / self.wall_seconds if self.wall_seconds else 0.0


def sample_tokenizer(name: str):
    """The tokenizer for the final sample, or None where it cannot load (the run then has no sample)."""
    try:
        return get_tokenizer(name)
    except BadInput:
        return None


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up then cosine decay to 10%, as llm.c schedules it."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def workload_of(cfg: TrainConfig) -> Workload:
    return load_workload(cfg.workload, cfg.workload_code, cfg.record_schema, cfg.script)


def gpt_config(cfg: TrainConfig) -> GPTConfig:
    return GPTConfig(block_size=cfg.seq_len, vocab_size=cfg.vocab_size, n_layer=cfg.n_layer,
                     n_head=cfg.n_head, n_embd=cfg.n_embd)


def build_model(cfg: TrainConfig, device: str, workload: Workload | None = None):
    """The job's model and optimizer, from its seed."""
    workload = workload or workload_of(cfg)
    if not workload.tokens:
        return workload.build(cfg, device)
    torch.manual_seed(cfg.seed)
    model = GPT(gpt_config(cfg)).to(device)
    optimizer = model.configure_optimizer(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    return model, optimizer


def train_step(model, optimizer, x: torch.Tensor, y: torch.Tensor, lr: float, *, forward=None,
               backward: Callable[[torch.Tensor], None] | None = None, loss_of=gpt_loss,
               guard: Callable[[str], AbstractContextManager] | None = None) -> float:
    """One step as every method trains (FedAvg's holders too): the optimizer at `lr`, clipped to norm 1.
    `guard`: the workload's (Workload.guard), around its code's backward and optimizer step."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = loss_of(forward or model, x, y)
    optimizer.zero_grad(set_to_none=True)
    with (guard or _unguarded)("backward"):
        (backward or torch.Tensor.backward)(loss)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with (guard or _unguarded)("optimizer step"):
        optimizer.step()
    return loss.item()


def _unguarded(what: str) -> AbstractContextManager:
    return nullcontext()


KEEP_ALL = Kept()  # a run with no manifest: metrics and plaintext checkpoints, as before issue 28


class Outputs:
    """The run directory as a job's manifest lets it be written (Kept): what it does not allow is
    never written, and checkpoints go through the sealer when there is one."""

    def __init__(self, run_dir: RunDir, kept: Kept) -> None:
        self.run_dir, self.kept = run_dir, kept

    def truncate_metrics(self, step: int) -> None:
        if self.kept.metrics:
            self.run_dir.truncate_metrics(step)

    def append_metrics(self, row: dict) -> None:
        if self.kept.metrics:
            self.run_dir.append_metrics(row)

    def save_checkpoint(self, model, optimizer, step: int, extra: dict) -> None:
        if self.kept.checkpoints:
            self.run_dir.save_checkpoint(model, optimizer, step, extra, sealer=self.kept.sealer)

    def plots(self, losses: list[float], evals: list[dict], title: str) -> None:
        if self.kept.metrics:
            self.run_dir.plot_losses(list(range(1, len(losses) + 1)), losses, title=title)
            self.run_dir.plot_eval(evals)

    def write_sample(self, text: str) -> None:
        self.run_dir.write_sample(text)  # asked for only where the manifest allows samples (tokenizer)


def state_bytes(model: torch.nn.Module | dict[str, Any]) -> bytes:
    """The model's state_dict (or a state_dict) as torch.save writes it: what a release seals and
    `model open` gives back."""
    buf = io.BytesIO()
    torch.save(model if isinstance(model, dict) else model.state_dict(), buf)
    return buf.getvalue()


def train(cfg: TrainConfig, source: ChunkSource, *, run_dir: Path | None = None,
          on_step: Callable[[StepEvent], None] | None = None, resume_from: Path | None = None,
          tokenizer=None, ranks: Ranks | None = None,
          should_stop: Callable[[], bool] | None = None, anchor: Anchor | None = None,
          kept: Kept = KEEP_ALL, dp_key: bytes | None = None) -> TrainResult:
    """Train for cfg.steps; `tokenizer` only decodes the final sample; `kept`: what the run directory
    may hold (metrics, checkpoints, sealed or not) and whether the weights come back for a release.

    `resume_from` continues a checkpoint of the same job with the losses an uninterrupted run
    would have had. With `ranks` this is one rank of a data-parallel job: gradients are averaged
    through the encrypted ring, keyed by the ranks attesting one another first; only rank 0
    writes `run_dir` and samples. `should_stop` ends the run after a step, checkpointed there; with
    ranks, every rank stops at the step where any was asked. `anchor`: see :class:`Anchor`. A DP job
    (cfg.dp_epsilon) samples and noises with `dp_key` (default a fresh secret; train/privacy.py)."""
    torch.set_num_threads(cfg.threads)
    device = pick_device()
    workload = workload_of(cfg)
    model, optimizer = build_model(cfg, device, workload)
    lead = ranks is None or ranks.rank == 0
    out = Outputs(RunDir(run_dir), kept) if run_dir is not None and lead else None
    start, resume, result = 0, None, TrainResult(losses=[])
    # Before anything travels: what DP-SGD cannot account for is refused here (train/privacy.py).
    private = _private(cfg, workload, source, model, optimizer, device, ranks, dp_key) if cfg.dp_epsilon else None
    # What each holder brought, hashed only when a checkpoint is written or resumed, and once.
    prints = functools.cache(lambda: dict(source.fingerprints()) if hasattr(source, "fingerprints") else {})
    if resume_from is not None:
        start, resume, result, spent = _resume(cfg, resume_from, model, optimizer, ranks, anchor, prints, kept.sealer)
        if private is not None:  # the privacy its steps spent counts on
            private.resume(spent, start, str(resume_from))
    # The ranks attest one another here; the job's ddp_compress sets the ring's compression.
    dp = DataParallel.open(ranks.for_job(cfg.ddp_compress), device) if ranks is not None else None
    try:
        if out is not None:
            out.truncate_metrics(start)  # a resumed run trains the steps after its checkpoint again
        step_model = dp.wrap(model) if dp is not None else model  # `model` stays the bare GPT
        loader = _loop(cfg, workload, source, device, model, step_model, optimizer, start, resume, result, out, dp,
                       on_step, should_stop, anchor, prints, private)
        # Collective with ranks: every rank gathers; alone, only what the checkpoint needs.
        final = _extra(cfg, loader.state, result, dp, anchor, prints) if out is not None or dp is not None else {}
        if private is not None:
            final["dp"] = private.checkpoint(sealed=kept.sealer is not None)
            result.dp = private.report()
    finally:
        if dp is not None:
            dp.close()
    result.stall_seconds, result.first_pass_seconds = loader.stall_seconds, loader.first_pass_seconds
    result.state = loader.state.to_dict()
    result.lost = list(loader.lost)
    if cfg.sample_tokens and tokenizer is not None and lead and workload.tokens:
        result.sample = _sample(model, cfg, device, tokenizer)
    if kept.weights and lead:
        result.weights = state_bytes(model)
    if out is not None:
        out.save_checkpoint(model, optimizer, len(result.losses), final)  # cfg.steps unless stopped
        title = "GPT-2" if workload.tokens else f"{workload.name} workload"
        out.plots(result.losses, result.evals, f"{title} loss ({cfg.loader} loader)")
        if result.sample:
            out.write_sample(result.sample)
    return result


def _loop(cfg: TrainConfig, workload: Workload, source: ChunkSource, device: str, model, step_model, optimizer, start: int,
          resume: LoaderState | None, result: TrainResult, out: Outputs | None, dp: DataParallel | None,
          on_step, should_stop=None, anchor: Anchor | None = None,
          prints: Callable[[], dict] = dict, private: Private | None = None) -> TravellingLoader:
    """Steps start..cfg.steps; returns the loader (its state and stalls are the run's)."""
    holder_of_batch = {"name": ""}

    def fetched(f: Fetched) -> None:
        if not f.held:  # the batches that follow an evaluation are still the training visit's
            holder_of_batch["name"] = f.visit.holder
        if not f.kept:  # a kept visit did not travel
            result.travels.append(travel_entry(f))

    batching = None if workload.tokens else Shuffled(cfg.batch, cfg.seed, lambda t: workload.inputs(t, device), device)
    kind, args = TravellingLoader, {}
    if private is not None:  # every record resident, a Poisson sample a step
        kind, args = Resident, {"key": private.key, "rate": private.mechanism.sample_rate, "start": start}
    elif cfg.shuffle == "all":  # every record kept, one shuffle over them all an epoch
        assert workload.schema is not None  # TrainConfig allows shuffle all for records only
        _check_kept_everywhere(cfg.resident_mib, source.sizes(), workload.schema.record_bytes, dp)
        kind, args = Whole, {"seed": cfg.seed}
    loader = kind(source, cfg.batch, cfg.seq_len, cfg.buffer_bytes, policy=cfg.schedule, state=resume,
                  on_fetch=fetched, device=device, batching=batching, resident_bytes=cfg.resident_mib << 20, **args)
    batches = iter(loader)
    model.train()
    t_start = time.perf_counter()
    try:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            batch = next(batches)
            if private is not None:
                assert isinstance(loader, Resident)
                value = private.step(batch, lr_at(cfg, step), step, workload.loss, workload.guard, drawn=loader.drawn)
                holder_of_batch["name"] = "all"  # a sample over every holder's records
            else:  # with ranks, the gradients' all-reduce runs in dp.backward, over the ring
                value = train_step(model, optimizer, *batch, lr_at(cfg, step), forward=step_model,
                                   backward=dp.backward if dp is not None else None, loss_of=workload.loss,
                                   guard=workload.guard)
            result.losses.append(value)
            now = time.perf_counter()
            per_batch = cfg.batch if cfg.records else cfg.batch * cfg.seq_len
            evaluated = _eval_point(cfg, workload, model, loader, dp, step, result)
            event = StepEvent(step=step, loss=value, tokens_per_s=per_batch / (now - t0),
                              holder=holder_of_batch["name"], travels=loader.fetches,
                              stall_share=loader.stall_seconds / (now - t_start), elapsed_s=now - t_start,
                              evaluated=evaluated)
            checkpoint = bool(cfg.checkpoint_every) and (step + 1) % cfg.checkpoint_every == 0
            if checkpoint and (out is not None or dp is not None):
                extra = _extra(cfg, loader.state, result, dp, anchor, prints)  # with ranks a collective: every rank gathers
                if private is not None:
                    extra["dp"] = private.checkpoint(sealed=out is not None and out.kept.sealer is not None)
            if out is not None:
                out.append_metrics({k: v for k, v in dataclasses.asdict(event).items() if k != "evaluated"})
                if checkpoint:
                    out.save_checkpoint(model, optimizer, step + 1, extra)
            if on_step is not None:
                on_step(event)
            if step + 1 < cfg.steps and _stop_asked(should_stop, dp):
                result.stopped = True
                break
    finally:
        loader.close()  # records kept for the job's steps live no longer
    result.wall_seconds = time.perf_counter() - t_start
    return loader


def _check_kept_everywhere(resident_mib: int, sizes: dict, record_bytes: int, dp: DataParallel | None) -> None:
    """check_kept on this rank's share, and with ranks a vote first: every rank refuses before any
    record travels, each naming the flag, not a broken link to the rank that refused."""
    try:
        check_kept(resident_mib, sizes, record_bytes)
    except BadInput:
        if dp is not None:
            dp.anyone(True)
        raise
    if dp is not None and dp.anyone(False):
        raise BadInput(f"--shuffle all: another rank's share of the holders' training records does not fit "
                       f"--resident-mib {resident_mib} (each rank keeps its own share): raise it")


def travel_entry(f: Fetched) -> dict:
    """A fetch as the report lists it: the visit, the wait and, for a travel, its timings."""
    entry = {"holder": f.visit.holder, "token_offset": f.visit.token_offset, "tokens": f.visit.ntokens,
             "wait_ms": f.seconds * 1e3, **({"held_out": True} if f.held else {})}
    if f.report is not None:
        entry.update(travel_id=f.report.travel_id, total_ms=f.report.total_ms, steps_ms=dict(f.report.steps_ms))
    return entry


def _eval_point(cfg: TrainConfig, workload: Workload, model, loader: TravellingLoader, dp: DataParallel | None,
                step: int, result: TrainResult) -> dict[str, float]:
    """At every eval_every-th step and the last: each holder's held-out metrics (a collective with ranks)."""
    last = step + 1 == cfg.steps
    if workload.tokens or not (last or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)):
        return {}
    sums = evaluate(workload, model, loader)
    if dp is not None:
        sums = {h: m for rank in dp.gather(sums) for h, m in rank.items()}  # each rank holds its own holders
    result.evals.append({"step": step + 1, **summarise(sums)})
    done = result.evals[-1]
    return {f"{who}.{k}": float(v) for who, m in [*done["per_holder"].items(), ("all", done["all"])]
            for k, v in m.items() if k != "records"}


def evaluate(workload: Workload, model, loader: TravellingLoader) -> dict[str, dict[str, float]]:
    """Metric sums per holder over its held-out records, which travel only here."""
    sums: dict[str, dict[str, float]] = {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for holder in sorted(loader.scheduler.sizes):
                part: dict[str, float] = {}
                try:
                    for records in loader.held_out(holder):
                        x, y = workload.batch(records, loader.batching.device)
                        for k, v in workload.metrics(model, x, y).items():
                            part[k] = part.get(k, 0.0) + v
                except HolderLost:  # lost in an evaluation travel: left out of this evaluation, as of training
                    continue
                if part:
                    sums[holder] = part
    finally:
        model.train(was_training)
    return sums


def summarise(sums: dict[str, dict[str, float]]) -> dict:
    """Sums to means, per holder and over all holders' held-out records."""
    def means(s: dict[str, float]) -> dict[str, float]:
        n = s.get("count", 0.0)
        return {**{k: v / n for k, v in s.items() if k != "count" and n}, "records": int(n)}

    total: dict[str, float] = {}
    for s in sums.values():
        for k, v in s.items():
            total[k] = total.get(k, 0.0) + v
    return {"per_holder": {h: means(s) for h, s in sorted(sums.items())}, "all": means(total)}


def _private(cfg: TrainConfig, workload: Workload, source: ChunkSource, model, optimizer, device: str,
             ranks: Ranks | None, key: bytes | None) -> Private:
    """The job's DP-SGD, once its rules hold: records, one GPU, a model Opacus trains, every record resident."""
    check_job(cfg, ranks.world_size if ranks is not None else 1)
    assert workload.schema is not None  # TrainConfig refuses DP for GPT-2's tokens and for scripts
    check_model(model, workload.name)
    check_independent(workload, model)
    sizes = source.sizes()
    records = check_fits(cfg, sizes, workload.schema.record_bytes)
    return Private(cfg, model, optimizer, records, key if key is not None else new_key(), device, holders=tuple(sizes))


def _stop_asked(should_stop: Callable[[], bool] | None, dp: DataParallel | None) -> bool:
    # Ranks vote at every step, asked or not: a rank that stopped alone would leave its peers waiting.
    asked = should_stop is not None and bool(should_stop())
    return dp.anyone(asked) if dp is not None else asked


def _extra(cfg: TrainConfig, state: LoaderState, result: TrainResult, dp: DataParallel | None,
           anchor: Anchor | None = None, prints: Callable[[], dict] = dict) -> dict:
    """A checkpoint's extra: enough to resume exactly. With ranks a collective gathering every
    rank's loader state, losses, travels and anchor record; "losses" and "travels" stay rank 0's."""
    extra = {"config": cfg.to_dict(), "losses": list(result.losses), "travels": list(result.travels),
             "evals": list(result.evals)}
    anchored = {"travel_log": anchor.record()} if anchor is not None else {}
    anchored["sources"] = prints()  # what each holder brought: resumed only over the same
    if dp is None:
        return {**extra, "loader": state.to_dict(), **anchored}
    ranks = dp.gather({"loader": state.to_dict(), "losses": list(result.losses), "travels": list(result.travels),
                       **anchored})
    extra.update(world_size=len(ranks), loaders=[r.pop("loader") for r in ranks], rank_results=ranks)
    if dp.ranks.shares:
        extra["shares"] = [list(share) for share in dp.ranks.shares]
    return extra


def checkpoint_world_size(path: Path) -> int:
    """The ranks of the job that wrote the checkpoint (1 without ranks)."""
    world = checkpoint_extra(path).get("world_size", 1)
    if type(world) is not int or world < 1:
        raise BadInput(f"checkpoint {path} is inconsistent (no world size); start the run afresh")
    return world


def checkpoint_shares(path: Path) -> tuple[tuple[str, ...], ...] | None:
    """Which holders each rank trained on, as the checkpoint recorded (None: not recorded)."""
    shares = checkpoint_extra(path).get("shares")
    if shares is None:
        return None
    if not (isinstance(shares, list) and all(isinstance(s, list) and all(isinstance(n, str) for n in s) for s in shares)):
        raise BadInput(f"checkpoint {path} is inconsistent (its shares); start the run afresh")
    return tuple(tuple(s) for s in shares)


def _resume(cfg: TrainConfig, path: Path, model, optimizer, ranks: Ranks | None,
            anchor: Anchor | None = None, prints: Callable[[], dict] = dict,
            sealer: Sealing | None = None) -> tuple[int, LoaderState, TrainResult, object]:
    """The checkpoint's step, this rank's loader state and results so far, and a DP job's privacy state."""
    data = None
    if ranks is not None and ranks.resume_sha384:
        data = _read_bound(path, ranks.resume_sha384)
    step, extra = load_checkpoint(path, model, optimizer, data=data, sealer=sealer)
    stored = _stored_job(extra.get("config"))
    if stored != cfg:
        raise BadInput(f"checkpoint {path} belongs to another job (differs in: {', '.join(cfg.differences(stored))}); "
                       "resume with the job's own settings")
    if not 0 < step <= cfg.steps or len(extra.get("losses", ())) != step:
        raise BadInput(f"checkpoint {path} is inconsistent (step {step}); start the run afresh")
    loader, mine = _rank_share(path, extra, step, ranks)
    _check_sources(path, mine.get("sources"), prints())
    if anchor is not None:  # before any batch: its state must be there to go on with
        anchor.resume(mine.get("travel_log"))
    result = TrainResult(losses=list(mine["losses"]), travels=list(mine.get("travels", ())),
                         evals=list(extra.get("evals", ())))
    return step, LoaderState.from_dict(loader), result, extra.get("dp")


def _check_sources(path: Path, stored: object, now: dict) -> None:
    """A holder whose data or split changed since the checkpoint would mix held-out and trained
    records, or train on other data under the old cursors: refused, naming it."""
    if stored is None:  # a checkpoint from before holders' data was recorded
        return
    if not isinstance(stored, dict):
        raise BadInput(f"checkpoint {path} is inconsistent (its holders' data); start the run afresh")
    changed = sorted(str(h) for h, d in stored.items() if h in now and now[h] != d)
    if changed:
        raise BadInput(f"checkpoint {path}: the data or held-out split of {_holders(changed)} changed since it was "
                       "written; resume with the data it trained on, or start afresh")


def _holders(names: list[str]) -> str:
    return f"holder {names[0]!r}" if len(names) == 1 else "holders " + ", ".join(map(repr, names))


def _stored_job(values: object) -> TrainConfig | None:
    """The job a checkpoint records (None: none this schema reads)."""
    try:
        return TrainConfig.from_dict(values)
    except BadInput:
        return None


def _read_bound(path: Path, digest: bytes) -> bytes:
    """The checkpoint's bytes, read once, if they are the ones this rank's keys are bound to."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise BadInput(f"no checkpoint at {path}: {exc.strerror}") from None
    if not hmac.compare_digest(hashlib.sha384(data).digest(), digest):
        raise BadInput(f"checkpoint {path} changed after the ranks agreed on it; resume again")
    return data


def _rank_share(path: Path, extra: dict, step: int, ranks: Ranks | None) -> tuple[dict, dict]:
    """This rank's loader state, and its losses and travels; the rank count must be the checkpoint's."""
    rank, world = (0, 1) if ranks is None else (ranks.rank, ranks.world_size)
    if "loaders" not in extra:  # a checkpoint of a job without ranks
        if world != 1:
            raise BadInput(f"checkpoint {path} is of a job of 1 rank; resume it with 1 rank, not {world}")
        return extra["loader"], extra
    stored, loaders, results = extra.get("world_size"), extra["loaders"], extra.get("rank_results")
    if stored != world:
        raise BadInput(f"checkpoint {path} is of a job of {stored} ranks; resume it with {stored} ranks, not {world}")
    whole = isinstance(loaders, list) and isinstance(results, list) and len(loaders) == len(results) == world
    if not whole or any(not isinstance(r, dict) or len(r.get("losses", ())) != step for r in results):
        raise BadInput(f"checkpoint {path} is inconsistent (its ranks' states); start the run afresh")
    _check_shares(path, extra, loaders[rank], ranks)
    return loaders[rank], results[rank]


def _check_shares(path: Path, extra: dict, loader: dict, ranks: Ranks | None) -> None:
    """A resumed rank keeps its holders: the shares must be the checkpoint's and its cursors its
    own holders', or a chunk would reach two ranks."""
    if ranks is None or not ranks.shares:
        return
    mine = set(ranks.shares[ranks.rank])
    stored = extra.get("shares")
    if stored is not None and stored != [list(s) for s in ranks.shares]:
        raise BadInput(f"checkpoint {path} was written with other shares of the holders ({stored}); "
                       "resume with the shares it records")
    cursors, last = (loader.get("cursors"), loader.get("last")) if isinstance(loader, dict) else (None, 0)
    if not isinstance(cursors, dict) or not (last is None or isinstance(last, str)):
        raise BadInput(f"checkpoint {path} is inconsistent (its ranks' states); start the run afresh")
    named = set(cursors) | ({last} if last is not None else set())
    if not named <= mine:
        raise BadInput(f"checkpoint {path}: rank {ranks.rank}'s cursors name holders outside its share "
                       f"({', '.join(sorted(map(str, named - mine)))})")


def _sample(model, cfg: TrainConfig, device: str, tokenizer) -> str:
    model.eval()
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    prompt = [int(t) for t in tokenizer.encode("\n")][:1] or [0]  # a new line as the prompt
    start = torch.tensor([prompt], dtype=torch.long, device=device)
    out = model.generate(start, cfg.sample_tokens, temperature=0.8, top_k=40, generator=gen)
    return tokenizer.decode(out[0, len(prompt):].tolist())


def make_report(cfg: TrainConfig, result: TrainResult) -> dict:
    """The run's report.json: config, per-step losses, travels with timings, stall share."""
    losses = result.losses
    # A DP step whose Poisson sample drew no record has no loss (NaN): left out of the means.
    head, tail = [v for v in losses[:10] if v == v], [v for v in losses[-10:] if v == v]
    step_keys = sorted({k for t in result.travels for k in t.get("steps_ms", {})})
    medians = {k: statistics.median(t["steps_ms"][k] for t in result.travels if "steps_ms" in t) for k in step_keys}
    return {"config": cfg.to_dict(), "losses": losses, "final_loss": losses[-1] if losses else None,
            "loss_before": sum(head) / len(head) if head else None,
            "loss_after": sum(tail) / len(tail) if tail else None,
            "travels": result.travels, "travel_count": len(result.travels), "travel_median_steps_ms": medians,
            "stall_s": result.stall_seconds, "wall_s": result.wall_seconds, "stall_share": result.stall_share,
            "first_pass_s": result.first_pass_seconds,
            "loader_state": result.state, "holders_lost": result.lost, "stopped": result.stopped,
            "sample": result.sample, "workload": cfg.workload,
            "eval": {k: result.evals[-1][k] for k in ("per_holder", "all")} if result.evals else None,
            "eval_history": result.evals, "dp": result.dp}
