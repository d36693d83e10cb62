"""`bench train --workload` (issue 27): FedAvg's local round and the held-out scoring for a
records workload, in-process; the flag's checks; and a tiny run's JSON (slow tier)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gputravel.train.loader import LocalSource
import torch
from typer.testing import CliRunner

from gputravel.bench import local_reference, train
from gputravel.bench.holdout import prepare_records
from gputravel.cli.app import app
from gputravel.data.records import load_records, split_arrays
from gputravel.errors import BadInput
from gputravel.files import EVAL_SHARE
from gputravel.fl.config import FedAvgConfig, plan
from gputravel.fl.local import (held_out_metrics, initial_model, load_arrays, local_train_records, model_arrays,
                                parameter_count, records_loader, schedule_config)
from gputravel.jobs.training import TrainingJobConfig, default_holders, resolve
from gputravel.train.loop import workload_of


@pytest.fixture(scope="module")
def image_job(tmp_path_factory: pytest.TempPathFactory) -> TrainingJobConfig:
    tmp = tmp_path_factory.mktemp("image")
    holders = default_holders(2, tmp, "image")
    return resolve(TrainingJobConfig(train=train.records_train_config("image", steps=6), holders=holders,
                                     run_dir=str(tmp)))


def test_records_weights_are_the_models_state_dict(image_job: TrainingJobConfig) -> None:
    model = initial_model(image_job.train)
    arrays = model_arrays(model)
    assert list(arrays) == list(model.state_dict())
    assert sum(a.numel() for a in arrays.values()) == parameter_count(image_job.train)
    load_arrays(model, arrays)
    with pytest.raises(BadInput, match="do not fit"):
        load_arrays(model, {k: v for k, v in list(arrays.items())[1:]})


def test_gpt2_weights_send_the_tied_matrix_once() -> None:
    arrays = model_arrays(initial_model(train.bench_train_config(2)))
    assert "lm_head.weight" not in arrays and "transformer.wte.weight" in arrays


def test_records_local_round_goes_on_where_the_last_stopped(image_job: TrainingJobConfig) -> None:
    cfg = image_job.train
    name, path = image_job.holders[0]
    arrays = model_arrays(initial_model(cfg))
    kw = {"schedule": schedule_config(cfg, 6), "threads": 1}
    first = local_train_records(cfg, arrays, LocalSource.of(cfg, [(name, path)]), state=None, steps=3,
                                schedule_offset=0, **kw)
    assert len(first.losses) == 3 and all(np.isfinite(first.losses))
    assert set(first.arrays) == set(arrays) and first.loader is not None
    assert any(not torch.equal(first.arrays[k], arrays[k]) for k in arrays)
    # The second round's batches are the ones an uninterrupted loader gives next.
    workload = workload_of(cfg)
    straight = iter(records_loader(cfg, workload, LocalSource.of(cfg, [(name, path)])))
    expected = [next(straight) for _ in range(5)][3:]
    resumed = iter(records_loader(cfg, workload, LocalSource.of(cfg, [(name, path)]), first.loader))
    for want in expected:
        got = next(resumed)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_held_out_metrics_score_each_holders_held_out_records(image_job: TrainingJobConfig) -> None:
    cfg = image_job.train
    model = initial_model(cfg)
    out = held_out_metrics(cfg, model, image_job.holders)
    workload = workload_of(cfg)
    for name, path in image_job.holders:
        held = split_arrays(load_records(path), EVAL_SHARE)[1]
        x, y = workload.batch(held, "cpu")
        with torch.no_grad():
            right = int((model.eval()(x).argmax(-1) == y).sum())
        assert out["per_holder"][name]["records"] == len(held)
        assert out["per_holder"][name]["accuracy"] == pytest.approx(right / len(held))
    assert out["all"]["records"] == sum(h["records"] for h in out["per_holder"].values())
    assert 0 < out["all"]["loss"] < 10


def test_fedavg_plan_for_records_lets_holders_go_on_into_their_next_epoch() -> None:
    p = plan(FedAvgConfig(rounds=2), steps=300, batch=32, seq_len=64, holder_tokens={"a": 100, "b": 100},
             records=True)
    assert p.local_steps == 75  # more than the 3 batches each holds: its loader wraps, as the loop's does
    with pytest.raises(BadInput, match="'b' has 20 training records"):
        plan(FedAvgConfig(rounds=2), steps=4, batch=32, seq_len=64, holder_tokens={"a": 100, "b": 20}, records=True)


def test_local_reference_trains_the_same_model_on_the_holders_training_records(image_job: TrainingJobConfig) -> None:
    cfg = image_job.train.replace(steps=3)
    data = prepare_records(image_job.holders)
    ds = local_reference.dataset(cfg, image_job.holders, data)
    assert len(ds) == sum(data.train_tokens.values())
    out = local_reference.measure(cfg, image_job.holders, data)
    assert out["steps"] == 3 and out["step_ms"] > 0 and out["batch"] == cfg.batch


def test_workload_flag_is_checked() -> None:
    assert train.workload_config("gpt2", None, 128 << 10) == train.bench_train_config(600, 128 << 10)
    assert train.workload_config("tabular", None, 128 << 10).steps == train.RECORD_STEPS
    with pytest.raises(BadInput, match="--workload takes gpt2, image, tabular"):
        train.workload_config("resnet", None, 128 << 10)
    with pytest.raises(BadInput, match="--iid"):
        train.TrainBenchConfig((20.0,), train=train.records_train_config("image"), iid=True)
    res = CliRunner().invoke(app, ["bench", "train", "--workload", "resnet", "--bandwidths", "20"])
    assert res.exit_code != 0 and "--workload takes" in res.output


@pytest.mark.integration
def test_records_bench_train_json(processes, tmp_path: Path) -> None:
    cfg = train.TrainBenchConfig((20.0,), train=train.records_train_config("tabular", steps=4), holders=2,
                                 link="token-bucket", workdir=str(tmp_path))
    result = train.run(cfg)
    assert result["workload"] == "tabular" and len(result["local_dataloader"]["runs_step_ms"]) == 2
    assert [r["method"] for r in result["rows"]] == ["travel", "tls"]
    for row in result["rows"]:
        assert set(row) >= {"bytes_over_link", "final_metrics", "step_ms", "stall_share", "step_ms_vs_local", "local_step_ms"}
        assert set(row["final_metrics"]["per_holder"]) == {"holder-1", "holder-2"}
        assert 0 <= row["final_metrics"]["all"]["accuracy"] <= 1
    assert result["checks"] == [{"bandwidth_mbit": 20.0, "same_losses": True}]


@pytest.mark.integration
def test_fedavg_trains_a_records_workload_on_flower(processes, tmp_path: Path) -> None:
    from gputravel.net import LINK_NETNS
    from gputravel.net.namespaces import netns_available

    if not netns_available()[0]:
        pytest.skip(f"FedAvg runs on netns-tc links: {netns_available()[1]}")
    cfg = train.TrainBenchConfig((100.0,), train=train.records_train_config("image", steps=4), holders=2,
                                 methods=("fl",), fl=FedAvgConfig(rounds=1), workdir=str(tmp_path))
    result = train.run(cfg)
    (row,) = result["rows"]
    assert result["link"] == LINK_NETNS and row["rounds"] == 1 and row["bytes_over_link"] > 0
    assert result["fl_plan"]["local_steps"] == 2
    assert set(row["final_metrics"]["per_holder"]) == {"holder-1", "holder-2"}
    assert row["step_ms"] > 0 and 0 <= row["stall_share"] <= 1
    assert [sorted(r["replied"]) for r in row["fl"]["round_log"]] == [["holder-1", "holder-2"]]
