"""`gputravel plan` (bench/plan.py): the model reproduces the paper's worked example and its
Table 2, takes its constants from the newest matching benchmark JSON and says so, and refuses
bad input with a message that says what to give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gputravel.bench import plan
from gputravel.cli.app import app
from gputravel.errors import BadInput
from gputravel.protocol.hardware import EMULATED, MIB, PAPER_H100, TABLE_2

#: How close the worked example must land (the model lands at 1.04x the slides' figures).
WORKED_EXAMPLE_TOLERANCE = 0.10


def test_the_worked_example_lands_within_the_stated_tolerance() -> None:
    out = plan.predict(plan.worked_example_input(), plan.paper_constants())
    close = plan.against_worked_example(out)
    assert out["transmissions"] == 44 * 4096  # 44 TiB in 256 MiB buffers
    for key in ("saved_per_transmission_s", "saved_s"):
        assert abs(close[key]["ratio"] - 1) <= WORKED_EXAMPLE_TOLERANCE, close
    assert out["saved_s"] > 14 * 86400  # "14+ days"


@pytest.mark.parametrize("bw", list(TABLE_2))
def test_the_paper_constants_give_back_table_2(bw: float | None) -> None:
    inp = plan.worked_example_input(buffer_bytes=512 * MIB, bandwidth_mbit=bw)
    out = plan.predict(inp, plan.paper_constants())
    assert out["baseline"]["per_transmission_s"] == pytest.approx(TABLE_2[bw][1], rel=1e-6)
    assert out["travelling"]["per_transmission_s"] == pytest.approx(TABLE_2[bw][4], rel=0.05)


def test_fl_is_two_models_per_holder_per_round() -> None:
    inp = plan.PlanInput(dataset_bytes=10 * MIB, holders=3, buffer_bytes=MIB, bandwidth_mbit=100.0,
                         hardware=PAPER_H100, tokens_per_s=1e4, model_bytes=7 * MIB, fl_rounds=5)
    out = plan.predict(inp, plan.paper_constants())
    assert out["fl"]["bytes_over_link"] == 2 * 7 * MIB * 3 * 5 and "model" in out["fl"]
    assert out["travelling"]["count"] == 30 and out["baseline"]["bytes_over_link"] == 30 * MIB
    assert "fl" not in plan.predict(plan.worked_example_input(model_bytes=0), plan.paper_constants())


@pytest.mark.parametrize("text, what", [("44", "unit"), ("-3MiB", "positive"), ("0GiB", "positive"),
                                        ("12 parsecs", "unit"), ("nanTiB", "positive")])
def test_sizes_need_a_positive_number_and_a_unit(text: str, what: str) -> None:
    with pytest.raises(BadInput, match="positive size with a unit"):
        plan.parse_size(text, "--dataset")
    assert plan.parse_size("44TiB", "x") == 44 << 40 and plan.parse_size("1.5 GB", "x") == 1_500_000_000


@pytest.mark.parametrize("changes, message", [
    ({"tokens_per_s": None}, "training speed"),
    ({"step_s": 1.0}, "training speed"),  # both ways at once
    ({"tokens_per_s": None, "step_s": 1.0}, "positive --tokens-per-step"),
    ({"tokens_per_step": 100}, "goes with --step-s"),
    ({"holders": 0}, "at least 1"),
    ({"bandwidth_mbit": -5.0}, "positive number"),
    ({"buffer_bytes": 0}, "positive sizes"),
    ({"hardware": "h200"}, "unknown hardware profile"),
])
def test_bad_inputs_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        plan.worked_example_input(**changes)


def _travel_json(date: str, fixed: float, profile: str | None = None) -> dict:
    doc = {"crypto_limit_gbps": 10.0, "date": date, "rows": [
        {"size_mib": 512, "fixed_ms": fixed, "steps_ms": {"dh_copy": 51.2, "o_cleanup": 5.12}}]}
    if profile:
        doc["hardware"] = {"profile": profile, "injected": {}}
    return doc


def test_constants_come_from_the_newest_json_of_the_same_profile_and_say_so() -> None:
    results = [("old.json", _travel_json("2026-11-01", 9.0)), ("new.json", _travel_json("2026-11-24", 2.0)),
               ("h100.json", _travel_json("2026-11-25", 300.0, PAPER_H100)), ("other.json", {"rows": []})]
    k = plan.constants_from(results, EMULATED)
    assert k.travel_fixed_ms == 2.0 and k.copy_ms_per_mib == pytest.approx(56.32 / 512)
    assert k.sources["travel"].startswith("new.json") and "no bench compare JSON" in k.sources["baseline"]
    assert plan.constants_from(results, PAPER_H100).travel_fixed_ms == 300.0
    assert plan.constants_from(results, PAPER_H100, "paper").sources["travel"].startswith("the paper")
    assert plan.constants_from(results[:2], PAPER_H100).sources["travel"].startswith("the paper")  # auto


def test_measured_goodput_comes_from_bench_compare() -> None:
    """Goodput is the baseline's total less its GPU write (its read overlaps the transfer)."""
    def cell(bw: float | None, transfer_ms: float) -> dict:
        return {"size_mib": 4, "bandwidth_mbit": bw, "extrapolated": False, "baseline_ms": transfer_ms + 4.0,
                "baseline_steps_ms": {"read": 1.0, "gpu_write": 4.0}, "rate_agreement": None}
    at_80 = 4 * MIB * 8 / 80e6 * 1e3  # 4 MiB at 80 Mbit/s, ms
    compare = {"cells": [cell(100.0, at_80), cell(None, 80.0), {**cell(4.0, 1.0), "extrapolated": True}],
               "tie_breaks": [], "date": "d"}
    k = plan.constants_from([("t.json", _travel_json("d", 2.0)), ("c.json", compare)], EMULATED)
    assert k.goodput_mbit(100.0) == pytest.approx(80.0) and k.baseline_io_ms_per_mib == pytest.approx(1.0)
    assert k.goodput_mbit(None) == pytest.approx(4 * MIB * 8 / 0.080 / 1e6)
    assert k.goodput_mbit(4.0) == pytest.approx(4 * 0.8)  # extrapolated cells are not measurements
    assert k.sources["baseline"].startswith("c.json")


def test_what_cannot_be_had_is_said() -> None:
    with pytest.raises(BadInput, match="no `bench travel` JSON"):
        plan.constants_from([], EMULATED)
    with pytest.raises(BadInput, match="paper-h100"):
        plan.constants_from([], EMULATED, "paper")
    with pytest.raises(BadInput, match="--source"):
        plan.constants_from([], PAPER_H100, "guess")
    k = plan.constants_from([("t.json", _travel_json("d", 2.0))], EMULATED)
    with pytest.raises(BadInput, match="uncapped"):
        k.goodput_mbit(None)


def test_the_command(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(app, ["plan", "--help"]).exit_code == 0
    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["plan", "--worked-example", "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["inputs"]["hardware"] == PAPER_H100 and doc["sources"]["travel"].startswith("the paper")
    assert abs(doc["worked_example"]["saved_s"]["ratio"] - 1) <= WORKED_EXAMPLE_TOLERANCE
    res = runner.invoke(app, ["plan", "--dataset", "44", "--tokens-per-s", "1000"])
    assert res.exit_code == 1 and "with a unit" in res.output
    res = runner.invoke(app, ["plan", "--dataset", "1TiB", "--tokens-per-s", "1e4", "--results", str(tmp_path / "none")])
    assert res.exit_code == 1 and "not found" in res.output
