"""The FL baseline's checks before anything starts, and its pure parts (no Flower process):
FedAvg's plan, the held-out split, the holders' local steps and the weights they exchange."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gputravel.bench import holdout
from gputravel.bench.train import TrainBenchConfig, bench_train_config, parse_methods, run
from gputravel.errors import BadInput
from gputravel.fl.config import FedAvgConfig, clients_per_round, drop_target, framework, plan
from gputravel.fl.local import (initial_model, load_arrays, local_train, model_arrays, parameter_count,
                                schedule_config)
from gputravel.net.counters import LinkBytes, bytes_between

HOLDERS = {"a": 40_000, "b": 40_000, "c": 40_000}


def plan_of(fl: FedAvgConfig, steps: int = 600, holders=HOLDERS):
    return plan(fl, steps=steps, batch=8, seq_len=64, holder_tokens=holders)


def test_the_plan_gives_fedavg_the_same_training_tokens() -> None:
    p = plan_of(FedAvgConfig(rounds=4))
    assert (p.rounds, p.clients_per_round, p.local_steps, p.total_steps) == (4, 3, 50, 600)
    assert plan_of(FedAvgConfig(rounds=2, local_steps=50, fraction=0.5), steps=100).clients_per_round == 1


@pytest.mark.parametrize("fl, match", [
    (dict(rounds=0), "at least 1"),
    (dict(rounds=4, local_steps=0), "at least 1"),
    (dict(fraction=0.0), r"\(0, 1\]"),
    (dict(fraction=1.5), r"\(0, 1\]"),
    (dict(drop="holder-2"), "HOLDER@ROUND"),
    (dict(drop="holder-2@0"), "HOLDER@ROUND"),
    (dict(drop_mode="vanish"), "crash, leave"),
])
def test_bad_knobs_are_refused(fl: dict, match: str) -> None:
    with pytest.raises(BadInput, match=match):
        FedAvgConfig(**fl)


def test_a_plan_that_cannot_be_fair_or_fed_is_refused_naming_the_fix() -> None:
    with pytest.raises(BadInput, match="do not split"):
        plan_of(FedAvgConfig(rounds=7))
    with pytest.raises(BadInput, match="same training tokens"):
        plan_of(FedAvgConfig(rounds=4, local_steps=10))
    # 40,000 tokens hold 78 batches of 8 x 64: 100 local steps in one round is more than that
    with pytest.raises(BadInput, match="more than holder 'a' has data for"):
        plan_of(FedAvgConfig(rounds=2), steps=600)
    with pytest.raises(BadInput, match="not a holder"):
        plan_of(FedAvgConfig(drop="z@1"))
    with pytest.raises(BadInput, match="past the last round"):
        plan_of(FedAvgConfig(drop="a@5"))
    with pytest.raises(BadInput, match="at least one holder"):
        plan_of(FedAvgConfig(), holders={})


def test_flowers_sampling_rule_and_drop_targets() -> None:
    assert [clients_per_round(3, f) for f in (1.0, 0.67, 0.5, 0.1)] == [3, 2, 1, 1]
    assert drop_target("holder-2@3") == ("holder-2", 3)
    assert framework().startswith("flwr 1.42")


def test_methods_parse_in_a_fixed_order() -> None:
    assert parse_methods("fl, travel") == ("travel", "fl")
    with pytest.raises(BadInput, match="--methods"):
        parse_methods("travel,p2p")


def test_fl_on_links_without_namespaces_is_refused_before_anything_starts(tmp_path: Path) -> None:
    cfg = TrainBenchConfig((20.0,), link="token-bucket", methods=("fl",), workdir=str(tmp_path))
    with pytest.raises(BadInput, match="netns-tc"):
        run(cfg)
    assert list(tmp_path.iterdir()) == []  # nothing was prepared


def test_held_out_tokens_are_never_trained_on_and_iid_dealing_keeps_every_token(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    sources = []
    for name in ("p", "q"):
        d = tmp_path / "src" / name
        d.mkdir(parents=True)
        (d / "t.txt").write_bytes(bytes(rng.integers(32, 127, 9000, dtype=np.uint8)))
        sources.append((name, str(d)))
    out = holdout.prepare(tuple(sources), tmp_path / "a", batch=4, seq_len=16, eval_batches=2)
    assert all(len(t) == 2 * 64 + 1 for t in out.eval_tokens.values())
    assert sum(out.train_tokens.values()) + sum(len(t) for t in out.eval_tokens.values()) >= 18000
    iid = holdout.prepare(tuple(sources), tmp_path / "b", batch=4, seq_len=16, eval_batches=2, iid=True)
    assert [len(t) for t in iid.eval_tokens.values()] == [129, 129]
    assert sum(iid.train_tokens.values()) == sum(n // 64 * 64 for n in out.train_tokens.values())
    cut = holdout.prepare(tuple(sources), tmp_path / "c", batch=4, seq_len=16, eval_batches=2, holder_tokens=1000)
    assert set(cut.train_tokens.values()) == {1000}
    with pytest.raises(BadInput, match="fewer training tokens"):
        holdout.prepare(tuple(sources), tmp_path / "d", batch=4, seq_len=16, eval_batches=2, holder_tokens=10**6)


def test_holders_exchange_the_tied_matrix_once_and_local_steps_move_the_weights() -> None:
    cfg = bench_train_config(steps=4).replace(n_layer=1, n_embd=32, n_head=2, batch=2, seq_len=16, warmup_steps=1)
    model = initial_model(cfg)
    arrays = model_arrays(model)
    assert "lm_head.weight" not in arrays
    assert sum(a.numel() for a in arrays.values()) == parameter_count(cfg)
    tokens = np.arange(2 * 16 * 3 + 1, dtype=np.uint16) % 200
    out = local_train(cfg, arrays, tokens, first_window=2, steps=2, schedule=schedule_config(cfg, 4),
                      schedule_offset=0, threads=1)
    assert out.next_window == 1 and len(out.losses) == 2 and out.compute_s > 0
    assert any(not (out.arrays[k] == arrays[k]).all() for k in arrays)
    load_arrays(model, out.arrays)
    with pytest.raises(BadInput, match="do not fit"):
        load_arrays(model, {"transformer.wte.weight": arrays["transformer.wte.weight"]})
    with pytest.raises(BadInput, match="only 3 batches"):
        local_train(cfg, arrays, tokens, first_window=0, steps=4, schedule=cfg, schedule_offset=0, threads=1)


def test_link_byte_snapshots_subtract_per_holder() -> None:
    before = {"a": LinkBytes(10, 20), "b": LinkBytes(0, 0)}
    after = {"a": LinkBytes(15, 40), "b": LinkBytes(7, 1)}
    moved = bytes_between(before, after)
    assert moved == {"a": LinkBytes(5, 20), "b": LinkBytes(7, 1)} and moved["a"].total == 25
    with pytest.raises(BadInput):
        bytes_between(before, {"a": LinkBytes(0, 0)})
