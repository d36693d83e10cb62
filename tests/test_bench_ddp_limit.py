"""`gputravel bench ddp`'s limit (issue 31): the sealed all-reduce's unoverlapped floor on this
machine, and the docs' table that shows it where a run's JSON has it (and not where it has not)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from gputravel.bench.ddp import aes_gbps_per_core, allreduce_limit_ms, cores_shared, interleaved_ms, spread

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def test_the_limit_adds_each_ranks_aes_spread_over_the_cores_it_shares() -> None:
    # 4 ranks of 1e6 float32: each seals and opens 1.5 of 4 MB, 24 MB of AES at 2 GB/s = 12 ms CPU.
    assert allreduce_limit_ms(10.0, 1_000_000, 4, 2.0, cores=2) == pytest.approx(10.0 + 6.0)
    assert allreduce_limit_ms(10.0, 1_000_000, 4, 2.0, cores=16) == pytest.approx(10.0 + 3.0)  # a core a rank
    assert allreduce_limit_ms(10.0, 1_000_000, 2, 2.0, cores=1) == pytest.approx(10.0 + 4.0)
    assert allreduce_limit_ms(10.0, 1_000_000, 2, 2.0, cores=2, item=2) == pytest.approx(10.0 + 1.0)  # fp16
    assert allreduce_limit_ms(0.05, 1_000_000, 1, 2.0, cores=2) == 0.05  # one rank seals nothing


def test_the_methods_take_turns_in_an_order_that_rotates_each_round() -> None:
    log: list[str] = []
    runs = {name: (lambda name=name: log.append(name)) for name in ("plain", "naive", "pipelined")}
    samples, cpu = interleaved_ms(runs, 1, 3, done=lambda: log.append("done"), sync=lambda: log.append("sync"),
                             before=lambda: log.append("before"))
    assert {name: len(v) for name, v in samples.items()} == {"plain": 3, "naive": 3, "pipelined": 3}
    assert all(t >= 0 for v in samples.values() for t in v)
    assert {name: len(v) for name, v in cpu.items()} == {name: len(v) for name, v in samples.items()}
    warmup, timed = log[:7], log[7:]
    assert warmup == ["before", "plain", "before", "naive", "before", "pipelined", "done"]
    # Each sample: its gradient restored, GPU work done, the ranks together, then the timed run.
    assert all(timed[i:i + 3] == ["before", "done", "sync"] and timed[i + 4] == "done" for i in range(0, 45, 5))
    assert [timed[i + 3] for i in range(0, 45, 5)] == ["plain", "naive", "pipelined", "naive", "pipelined", "plain",
                                                       "pipelined", "plain", "naive"]


def test_the_spread_is_the_samples_tenth_and_ninetieth_percentiles() -> None:
    assert spread([float(v) for v in range(11)]) == pytest.approx((1.0, 9.0))
    assert spread([7.0]) == (7.0, 7.0)


def test_the_aes_rate_and_the_cores_are_measured_here() -> None:
    assert aes_gbps_per_core(rounds=1) > 0
    assert 1 <= cores_shared()


def _render(tmp_path: Path, data: dict) -> str:
    (tmp_path / "run.json").write_text(json.dumps(data))
    out: list[str] = []
    fake = types.SimpleNamespace(inFile=str(tmp_path / "doc.md"), out=out.append)
    sys.modules["cog"], saved = fake, sys.modules.get("cog")  # type: ignore[assignment]
    sys.path.insert(0, str(TOOLS))
    try:
        import tables

        tables.ddp("run.json")
    finally:
        sys.path.remove(str(TOOLS))
        if saved is None:
            del sys.modules["cog"]
        else:
            sys.modules["cog"] = saved
    return "".join(out)


def _row(gpus: int, **extra) -> dict:
    return {"gpus": gpus, "model": "base", "params": 3_000_000,
            "iter_ms": {"plain": 100.0, "encrypted_naive": 120.0, "encrypted": 110.0},
            "allreduce_ms": {"plain": 20.0, "encrypted_naive": 30.0, "encrypted": 28.0}, **extra}


def test_the_table_shows_the_limit_where_the_json_has_it(tmp_path: Path) -> None:
    old = _render(tmp_path, {"date": "2026-11-24T20:52:00+00:00", "rows": [_row(1), _row(4)]})
    assert "limit" not in old and "| 4 | base | 100.0 | 120.0 | 110.0 | 1.10 | 20.00 | 30.00 | 28.00 | 1.40 |" in old
    limited = [_row(1, aes_gbps_per_core=5.0, allreduce_limit_ms=0.05,
                    allreduce_vs_limit={"encrypted_naive": 0.0, "encrypted": 0.0}),
               _row(4, aes_gbps_per_core=5.0, allreduce_limit_ms=25.0,
                    allreduce_vs_limit={"encrypted_naive": 1.2, "encrypted": 1.12})]
    new = _render(tmp_path, {"rows": limited, "aes_gbps_per_core": 5.0})
    assert "encrypted / limit" in new
    assert "| 4 | base | 100.0 | 120.0 | 110.0 | 1.10 | 20.00 | 30.00 | 28.00 | 1.40 | 5.00 | 25.00 | 1.20 | 1.12 |" in new
    assert "| 1 | base |" in new and new.split("| 1 | base |")[1].split("\n")[0].endswith("| - | - |")


def test_a_compressed_run_names_its_type_beside_the_model_and_halves_the_limits_aes(tmp_path: Path) -> None:
    row = _row(2, compress="fp16", aes_gbps_per_core=5.0, allreduce_limit_ms=21.2,
               allreduce_vs_limit={"encrypted_naive": 1.0, "encrypted": 1.0})
    assert "| 2 | base (fp16) |" in _render(tmp_path, {"rows": [row]})
    assert allreduce_limit_ms(20.0, 3_000_000, 2, 5.0, 2, item=2) == pytest.approx(20.0 + 1.2)
