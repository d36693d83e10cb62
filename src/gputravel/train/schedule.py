"""Which data holder the GPU travels to next, and where in its dataset (pure: sizes and a cursor
state in, the next visit out). A visit moves at most one buffer; the holder's cursor then moves
past it all, the tail too short for a window skipped, so no token repeats within an epoch.

``round_robin``: holders take turns in name order. ``proportional``: the holder with the smallest
share of its data consumed goes next, so all holders finish the epoch together.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from gputravel.errors import BadInput, HolderLost

POLICIES = ("round_robin", "proportional")


@dataclass(frozen=True)
class Visit:
    holder: str
    token_offset: int
    ntokens: int  # tokens to move: at most one buffer, at most what is left


@dataclass(frozen=True)
class LoaderState:
    """Everything needed to resume; ``skip``: windows of the next visit already trained on."""

    epoch: int = 0
    cursors: Mapping[str, int] = field(default_factory=dict)
    last: str | None = None
    skip: int = 0

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "cursors": dict(self.cursors), "last": self.last, "skip": self.skip}

    @classmethod
    def from_dict(cls, raw: Mapping) -> LoaderState:
        try:
            cursors = {str(k): int(v) for k, v in dict(raw["cursors"]).items()}
            last = raw.get("last")
            return cls(epoch=int(raw["epoch"]), cursors=cursors, last=None if last is None else str(last),
                       skip=int(raw.get("skip", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadInput(f"loader state is malformed ({exc}); expected epoch, cursors and last") from None


class Scheduler:
    """Plans visits; `window` is the units one batch consumes (B*T tokens, or B records), and
    `overlap` the units past it a batch also reads (1 for GPT-2: y is x shifted by one token)."""

    def __init__(self, sizes: Mapping[str, int], capacity: int, window: int, policy: str = "round_robin",
                 overlap: int = 1) -> None:
        if policy not in POLICIES:
            raise BadInput(f"unknown schedule {policy!r}: choose one of {', '.join(POLICIES)}")
        if window <= 0:
            raise BadInput("a batch must hold at least one token")
        unit = "tokens" if overlap else "records"
        if capacity < window + overlap:
            raise BadInput(f"the dataset buffer holds {capacity} {unit}, one batch needs {window + overlap}: "
                           "use a larger buffer or a smaller batch" + (" / sequence length" if overlap else ""))
        self.sizes = {name: int(n) for name, n in sorted(sizes.items())}
        self.capacity = capacity
        self.window = window
        self.overlap = overlap
        self.policy = policy
        # Holders lost in a travel: skipped until they come back, their partial chunk then redone.
        self.offline: set[str] = set()
        if not any(self._usable(n, 0) for n in self.sizes.values()):
            raise BadInput(f"no holder has enough {unit} for one batch of {window + overlap}")

    def _usable(self, size: int, cursor: int) -> bool:
        return size - cursor >= self.window + self.overlap

    def _open(self, state: LoaderState) -> list[str]:
        return [h for h, n in self.sizes.items()
                if h not in self.offline and self._usable(n, state.cursors.get(h, 0))]

    def next_visit(self, state: LoaderState) -> tuple[Visit, LoaderState]:
        """The next visit; a new epoch when every online holder is used up (an offline one's rest is missed)."""
        open_ = self._open(state)
        if not open_:
            if set(self.sizes) <= self.offline:
                raise HolderLost("every holder", "all data holders are offline; training cannot go on")
            state = LoaderState(epoch=state.epoch + 1, cursors={}, last=None)
            open_ = self._open(state)
        holder = self._pick(open_, state)
        cursor = state.cursors.get(holder, 0)
        ntokens = min(self.capacity, self.sizes[holder] - cursor)
        return Visit(holder, cursor, ntokens), replace(state, last=holder)

    def _pick(self, open_: list[str], state: LoaderState) -> str:
        if self.policy == "proportional":
            return min(open_, key=lambda h: (state.cursors.get(h, 0) / self.sizes[h], h))
        names = list(self.sizes)
        start = 0 if state.last is None else names.index(state.last) + 1
        for i in range(len(names)):
            name = names[(start + i) % len(names)]
            if name in open_:
                return name
        raise AssertionError("an open holder always exists here")

    def consumed(self, state: LoaderState, visit: Visit) -> LoaderState:
        """Every window of the visit trained on: the holder's cursor moves past it."""
        cursors = dict(state.cursors)
        cursors[visit.holder] = visit.token_offset + visit.ntokens
        return replace(state, cursors=cursors, skip=0)

    def windows_in(self, ntokens: int) -> int:
        """Batches in ntokens units (tokens: y needs one past x)."""
        return (ntokens - self.overlap) // self.window


def check_shares(shares: Sequence[Sequence[str]], names: Sequence[str], gpus: int | None = None,
                 where: str = "shares") -> tuple[tuple[str, ...], ...]:
    """BadInput unless there are `gpus` shares (at least one if None), none empty, holding each of `names`
    once: a holder serves one GPU, so each of its chunks reaches one rank."""
    out = tuple(tuple(s) for s in shares)
    placed = [n for s in out for n in s]
    doubled = sorted({n for n in placed if placed.count(n) > 1})
    unknown, missing = sorted(set(placed) - set(names)), sorted(set(names) - set(placed))
    if not out or (gpus is not None and len(out) != gpus):
        raise BadInput(f"{where}: expected {gpus or 'at least one'} share(s) of holders, one a GPU, got {len(out)}")
    if not all(out):
        raise BadInput(f"{where}: every GPU needs at least one data holder: an empty share was given")
    if doubled:
        raise BadInput(f"{where}: a holder serves one GPU only: {', '.join(doubled)} in several shares")
    if unknown or missing:
        raise BadInput(f"{where}: the shares must hold every data holder once: unknown {unknown}, missing {missing}")
    return out


def partition(sizes: Mapping[str, int], gpus: int) -> tuple[tuple[str, ...], ...]:
    """Which holders each of `gpus` GPUs travels to (paper 9): each holder to one GPU only, so each
    chunk reaches one rank; largest first to the least loaded GPU, deterministically."""
    if type(gpus) is not int or gpus < 1:
        raise BadInput(f"--gpus must be a positive integer, got {gpus!r}")
    if len(sizes) < gpus:
        raise BadInput(f"{gpus} GPUs need at least {gpus} data holders (one each at least), got {len(sizes)}")
    loads = [0] * gpus
    shares: list[list[str]] = [[] for _ in range(gpus)]
    for name, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        k = min(range(gpus), key=lambda i: (loads[i], i))
        shares[k].append(name)
        loads[k] += size
    return tuple(tuple(sorted(s)) for s in shares)
