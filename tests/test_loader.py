"""The scheduler and the loader: llm.c window semantics, every token once per epoch, fair
schedules, exact resume. Pure: LocalSource over in-memory token streams."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples  # tests/profiles.py: counts for the thorough profile

from gputravel.errors import BadInput, HolderLost
from gputravel.train.loader import LocalSource, TravellingLoader
from gputravel.train.schedule import LoaderState, Scheduler

B, T = 2, 8
W = B * T


def streams(sizes: dict[str, int]) -> dict[str, np.ndarray]:
    # Each holder's tokens are distinct from every other's, so a window says where it came from.
    return {name: (np.arange(n) % 4000 + 4000 * i).astype(np.uint16) for i, (name, n) in enumerate(sorted(sizes.items()))}


def take(loader: TravellingLoader, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(x.numpy(), y.numpy()) for x, y in itertools.islice(iter(loader), n)]


def test_windows_follow_llmc_semantics():
    toks = streams({"a": 1000})
    loader = TravellingLoader(LocalSource(toks), B, T, buffer_bytes=2 * 200)
    batches = take(loader, 5)
    flat = toks["a"].astype(np.int64)
    for i, (x, y) in enumerate(batches):
        assert x.shape == (B, T) and y.shape == (B, T)
        start = i * W  # each window starts B*T after the previous one
        assert (x.reshape(-1) == flat[start : start + W]).all()
        assert (y.reshape(-1) == flat[start + 1 : start + W + 1]).all()  # targets: shifted by one


def test_every_chunk_travels_once_per_epoch_and_its_windows_are_trained_once():
    sizes = {"a": 700, "b": 333, "c": 1500}
    toks = streams(sizes)
    cap = 100  # tokens per travel: many chunks per holder; windows never straddle a chunk
    fetched = []
    loader = TravellingLoader(LocalSource(toks), B, T, buffer_bytes=2 * cap, on_fetch=fetched.append)
    seen: dict[str, list[int]] = {n: [] for n in sizes}
    it = iter(loader)
    while True:
        x, _ = next(it)
        if loader.state.epoch:  # the first window of epoch 2
            break
        seen["abc"[int(x[0, 0]) // 4000]].extend(x.reshape(-1).tolist())
    epoch0 = fetched[:-1]  # the last fetch already belongs to epoch 2
    for name, n in sizes.items():
        starts = [f.visit.token_offset for f in epoch0 if f.visit.holder == name]
        assert starts == list(range(0, n - W, cap))[: len(starts)] and starts[-1] + cap >= n - W
        # In each chunk: all whole windows, in order; the tail that cannot fill one is skipped.
        expect = []
        for s in starts:
            chunk = toks[name][s : s + cap].astype(np.int64)
            expect += chunk[: ((len(chunk) - 1) // W) * W].tolist()
        assert seen[name] == expect, name


def test_round_robin_takes_turns_and_skips_finished_holders():
    sched = Scheduler({"a": 100, "b": 40, "c": 100}, capacity=W + 1, window=W)
    state, order = LoaderState(), []
    while state.epoch == 0 and len(order) < 50:
        visit, state = sched.next_visit(state)
        if state.epoch:
            break
        order.append(visit.holder)
        state = sched.consumed(state, visit)
    assert order[:3] == ["a", "b", "c"]
    # Chunks of 17 tokens start every 17; one needs 17 tokens for its window, so a (100 tokens)
    # makes 5 visits and b (40) makes 2, after which round robin skips it.
    assert Counter(order) == {"a": 5, "b": 2, "c": 5}
    assert order[6:] == ["a", "c"] * 3


def test_proportional_interleaves_by_size_and_finishes_together():
    sched = Scheduler({"big": 30 * W + 1, "small": 10 * W + 1}, capacity=W + 1, window=W, policy="proportional")
    state, order = LoaderState(), []
    for _ in range(40):
        visit, state = sched.next_visit(state)
        order.append(visit.holder)
        state = sched.consumed(state, visit)
    assert Counter(order) == {"big": 30, "small": 10}
    for k in (8, 20, 32):  # at every point the shares stay near 3:1
        assert abs(order[:k].count("big") - 0.75 * k) <= 1.5


@settings(max_examples=examples(40), deadline=None)
@given(stop=st.integers(min_value=1, max_value=60), policy=st.sampled_from(["round_robin", "proportional"]))
def test_resume_from_saved_state_continues_exactly(stop, policy):
    toks = streams({"a": 300, "b": 170, "c": 90})
    ref = take(TravellingLoader(LocalSource(toks), B, T, buffer_bytes=2 * 64, policy=policy), 70)
    first = TravellingLoader(LocalSource(toks), B, T, buffer_bytes=2 * 64, policy=policy)
    done = take(first, stop)
    saved = LoaderState.from_dict(first.state.to_dict())  # as a checkpoint stores it
    rest = take(TravellingLoader(LocalSource(toks), B, T, buffer_bytes=2 * 64, policy=policy, state=saved), 70 - stop)
    for (x1, y1), (x2, y2) in zip(ref, done + rest, strict=True):
        assert (x1 == x2).all() and (y1 == y2).all()


def test_resume_state_mid_chunk_skips_windows_already_trained():
    toks = streams({"a": 1000})
    loader = TravellingLoader(LocalSource(toks), B, T, buffer_bytes=2 * 200)
    take(loader, 3)
    assert loader.state.skip == 3 and loader.state.cursors.get("a", 0) == 0
    x, _ = take(loader, 1)[0]  # a loader built again from that state goes on at window 4
    assert x.reshape(-1)[0] == 3 * W


def test_bad_configurations_are_refused():
    toks = streams({"a": 100})
    with pytest.raises(BadInput, match="one batch needs"):
        TravellingLoader(LocalSource(toks), B, T, buffer_bytes=2 * W)
    with pytest.raises(BadInput, match="unknown schedule"):
        TravellingLoader(LocalSource(toks), B, T, buffer_bytes=4096, policy="random")
    with pytest.raises(BadInput, match="enough tokens"):
        TravellingLoader(LocalSource(streams({"a": W})), B, T, buffer_bytes=4096)
    with pytest.raises(BadInput, match="malformed"):
        LoaderState.from_dict({"cursors": {}})


class _AlwaysLost:
    def __init__(self, inner) -> None:
        self.inner, self.last_report = inner, None

    def sizes(self):
        return self.inner.sizes()

    def fetch(self, visit):
        raise HolderLost(visit.holder, "test")


def test_lost_holders_are_skipped_and_training_stops_when_all_are_gone():
    toks = streams({"a": 300, "b": 300})
    loader = TravellingLoader(_AlwaysLost(LocalSource(toks)), B, T, buffer_bytes=2 * 64)
    with pytest.raises(HolderLost, match="every holder"):
        next(iter(loader))
    assert loader.scheduler.offline == {"a", "b"} and len(loader.lost) == 2
