"""One shuffle over every holder's training records (the job's ``shuffle = "all"``, issue 27).

The records travel once, in holder name order, and stay kept in the orchestrator's memory (the
job's `resident_mib` must hold them: that is the retention holders approve). Each epoch is then
torch's own ``DataLoader(shuffle=True)`` over them, so a script ported to ``batches()`` draws the
very batches its stock loader drew over the same records: torch's global generator, as the stock
script's DataLoader uses it, an epoch begun at each call as a stock ``for`` loop begins one. The
workload loop seeds each epoch's shuffle from the job's seed instead, so a checkpoint resumes
mid-epoch. A holder that leaves is trained on no more from the next batch (its goodbye is read
before each one).
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any, Iterator, Mapping

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from gputravel.errors import BadInput, HolderLost
from gputravel.train.loader import TravellingLoader, zero
from gputravel.train.schedule import LoaderState

MIB = 1 << 20


class _Fields(Dataset):
    """Record i as (its fields' tensors, i): the default collate stacks them into a batch and its indices."""

    def __init__(self, fields: Mapping[str, torch.Tensor], n: int) -> None:
        self.fields, self.n = dict(fields), n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], int]:
        return {name: t[i] for name, t in self.fields.items()}, i


def check_kept(resident_mib: int, sizes: Mapping[str, int], record_bytes: int) -> None:
    """BadInput unless the job keeps room for every holder's training records."""
    need = sum(sizes.values()) * record_bytes
    if need > resident_mib * MIB:
        raise BadInput(f"--shuffle all: the holders' {sum(sizes.values())} training records take {need} bytes and "
                       f"stay kept for the job, --resident-mib {resident_mib} holds {resident_mib * MIB}: raise it "
                       f"to {-(-need // MIB)} or more (or shuffle within each visit)")


def epoch_seed(seed: int, epoch: int) -> int:
    return int.from_bytes(hashlib.sha256(f"shuffle-all/{seed}/{epoch}".encode()).digest()[:8], "little")


class Whole(TravellingLoader):
    """Batches of the job's size drawn by DataLoader(shuffle=True) over every training record, the
    last batch of an epoch short as DataLoader leaves it. `seed` None: torch's global generator."""

    def __init__(self, *args: Any, seed: int | None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.seed = seed
        self.fields: dict[str, np.ndarray] = {}  # each field of every record, in holder name order
        self.ranges: dict[str, slice] = {}  # each holder's records among them, while it stays
        self.alive = np.zeros(0, dtype=bool)
        self._next_epoch: int | None = None

    def __iter__(self) -> Iterator[Any]:
        """The loop's batches, epoch after epoch, from the state a checkpoint resumes."""
        epoch, skip = self.state.epoch, self.state.skip
        while True:
            yield from self._epoch(epoch, skip)
            epoch, skip = epoch + 1, 0

    def epoch_batches(self) -> Iterator[Any]:
        """A script's batches(): one epoch, begun now (a stock `for` over its DataLoader begins one)."""
        epoch = self.state.epoch if self._next_epoch is None else self._next_epoch
        self._next_epoch = epoch + 1
        return self._epoch(epoch, 0)

    def _epoch(self, epoch: int, skip: int) -> Iterator[Any]:
        self._bring()
        gen = None if self.seed is None else torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        dataset = _Fields({k: torch.from_numpy(v) for k, v in self.fields.items()}, len(self.alive))
        alive = torch.from_numpy(self.alive)  # shares memory: a departure shows at once
        for j, (fields, index) in enumerate(DataLoader(dataset, batch_size=self.batching.window, shuffle=True,
                                                       generator=gen)):
            if j < skip:  # a resumed run skips the batches its checkpoint trained on
                continue
            self._drop_departed()  # a select() a holder: microseconds against a step
            self.state = LoaderState(epoch=epoch, skip=j + 1)
            if not bool(alive[index].all()):  # a holder left: its records are out of the batch
                fields = {k: v[alive[index]] for k, v in fields.items()}
                if not len(next(iter(fields.values()))):
                    continue
            yield self.batching.to_batch(fields)

    def _bring(self) -> None:
        """The first time: every record travels, split into contiguous field arrays, the rest zeroed."""
        if self.fields:
            return
        records = self.travel_all("a shuffle over every record needs them all")
        try:
            self.fields = {name: np.ascontiguousarray(records[name]) for name in records.dtype.names or ()}
        finally:
            zero(records)
        sizes = dict(sorted(self.scheduler.sizes.items()))
        starts = [0, *itertools.accumulate(sizes.values())]
        self.ranges = {h: slice(a, b) for h, a, b in zip(sizes, starts[:-1], starts[1:], strict=True)}
        self.alive = np.ones(starts[-1], dtype=bool)
        # One budget for everything kept: held-out records have what these leave.
        self.kept.budget = max(0, self.kept.budget - sum(a.nbytes for a in self.fields.values()))

    def _drop_departed(self) -> None:
        """A holder that left (read here, or put offline by an evaluation) is trained on no more: its
        records are zeroed and out of every batch from now."""
        gone = self.departed(list(self.ranges)) | (self.scheduler.offline & set(self.ranges))
        for holder in sorted(gone):
            span = self.ranges.pop(holder)
            self.alive[span] = False
            for values in self.fields.values():
                values[span] = 0
            self.note_lost(f"holder {holder!r} left the cohort: its kept records dropped")
        if gone and not self.ranges:
            raise HolderLost("every holder", "all data holders left the cohort; training cannot go on")

    def close(self) -> None:
        super().close()
        for values in self.fields.values():
            zero(values)
        self.fields = {}
