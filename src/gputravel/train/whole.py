"""One shuffle over every holder's training records (the job's ``shuffle = "all"``, issue 27).

The records travel once, in holder name order, and stay kept in the orchestrator's memory (the
job's `resident_mib` must hold them: that is the retention holders approve). Each epoch is then
torch's own ``DataLoader(shuffle=True)`` over them, so a script ported to ``batches()`` draws the
very batches its stock loader drew over the same records: torch's global generator, as the stock
script's DataLoader uses it. The workload loop seeds each epoch's shuffle from the job's seed
instead, so a checkpoint resumes mid-epoch.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any, Iterator, Mapping

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from gputravel.data.records import as_tensors
from gputravel.errors import BadInput, HolderLost
from gputravel.train.loader import TravellingLoader, zero
from gputravel.train.schedule import LoaderState

MIB = 1 << 20


class _Fields(Dataset):
    """Record i as a dict of its fields' tensors (the default collate stacks them into a batch)."""

    def __init__(self, fields: Mapping[str, torch.Tensor]) -> None:
        self.fields = dict(fields)
        self.n = len(next(iter(self.fields.values())))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {name: t[i] for name, t in self.fields.items()}


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
        self.records: np.ndarray | None = None
        self.holders: dict[str, int] = {}

    def __iter__(self) -> Iterator[Any]:
        if self.records is None:
            self.records = self.travel_all("a shuffle over every record needs them all")
            self.holders = dict(sorted(self.scheduler.sizes.items()))  # their records, in this order
        epoch, skip = self.state.epoch, self.state.skip
        while True:
            self._drop_departed()
            dataset = _Fields(as_tensors(self.records, torch.from_numpy))
            gen = None if self.seed is None else torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            for j, fields in enumerate(DataLoader(dataset, batch_size=self.batching.window, shuffle=True,
                                                  generator=gen)):
                if j >= skip:  # a resumed run skips the batches its checkpoint trained on
                    self.state = LoaderState(epoch=epoch, skip=j + 1)
                    yield self.batching.to_batch(fields)
            epoch, skip = epoch + 1, 0

    def _drop_departed(self) -> None:
        """At each epoch: a holder that left the cohort is trained on no more; its records are zeroed."""
        present = getattr(self.source, "present", None)
        gone = [h for h in self.holders if present is not None and not present(h)]
        if not gone or self.records is None:
            return
        starts = dict(zip(self.holders, [0, *itertools.accumulate(self.holders.values())][:-1], strict=True))
        stay = [self.records[starts[h]:starts[h] + n] for h, n in self.holders.items() if h not in gone]
        if not stay:
            raise HolderLost("every holder", "all data holders left the cohort; training cannot go on")
        old, self.records = self.records, np.concatenate(stay)
        zero(old)
        for h in gone:
            del self.holders[h]
            self.scheduler.offline.add(h)
            self.lost.append(f"holder {h!r} left the cohort: its kept records dropped")

    def close(self) -> None:
        super().close()
        if self.records is not None:
            zero(self.records)
            self.records = None
