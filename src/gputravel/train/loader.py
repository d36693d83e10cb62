"""The one iterator training reaches data through, from a :class:`ChunkSource`: llm.c's (x, y)
windows of B x T tokens, or (issue 27) batches of B records shuffled within each visit. A travel
(:class:`TravelSource`), the TLS baseline (:class:`BaselineSource`) and local files
(:class:`LocalSource`, the G2 reference) see the same visits, so give equal batches.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

import numpy as np
import torch

from gputravel.data.holder_tokens import load_tokens
from gputravel.data.records import Units, as_tensors, load_records, split_arrays
from gputravel.files import EVAL_SHARE
from gputravel.protocol.layout import layout_for, manifest_piece_bytes
from gputravel.errors import BadInput, HolderLost, ProtocolError
from gputravel.protocol.control import BaselineReport
from gputravel.train.schedule import LoaderState, Scheduler, Visit

TOKEN_BYTES = 2  # llm.c shards hold uint16 tokens
TOKEN = np.dtype("<u2")


def batch_at(tokens: np.ndarray, j: int, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The j-th llm.c window: x the B*T tokens from j*B*T, y the same shifted by one."""
    bt = batch * seq_len
    buf = torch.from_numpy(np.asarray(tokens[j * bt : j * bt + bt + 1], dtype=np.int64))
    return buf[:-1].view(batch, seq_len), buf[1:].view(batch, seq_len)


@dataclass(frozen=True)
class Cut:
    """How one holder's dataset travels: units (tokens or records) in manifest pieces, its
    training units first, its held-out ones from the next piece (data/records.py)."""

    units: Units
    train: int
    held: int = 0
    dtype: np.dtype = TOKEN
    digest: str = ""  # what the holder brought (manifest, counts, schema): a checkpoint is resumed only over it

    @classmethod
    def tokens(cls, dataset_bytes: int) -> Cut:
        return cls(Units(TOKEN_BYTES, TOKEN_BYTES), dataset_bytes // TOKEN_BYTES)

    def byte_offset(self, unit: int, held: bool = False) -> int:
        return (self.units.eval_base(self.train) if held else 0) + self.units.offset(unit)


class ChunkSource(Protocol):
    def sizes(self) -> Mapping[str, int]:
        """Training units (tokens or records) per holder."""

    def fetch(self, visit: Visit) -> np.ndarray:
        """The visit's units, valid until the next fetch."""


@dataclass(frozen=True)
class Fetched:
    visit: Visit
    seconds: float
    report: object | None  # the travel report, when the source travelled
    held: bool = False  # held-out records, fetched for evaluation only
    kept: bool = False  # trained on again from the records kept (resident_mib): no travel


class LocalSource:
    """Holders' tokens or records read from local files (the G2 reference; no GPU travels).
    Records: `held` are each holder's held-out records, `piece_bytes` the holders' manifest pieces."""

    def __init__(self, tokens: Mapping[str, np.ndarray], held: Mapping[str, np.ndarray] | None = None,
                 piece_bytes: int | None = None) -> None:
        records = piece_bytes is not None
        self._units = {name: np.asarray(t) if records else np.asarray(t, dtype=np.uint16) for name, t in tokens.items()}
        self._held = {name: np.asarray(h) for name, h in (held or {}).items()}
        self._piece = piece_bytes
        self.last_report = None

    @classmethod
    def of(cls, cfg: Any, holders: Sequence[tuple[str, str]], eval_share: float = EVAL_SHARE) -> LocalSource:
        """The holders' data read from disk as their CVMs lay it out: tokens, or records split as each
        holder splits them (its held-out share, the default seed) in pieces of the job's layout."""
        if not cfg.records:
            return cls({name: load_tokens(path, cfg.tokenizer).tokens for name, path in holders})
        split = {name: split_arrays(load_records(path), eval_share) for name, path in holders}
        piece = manifest_piece_bytes(layout_for(cfg.buffer_bytes))
        return cls({n: t for n, (t, _) in split.items()}, {n: h for n, (_, h) in split.items()}, piece)

    def sizes(self) -> Mapping[str, int]:
        return {name: len(t) for name, t in self._units.items()}

    def held_sizes(self) -> Mapping[str, int]:
        return {name: len(self._held.get(name, ())) for name in self._units}

    def capacity(self, buffer_bytes: int) -> int:
        if self._piece is None:
            return buffer_bytes // TOKEN_BYTES
        return min(Units(t.dtype.itemsize, self._piece).capacity(buffer_bytes) for t in self._units.values())

    def fetch(self, visit: Visit) -> np.ndarray:
        return self._units[visit.holder][visit.token_offset : visit.token_offset + visit.ntokens]

    def fingerprints(self) -> dict[str, str]:
        """Each holder's data and split, as a digest: a checkpoint is resumed only over the same."""
        return {name: hashlib.sha256(np.ascontiguousarray(t).tobytes()
                                     + np.ascontiguousarray(self._held.get(name, t[:0])).tobytes()).hexdigest()
                for name, t in self._units.items()}

    def fetch_held(self, visit: Visit) -> np.ndarray:
        return self._held[visit.holder][visit.token_offset : visit.token_offset + visit.ntokens]


class TravellingEngine(Protocol):
    def travel(self, holder: str, dataset_offset: int): ...
    def buffer_view(self) -> memoryview: ...


class BaselineEngine(Protocol):
    def baseline(self, holder: str, dataset_offset: int) -> BaselineReport: ...
    def buffer_view(self) -> memoryview: ...


class TravelSource:
    """Each fetch is one travel (paper Fig. 3): the chunk lands in the GPU's protected memory.
    `cuts`: how each holder's dataset travels (from its hello); tokens by default."""

    move = "travel"  # the engine's method that fills the buffer

    def __init__(self, engine: TravellingEngine | BaselineEngine, dataset_bytes: Mapping[str, int],
                 cuts: Mapping[str, Cut] | None = None) -> None:
        self.engine = engine
        self.cuts = dict(cuts) if cuts is not None else {n: Cut.tokens(b) for n, b in dataset_bytes.items()}
        self.last_report = None

    def sizes(self) -> Mapping[str, int]:
        return {name: cut.train for name, cut in self.cuts.items()}

    def held_sizes(self) -> Mapping[str, int]:
        return {name: cut.held for name, cut in self.cuts.items()}

    def fingerprints(self) -> dict[str, str]:
        return {name: cut.digest for name, cut in self.cuts.items() if cut.digest}

    def capacity(self, buffer_bytes: int) -> int:
        return min(cut.units.capacity(buffer_bytes) for cut in self.cuts.values())

    def online(self) -> set[str]:
        """Holders lost earlier that the engine can reach again (one that admits holders while training says)."""
        online = getattr(self.engine, "online", None)
        return set(online()) if online is not None else set()

    def departed(self, holders: Iterable[str]) -> set[str]:
        """Which of `holders` left the cohort? Asked before records they sent are trained on again
        without a travel (kept): goodbyes are read here, as a travel would read them first; nobody
        is admitted (a travel does that)."""
        goodbyes = getattr(self.engine, "read_goodbyes", None)
        if goodbyes is not None:
            goodbyes()
        online = getattr(self.engine, "online", None)
        here = online() if online is not None else getattr(self.engine, "holders", None)
        return set() if here is None else {h for h in holders if h not in here}

    def fetch(self, visit: Visit) -> np.ndarray:
        return self._move(visit, held=False)

    def fetch_held(self, visit: Visit) -> np.ndarray:
        return self._move(visit, held=True)

    def _move(self, visit: Visit, held: bool) -> np.ndarray:
        cut = self.cuts[visit.holder]
        report = getattr(self.engine, self.move)(visit.holder, cut.byte_offset(visit.token_offset, held))
        self.last_report = report
        chunk = getattr(report, "chunk", None)
        if chunk is None:
            raise ProtocolError(f"holder {visit.holder} refused the travel: {getattr(report, 'refused', '')}")
        if chunk.nbytes < (asked := cut.units.span(visit.ntokens)):
            raise ProtocolError(f"holder {visit.holder} moved {chunk.nbytes} bytes, {asked} were asked")
        return cut.units.read(self.engine.buffer_view(), visit.ntokens, cut.dtype)


class BaselineSource(TravelSource):
    """Fed by the centralised TLS baseline (paper 7.2): the same visits, buffer and bytes as travels."""

    move = "baseline"


class Windows:
    """GPT-2's batches: llm.c's windows of B x T tokens in order, y one token past x."""

    overlap = 1  # y needs one token past the window

    def __init__(self, batch: int, seq_len: int, device: str = "cpu") -> None:
        if batch <= 0 or seq_len <= 0:
            raise BadInput("batch and sequence length must be positive")
        self.B, self.T, self.device = batch, seq_len, device
        self.window = batch * seq_len

    def plan(self, units: np.ndarray, visit: Visit, epoch: int) -> Any:
        return np.array(units, dtype=np.int64)  # a copy: the next travel scrubs and refills the buffer

    def batch(self, plan: Any, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch_at(plan, j, self.B, self.T)
        return x.to(self.device), y.to(self.device)


class Shuffled:
    """Records' batches: B records at a time, shuffled within each visit by a permutation seeded
    with the job's seed, the epoch and the visit, so travelling and local runs draw the same."""

    overlap = 0

    def __init__(self, batch: int, seed: int, to_batch: Callable[[dict[str, torch.Tensor]], Any],
                 device: str = "cpu") -> None:
        if batch <= 0:
            raise BadInput("the batch size must be positive")
        self.window, self.seed, self.to_batch, self.device = batch, seed, to_batch, device

    def plan(self, units: np.ndarray, visit: Visit, epoch: int) -> Any:
        """The visit's records in their shuffled order, a tensor a field (copied once a visit: the
        buffer is scrubbed next travel, and a batch is then a slice)."""
        holder = int.from_bytes(hashlib.sha256(visit.holder.encode()).digest()[:8], "little")
        rng = np.random.default_rng([self.seed % (1 << 64), epoch, holder, visit.token_offset])
        return as_tensors(np.asarray(units)[rng.permutation(len(units))], torch.from_numpy)

    def batch(self, plan: Any, j: int) -> Any:
        return self.to_batch({name: t[j * self.window : (j + 1) * self.window] for name, t in plan.items()})


def zero(units: np.ndarray) -> None:
    """Every byte of `units` (a C-contiguous array we made) to zero, whatever its fields."""
    if not units.flags.c_contiguous:  # reshape would zero a copy, or fail
        raise ValueError("zero() takes a C-contiguous array")
    units.reshape(-1).view(np.uint8).fill(0)


class Kept:
    """Visits' units kept in the orchestrator's memory (the job's `resident_mib`): a visit kept
    trains again without travelling. Never the GPU's buffer, which the next travel scrubs; first
    come first kept while the budget lasts (which visits are kept changes no batch: G2); zeroed
    when the job ends, never checkpointed."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget, self.used = budget_bytes, 0
        self._units: dict[tuple[str, int, int, bool], np.ndarray] = {}

    def get(self, visit: Visit, held: bool = False) -> np.ndarray | None:
        return self._units.get((visit.holder, visit.token_offset, visit.ntokens, held))

    def keep(self, visit: Visit, units: np.ndarray, held: bool = False) -> np.ndarray:
        """A copy of `units` kept if the budget holds it; `units` as they were otherwise."""
        if not self.budget or self.used + units.nbytes > self.budget:
            return units
        copy = np.array(units)
        self._units[(visit.holder, visit.token_offset, visit.ntokens, held)] = copy
        self.used += copy.nbytes
        return copy

    def forget(self, holder: str | None = None) -> None:
        """Zero and drop what was kept (of `holder` only, one that left)."""
        for key in [k for k in self._units if holder is None or k[0] == holder]:
            units = self._units.pop(key)
            zero(units)  # the records, not only the references: the process may run on
            self.used -= units.nbytes


class TravellingLoader:
    """Yields (x, y) batches (`batching`: GPT-2's token windows by default); travels whenever the
    buffer is used up, unless the visit's units are kept (`resident_bytes`, see :class:`Kept`)."""

    def __init__(self, source: ChunkSource, batch: int, seq_len: int, buffer_bytes: int, *,
                 policy: str = "round_robin", state: LoaderState | None = None,
                 on_fetch: Callable[[Fetched], None] | None = None, device: str = "cpu",
                 batching: Windows | Shuffled | None = None, resident_bytes: int = 0) -> None:
        self.source = source
        self.kept = Kept(resident_bytes)
        self.batching = batching or Windows(batch, seq_len, device)
        capacity = getattr(source, "capacity", None)
        units = capacity(buffer_bytes) if capacity is not None else buffer_bytes // TOKEN_BYTES
        self.scheduler = Scheduler(source.sizes(), units, self.batching.window, policy, overlap=self.batching.overlap)
        self.state = state or LoaderState()
        self.on_fetch = on_fetch
        self.stall_seconds = 0.0  # time spent waiting for data (travels), for the stall share
        # Of it, each holder's first travel that arrived (its training units; its held-out ones): the
        # job's fixed start-up wait, N travels for N holders whatever the loader does. Every other wait
        # (units brought again, a holder's next chunks, a failed travel) is the steady state's.
        self.first_pass_seconds = 0.0
        self._arrived: set[tuple[str, bool]] = set()
        self.fetches = 0
        self.lost: list[str] = []  # holders lost in travels, with why

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            self._rejoined()
            before = self.state
            visit, after = self.scheduler.next_visit(before)
            if after.epoch != before.epoch:  # a new epoch began: resume points belong to it
                before = LoaderState(epoch=after.epoch, skip=before.skip)
            try:
                plan = self._fetch(visit, after.epoch)
            except HolderLost as exc:
                # The GPU is back and re-keyed; nothing of the partial chunk is used. Go on
                # with the other holders; this one's cursor stays put for when it returns.
                self.scheduler.offline.add(visit.holder)
                self.note_lost(str(exc))
                continue
            n = self.scheduler.windows_in(visit.ntokens)
            done = self.scheduler.consumed(after, visit)
            for j in range(before.skip, n):
                # Where a run stopped after this window resumes: the same visit, later windows.
                self.state = done if j + 1 == n else replace(before, skip=j + 1)
                yield self.batching.batch(plan, j)
            self.state = done

    def held_out(self, holder: str) -> Iterator[np.ndarray]:
        """`holder`'s held-out records in order, B at a time: one travel per buffer, never trained on.
        Nothing for a holder that is offline; one lost in a travel here is offline too (HolderLost)."""
        self._rejoined()
        fetch_held = getattr(self.source, "fetch_held", None)
        total = getattr(self.source, "held_sizes", dict)().get(holder, 0)
        offset, B = 0, self.batching.window
        while fetch_held is not None and offset < total and holder not in self.scheduler.offline:
            visit = Visit(holder, offset, min(self.scheduler.capacity, total - offset))
            try:
                records = self._kept(visit, held=True)
            except HolderLost as exc:  # it left: as a failed travel, offline and named
                self.note_lost(str(exc))
                raise
            if records is not None:
                records = records.copy()  # a workload's in-place change must not reach what is kept
            else:
                records = self._fetch_held(fetch_held, visit)
            for j in range(0, visit.ntokens, B):
                yield records[j : j + B]
            offset += visit.ntokens

    def close(self) -> None:
        """The job's steps are done: kept records are zeroed and dropped."""
        self.kept.forget()

    def travel_all(self, why: str) -> np.ndarray:
        """Every holder's training units, in name order, each visit travelling once, in one array (the
        caller zeroes it when the job ends). A holder lost meanwhile is BadInput: `why` all must be there."""
        parts: list[np.ndarray] = []
        try:
            for holder, total in sorted(self.scheduler.sizes.items()):
                for offset in range(0, total, self.scheduler.capacity):
                    parts.append(self._travel_once(Visit(holder, offset, min(self.scheduler.capacity, total - offset)),
                                                   why))
            return np.concatenate(parts)
        finally:
            for part in parts:  # copies on the way: only the caller's array stays
                zero(part)

    def _travel_once(self, visit: Visit, why: str) -> np.ndarray:
        t0, units = time.perf_counter(), None
        try:
            units = np.array(self.source.fetch(visit))  # a copy: the buffer is scrubbed by the next travel
        except HolderLost as exc:
            raise BadInput(f"holder {visit.holder!r} was lost while the job's records travelled ({exc}): "
                           f"{why}; run the job again") from None
        finally:
            # All of it the first pass: every record travels once, before the first batch can be drawn.
            self._waited(visit, False, time.perf_counter() - t0, arrived=units is not None, whole=True)
        self.fetches += 1
        if self.on_fetch is not None:
            self.on_fetch(Fetched(visit, time.perf_counter() - t0, getattr(self.source, "last_report", None)))
        return units

    def _fetch_held(self, fetch_held: Callable[[Visit], np.ndarray], visit: Visit) -> np.ndarray:
        t0, view = time.perf_counter(), None
        try:
            view = fetch_held(visit)
        except HolderLost as exc:  # as in training: it goes offline, the job goes on without it
            self.scheduler.offline.add(visit.holder)
            self.note_lost(str(exc))
            raise
        finally:  # the model waits for these as for training's: a stall too
            self._waited(visit, True, time.perf_counter() - t0, arrived=view is not None)
        if self.on_fetch is not None:
            self.on_fetch(Fetched(visit, time.perf_counter() - t0, getattr(self.source, "last_report", None), True))
        self.kept.keep(visit, view, held=True)  # its own copy: a workload may change what it is given
        return np.array(view)  # a copy: the buffer is scrubbed next travel

    def _waited(self, visit: Visit, held: bool, seconds: float, *, arrived: bool, whole: bool = False) -> None:
        self.stall_seconds += seconds
        if arrived and ((key := (visit.holder, held)) not in self._arrived or whole):
            self._arrived.add(key)
            self.first_pass_seconds += seconds

    def _rejoined(self) -> None:
        """A lost holder that has joined again is scheduled again, from its cursor."""
        online = getattr(self.source, "online", None)
        if online is not None and self.scheduler.offline:
            self.scheduler.offline -= online()

    def departed(self, holders: Iterable[str]) -> set[str]:
        """Of `holders`, those that left the cohort (the source says; a local one never loses any): each
        is offline from now and its kept records zeroed (the caller names it in `lost`)."""
        ask = getattr(self.source, "departed", None)
        gone: set[str] = ask(holders) if ask is not None else set()
        for holder in gone:
            self.kept.forget(holder)
            self.scheduler.offline.add(holder)
        return gone

    def note_lost(self, why: str) -> None:
        if why not in self.lost:
            self.lost.append(why)

    def _kept(self, visit: Visit, held: bool = False) -> np.ndarray | None:
        """The visit's kept units, if its holder is still in the cohort (HolderLost if it left: its kept
        records are zeroed, and it is trained on no more, as a failed travel would have it)."""
        units = self.kept.get(visit, held)
        if units is None:
            return None
        if self.departed({visit.holder}):
            raise HolderLost(visit.holder, "it left the cohort", during="the job (its kept records dropped)")
        if self.on_fetch is not None:
            self.on_fetch(Fetched(visit, 0.0, None, held, kept=True))
        return units

    def _fetch(self, visit: Visit, epoch: int) -> Any:
        if (units := self._kept(visit)) is not None:  # kept: no travel, no wait
            return self.batching.plan(units, visit, epoch)
        t0, plan = time.perf_counter(), None
        try:
            plan = self.batching.plan(self.kept.keep(visit, self.source.fetch(visit)), visit, epoch)
        finally:  # a failed travel is waiting time too
            spent = time.perf_counter() - t0
            self._waited(visit, False, spent, arrived=plan is not None)
        self.fetches += 1
        if self.on_fetch is not None:
            self.on_fetch(Fetched(visit, spent, getattr(self.source, "last_report", None)))
        return plan
