"""The holders' data for `bench train`: every method trains on the same training tokens and is
scored on the same held-out ones (``final_loss``), the last ``eval_batches`` batches of each holder.

``holder_tokens`` cuts each holder's training tokens (the FL sweep's dataset size); ``iid`` deals
them out again mixed, the IID control for the loss gap of FedAvg's non-IID holders.

A records workload's holders keep their datasets whole (:func:`prepare_records`): each splits off
its held-out records itself, as its CVM does (data.records.split_arrays, files.EVAL_SHARE).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gputravel.data.holder_tokens import load_tokens
from gputravel.data.records import load_records, split_arrays
from gputravel.data.shards import write_shard
from gputravel.data.tokenizer import get_tokenizer, write_tokenizer_record
from gputravel.errors import BadInput
from gputravel.files import EVAL_SHARE


@dataclass(frozen=True)
class HeldOut:
    holders: dict[str, str]  # name -> shard directory of its training tokens (records: its whole dataset)
    eval_tokens: dict[str, np.ndarray]  # name -> its held-out tokens (records: none, the holder splits)
    train_tokens: dict[str, int]  # name -> how many training tokens (records: training records) it has


def prepare_records(sources: tuple[tuple[str, str], ...]) -> HeldOut:
    """Records holders as they are: their training records counted as their CVMs will split them."""
    train = {name: len(split_arrays(load_records(path), EVAL_SHARE)[0]) for name, path in sources}
    return HeldOut(dict(sources), {}, train)


def prepare(sources: tuple[tuple[str, str], ...], out: Path, *, batch: int, seq_len: int, eval_batches: int,
            holder_tokens: int | None = None, iid: bool = False) -> HeldOut:
    """Split each holder's tokens into training and held-out parts; write the training parts."""
    if eval_batches < 1:
        raise BadInput("--eval-batches must be at least 1: final_loss is measured on held-out batches")
    window = batch * seq_len
    held = eval_batches * window + 1
    loaded = {name: load_tokens(path) for name, path in sources}
    tokenizers = {h.tokenizer for h in loaded.values()}
    if len(tokenizers) != 1:
        raise BadInput(f"the holders' data use different tokenizers: {sorted(tokenizers)}")
    train, evals = {}, {}
    for name, h in loaded.items():
        if len(h.tokens) < held + window + 1:
            raise BadInput(f"holder {name!r} has {len(h.tokens)} tokens: too few to hold out {eval_batches} "
                           f"batches of {batch} x {seq_len} and still train")
        evals[name] = np.array(h.tokens[-held:])
        train[name] = np.array(h.tokens[:-held])
    if iid:
        train = _deal(train, window)
    if holder_tokens is not None:
        short = {n: len(t) for n, t in train.items() if len(t) < holder_tokens}
        if short:
            raise BadInput(f"--holder-tokens {holder_tokens}: holders {short} have fewer training tokens")
        train = {n: t[:holder_tokens] for n, t in train.items()}
    tok = get_tokenizer(tokenizers.pop())
    dirs = {}
    for name, tokens in train.items():
        d = out / "holders" / name
        d.mkdir(parents=True, exist_ok=True)
        write_shard(d / f"{name}_train_000000.bin", tokens)
        write_tokenizer_record(d, tok)
        dirs[name] = str(d)
    return HeldOut(dirs, evals, {n: len(t) for n, t in train.items()})


def _deal(train: dict[str, np.ndarray], window: int) -> dict[str, np.ndarray]:
    """Every holder's blocks of ``window`` tokens, shuffled (seed 0) and dealt round robin."""
    names = sorted(train)
    blocks = [t[i:i + window] for n in names for t in [train[n]] for i in range(0, len(t) - window + 1, window)]
    order = np.random.default_rng(0).permutation(len(blocks))  # the presses interleave, reproducibly
    return {n: np.concatenate([blocks[j] for j in order[k::len(names)]]) for k, n in enumerate(names)}
