"""`gputravel bench dp` (issue 29): its epsilons and the JSON it writes (a tiny run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gputravel.bench import dp
from gputravel.errors import BadInput


def test_epsilons_parse_with_inf_as_the_non_private_run() -> None:
    assert dp.parse_epsilons("1, 3,8,inf") == (1.0, 3.0, 8.0, None)
    for bad in ("", "0", "-1", "x", "nan"):
        with pytest.raises(BadInput, match="--epsilons"):
            dp.parse_epsilons(bad)


def test_the_json_has_a_row_per_epsilon_with_what_was_spent(tmp_path: Path) -> None:
    cfg = dp.DpBenchConfig((3.0, None), steps=3, batch=32, repeats=1)
    result = dp.run(cfg, tmp_path)
    assert {"machine", "date", "config", "rows"} <= set(result)
    private, public = result["rows"]
    assert set(private) >= {"target_epsilon", "epsilon_spent", "delta", "accuracy"}
    assert private["target_epsilon"] == 3.0 and 0 < private["epsilon_spent"] <= 3.0 and private["delta"] == 1e-5
    assert public["target_epsilon"] is None and public["epsilon_spent"] is None
    assert all(0 <= r["accuracy"] <= 1 for r in result["rows"])
    assert dp.plot(result, tmp_path / "dp.png").stat().st_size > 0
