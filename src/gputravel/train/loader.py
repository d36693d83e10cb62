"""The one iterator training reaches data through: llm.c's (x, y) batches of B x T tokens, from a
:class:`ChunkSource`. A travel (:class:`TravelSource`), the TLS baseline (:class:`BaselineSource`)
and local files (:class:`LocalSource`, the G2 reference) see the same visits, so give equal batches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Mapping, Protocol

import numpy as np
import torch

from gputravel.errors import BadInput, HolderLost, ProtocolError
from gputravel.protocol.control import BaselineReport
from gputravel.train.schedule import LoaderState, Scheduler, Visit

TOKEN_BYTES = 2  # llm.c shards hold uint16 tokens


def batch_at(tokens: np.ndarray, j: int, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The j-th llm.c window: x the B*T tokens from j*B*T, y the same shifted by one."""
    bt = batch * seq_len
    buf = torch.from_numpy(np.asarray(tokens[j * bt : j * bt + bt + 1], dtype=np.int64))
    return buf[:-1].view(batch, seq_len), buf[1:].view(batch, seq_len)


class ChunkSource(Protocol):
    def sizes(self) -> Mapping[str, int]:
        """Tokens per holder."""

    def fetch(self, visit: Visit) -> np.ndarray:
        """The visit's tokens (uint16), valid until the next fetch."""


@dataclass(frozen=True)
class Fetched:
    visit: Visit
    seconds: float
    report: object | None  # the travel report, when the source travelled


class LocalSource:
    """Holders' token streams read from local files (the G2 reference; no GPU travels)."""

    def __init__(self, tokens: Mapping[str, np.ndarray]) -> None:
        self._tokens = {name: np.asarray(t, dtype=np.uint16) for name, t in tokens.items()}
        self.last_report = None

    def sizes(self) -> Mapping[str, int]:
        return {name: len(t) for name, t in self._tokens.items()}

    def fetch(self, visit: Visit) -> np.ndarray:
        return self._tokens[visit.holder][visit.token_offset : visit.token_offset + visit.ntokens]


class TravellingEngine(Protocol):
    def travel(self, holder: str, dataset_offset: int): ...
    def buffer_view(self) -> memoryview: ...


class BaselineEngine(Protocol):
    def baseline(self, holder: str, dataset_offset: int) -> BaselineReport: ...
    def buffer_view(self) -> memoryview: ...


class TravelSource:
    """Each fetch is one travel (paper Fig. 3): the chunk lands in the GPU's protected memory."""

    move = "travel"  # the engine's method that fills the buffer

    def __init__(self, engine: TravellingEngine | BaselineEngine, dataset_bytes: Mapping[str, int]) -> None:
        self.engine = engine
        self._sizes = {name: n // TOKEN_BYTES for name, n in dataset_bytes.items()}
        self.last_report = None

    def sizes(self) -> Mapping[str, int]:
        return self._sizes

    def online(self) -> set[str]:
        """Holders lost earlier that the engine can reach again (one that admits holders while training says)."""
        online = getattr(self.engine, "online", None)
        return set(online()) if online is not None else set()

    def fetch(self, visit: Visit) -> np.ndarray:
        report = getattr(self.engine, self.move)(visit.holder, visit.token_offset * TOKEN_BYTES)
        self.last_report = report
        chunk = getattr(report, "chunk", None)
        if chunk is None:
            raise ProtocolError(f"holder {visit.holder} refused the travel: {getattr(report, 'refused', '')}")
        if chunk.nbytes < visit.ntokens * TOKEN_BYTES:
            raise ProtocolError(f"holder {visit.holder} moved {chunk.nbytes} bytes, {visit.ntokens * TOKEN_BYTES} were asked")
        return np.frombuffer(self.engine.buffer_view(), dtype=np.uint16, count=visit.ntokens)


class BaselineSource(TravelSource):
    """Fed by the centralised TLS baseline (paper 7.2): the same visits, buffer and bytes as travels."""

    move = "baseline"


class TravellingLoader:
    """Yields (x, y) int64 tensors of shape (B, T); travels whenever the buffer is used up."""

    def __init__(self, source: ChunkSource, batch: int, seq_len: int, buffer_bytes: int, *,
                 policy: str = "round_robin", state: LoaderState | None = None,
                 on_fetch: Callable[[Fetched], None] | None = None, device: str = "cpu") -> None:
        if batch <= 0 or seq_len <= 0:
            raise BadInput("batch and sequence length must be positive")
        self.source = source
        self.B, self.T = batch, seq_len
        self.scheduler = Scheduler(source.sizes(), buffer_bytes // TOKEN_BYTES, batch * seq_len, policy)
        self.state = state or LoaderState()
        self.on_fetch = on_fetch
        self.device = device
        self.stall_seconds = 0.0  # time spent waiting for data (travels), for the stall share
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
                tokens = self._fetch(visit)
            except HolderLost as exc:
                # The GPU is back and re-keyed; nothing of the partial chunk is used. Go on
                # with the other holders; this one's cursor stays put for when it returns.
                self.scheduler.offline.add(visit.holder)
                self.lost.append(str(exc))
                continue
            n = self.scheduler.windows_in(visit.ntokens)
            done = self.scheduler.consumed(after, visit)
            for j in range(before.skip, n):
                # Where a run stopped after this window resumes: the same visit, later windows.
                self.state = done if j + 1 == n else replace(before, skip=j + 1)
                x, y = batch_at(tokens, j, self.B, self.T)
                yield x.to(self.device), y.to(self.device)
            self.state = done

    def _rejoined(self) -> None:
        """A lost holder that has joined again is scheduled again, from its cursor."""
        online = getattr(self.source, "online", None)
        if online is not None and self.scheduler.offline:
            self.scheduler.offline -= online()

    def _fetch(self, visit: Visit) -> np.ndarray:
        t0 = time.perf_counter()
        try:
            # Copy out of the buffer once: the next travel scrubs and refills it.
            tokens = np.array(self.source.fetch(visit), dtype=np.int64)
        finally:  # a failed travel is waiting time too
            spent = time.perf_counter() - t0
            self.stall_seconds += spent
        self.fetches += 1
        if self.on_fetch is not None:
            self.on_fetch(Fetched(visit, spent, getattr(self.source, "last_report", None)))
        return tokens
