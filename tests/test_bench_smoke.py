"""Smoke runs of `bench compare` and `bench train` at tiny sizes: the commands work end to end
and their JSON has the documented shape. No timing assertions: numbers live in benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gputravel.bench.compare import parse_bandwidths, tie_breaks
from gputravel.bench.paper import paper_speedup
from gputravel.cli.app import app
from gputravel.errors import BadInput
from gputravel.net import LINK_NETNS, LINK_TOKEN_BUCKET

CELL_KEYS = {"size_mib", "bandwidth_mbit", "travel_ms", "baseline_ms", "baseline_transfer_ms", "speedup",
             "extrapolated", "rate_agreement"}


def test_bandwidths_parse_with_uncapped() -> None:
    assert parse_bandwidths("4, 20,uncapped") == (4.0, 20.0, None)
    with pytest.raises(BadInput, match="uncapped"):
        parse_bandwidths("fast")


def test_tie_breaks_find_where_the_baseline_wins() -> None:
    cells = [{"bandwidth_mbit": None, "size_mib": s, "speedup": v} for s, v in ((1, 0.5), (2, 1.5), (4, 3.0))]
    assert tie_breaks(cells, (None,)) == [{"bandwidth_mbit": None, "baseline_faster_at_mib": [1],
                                           "travel_faster_from_mib": 2}]


def test_paper_estimates_exist_only_on_the_papers_grid() -> None:
    assert paper_speedup(512, 4) > paper_speedup(512, None) > 1
    assert paper_speedup(3, 4) is None and paper_speedup(4, 7) is None


@pytest.mark.integration
def test_compare_smoke(processes, tmp_path: Path) -> None:
    out, fig = tmp_path / "compare.json", tmp_path / "compare.png"
    res = CliRunner().invoke(app, ["bench", "compare", "--sizes", "1,2", "--bandwidths", "100,uncapped", "--repeat", "1",
                                   "--max-transfer-s", "0.001", "--link-check-s", "0.05",
                                   "--json", str(out), "--plot", str(fig)])
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    assert result["link"] in (LINK_NETNS, LINK_TOKEN_BUCKET)
    cells = {(c["bandwidth_mbit"], c["size_mib"]): c for c in result["cells"]}
    assert set(cells) == {(100.0, 1), (100.0, 2), (None, 1), (None, 2)}
    for c in cells.values():
        assert CELL_KEYS <= set(c)
    assert cells[(100.0, 2)]["extrapolated"] and cells[(100.0, 2)]["rate_agreement"] is None
    assert not cells[(100.0, 1)]["extrapolated"] and set(cells[(100.0, 1)]["rate_agreement"]) >= {"ratio", "ok"}
    assert not cells[(None, 2)]["extrapolated"] and cells[(None, 2)]["rate_agreement"] is None
    assert len(result["tie_breaks"]) == 2
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
def test_train_smoke(processes, tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    fig = tmp_path / "train.png"
    res = CliRunner().invoke(app, ["bench", "train", "--bandwidths", "100", "--steps", "3", "--buffer-kib", "64", "--holders", "1",
                                   "--eval-batches", "1", "--json", str(out), "--plot", str(fig)])
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    assert result["link"] in (LINK_NETNS, LINK_TOKEN_BUCKET)
    assert [(r["method"], r["bandwidth_mbit"]) for r in result["rows"]] == [("travel", 100.0), ("tls", 100.0)]
    assert result["checks"] == [{"bandwidth_mbit": 100.0, "same_losses": True}]
    for row in result["rows"]:
        assert set(row) >= {"training_s", "tx_s", "tx_share", "fetches", "bytes_over_link", "holder_compute_s",
                            "final_loss", "rounds", "framework"}
        assert row["fetches"] >= 1 and row["holder_compute_s"] == 0 and row["rounds"] is None
        assert (row["bytes_over_link"] is None) == (result["link"] == LINK_TOKEN_BUCKET)
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
def test_ddp_smoke(processes, tmp_path: Path) -> None:
    out = tmp_path / "ddp.json"
    res = CliRunner().invoke(app, ["bench", "ddp", "--gpus", "1,2", "--models", "small", "--iters", "1",
                                   "--json", str(out)])
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    assert [(r["gpus"], r["model"]) for r in result["rows"]] == [(1, "small"), (2, "small")]
    for row in result["rows"]:
        assert row["params"] > 0
        for figure in ("iter_ms", "allreduce_ms"):
            assert set(row[figure]) - {"ring_unsealed"} == {"plain", "encrypted_naive", "encrypted"}
            assert all(v > 0 for v in row[figure].values())
        # The all-reduces also time the rings' own transport, and say what CPU every rank spent.
        assert set(row["allreduce_ms"]) == set(row["allreduce_cpu_ms"]) == set(row["iter_ms"]) | {"ring_unsealed"}
        # The methods took turns (issue 31), and each all-reduce's spread brackets its median.
        assert all(lo <= row["allreduce_ms"][k] <= hi for k, (lo, hi) in row["allreduce_spread_ms"].items())
    assert result["interleaved"] is True
    # G2 for the hook, measured in this run: the plain ring equals itself bit for bit, agrees with gloo.
    assert result["g2_identical"] is True, result["g2"]
    assert [(c["gpus"], c["model"]) for c in result["g2"]] == [(1, "small"), (2, "small")]
    assert all(c["ring_repeats_bitwise"] and c["hook_losses_repeat_bitwise"] and c["ring_agrees_with_gloo"]
               for c in result["g2"])
    bad = CliRunner().invoke(app, ["bench", "ddp", "--gpus", "0", "--models", "small"])
    assert bad.exit_code == 1 and "GPU counts" in bad.output
