"""The hardware profiles (protocol/hardware.py): every injected cost traces to the paper, the
emulated profile injects nothing, a wait adds only what a step did not already take, and a
travel under paper-h100 takes at least the time its profile injects (a lower bound on elapsed
time is a correctness property of the injection, not a performance target)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gputravel.bench.paper import figure_6_cell, table_1_row, table_2, tie_break_mib
from gputravel.cli.app import app
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.local import Cohort
from gputravel.errors import BadInput
from gputravel.protocol.hardware import (
    EMULATED, MIB, PAPER_H100, TABLE_1, TABLE_1_COLUMNS, TABLE_2, at_least, hardware_profile, hold_exchange, hold_until,
    table_1,
)

PAPER = Path(__file__).resolve().parents[2] / "shared" / "seeds" / "gpu-travelling-paper.txt"


class FakeClock:
    """A clock that only a sleep moves."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


# ----------------------------------------------------------------------------- tracing to the paper
def test_every_paper_h100_cost_names_its_table_column_and_row_and_equals_that_cell() -> None:
    costs = hardware_profile(PAPER_H100).costs()
    assert set(costs) == {"switch_to_holder", "switch_to_orchestrator", "dataset_read", "gpu_write", "context_exchange"}
    for cost in costs.values():
        m = re.fullmatch(r"paper Table 1, column '([^']+)', row (\d+) MiB.*", cost.source)
        assert m, cost.source
        column, row = m.group(1), int(m.group(2))
        assert column in TABLE_1_COLUMNS and cost.injected_at
        assert cost.ms == pytest.approx(table_1(row, column) / (row if cost.per_mib else 1))
    # The rates the issue names: 512 MiB read in 289 ms, written in 349 ms.
    hw = hardware_profile(PAPER_H100)
    assert hw.read_s(512 * MIB) == pytest.approx(0.288922) and hw.write_s(512 * MIB) == pytest.approx(0.349278)
    assert hw.switch_s("orchestrator") == pytest.approx(0.147727) and hw.switch_s("alice") == pytest.approx(0.147968)


def test_the_tables_are_as_the_paper_prints_them() -> None:
    if not PAPER.is_file():
        pytest.skip(f"the paper's text is not at {PAPER}")
    text = PAPER.read_text()
    for size, row in TABLE_1.items():
        printed = re.search(rf"^{size}\t(.+)$", text, re.M).group(1).split("\t")
        assert tuple(float(x) for x in printed) == row
        assert sum(row[:-1]) == pytest.approx(row[-1], abs=1.0)  # the steps add up to the total (means of 10 runs)
    for bw, row in TABLE_2.items():
        label = "Uncapped" if bw is None else f"{bw:g}M"
        printed = re.search(rf"^{label}\t(.+)$", text, re.M).group(1).replace("%", "").split("\t")
        assert tuple(float(x) for x in printed if x.strip()) == row


def test_the_emulated_profile_injects_nothing_and_unknown_profiles_are_refused() -> None:
    hw = hardware_profile(EMULATED)
    assert hw.costs() == {} and hw.to_json() == {"profile": EMULATED, "injected": {}}
    assert hw.switch_s("orchestrator") == hw.copy_s(512 * MIB) == hw.exchange_s() == 0
    with pytest.raises(BadInput, match="unknown hardware profile"):
        hardware_profile("h200")
    with pytest.raises(BadInput, match="unknown hardware profile"):
        CohortConfig(holders=(HolderSpec("alice", __file__),), buffer_bytes=MIB, hardware="h200")


# ----------------------------------------------------------------------------- waiting
def test_a_wait_adds_only_what_the_step_did_not_already_take() -> None:
    clock = FakeClock()
    start = clock()
    clock.now += 0.030  # the step itself took 30 ms
    assert hold_until(start, 0.100, clock=clock, sleep=clock.sleep) == pytest.approx(0.070)
    assert clock.now == pytest.approx(start + 0.100)
    clock.now = start + 0.250  # slower than the floor: nothing added
    assert hold_until(start, 0.100, clock=clock, sleep=clock.sleep) == 0.0 and len(clock.slept) == 1


def test_a_failing_block_is_not_held() -> None:
    with pytest.raises(RuntimeError):
        with at_least(60.0):  # would hold a minute if the error did not go up at once
            raise RuntimeError("the copy failed")


def test_a_peer_cannot_stretch_the_exchange_beyond_the_floor() -> None:
    hw = hardware_profile(PAPER_H100)
    clock = FakeClock()
    sent = clock()
    clock.now += 0.010
    # A holder claiming it spent a year handling the request adds at most the floor.
    added = hold_exchange(hw, sent, 365 * 86400.0, clock=clock, sleep=clock.sleep)
    assert 0 < added <= hw.exchange_s()


# ----------------------------------------------------------------------------- the paper, set beside ours
def test_paper_rows_and_figure_6_estimates() -> None:
    row = table_1_row(512)
    assert row["total_ms"] == 978.969 and row["steps_ms"]["dh_copy"] == pytest.approx(288.922 + 349.278)
    assert row["steps_ms"]["o_rotate"] is None and table_1_row(3) is None
    cell = figure_6_cell(512, 500)
    assert cell["baseline_ms"] == pytest.approx(15860) and cell["speedup"] == pytest.approx(15860 / 978.969)
    assert figure_6_cell(512, 7) is None


def test_table_2_and_the_tie_break_from_cells() -> None:
    cells = [{"size_mib": s, "bandwidth_mbit": 500.0, "travel_ms": 300 + 1.25 * s, "baseline_ms": 18.0 * s,
              "extrapolated": False} for s in (4, 64, 512)]
    assert tie_break_mib(cells, 500.0) == pytest.approx(300 / (18.0 - 1.25))
    assert tie_break_mib(cells[:1], 500.0) is None
    (row,) = table_2(cells)
    assert row["baseline_tx_s"] == pytest.approx(18.0 * 512 / 1e3) and row["paper"]["baseline_tx_s"] == 15.86
    assert row["baseline_share"] == pytest.approx(row["baseline_tx_s"] / (1230.73 + row["baseline_tx_s"]))


# ----------------------------------------------------------------------------- on a live cohort
@pytest.mark.integration
def test_a_travel_and_a_baseline_under_paper_h100_take_at_least_what_the_profile_injects(processes, tmp_path: Path) -> None:
    data = tmp_path / "alice.bin"
    data.write_bytes(bytes(range(256)) * (4 * MIB // 256))
    hw = hardware_profile(PAPER_H100)
    config = CohortConfig(holders=(HolderSpec("alice", str(data)),), buffer_bytes=MIB, hardware=PAPER_H100)
    with Cohort(config) as cohort:
        travel = cohort.travel("alice", 0)
        base = cohort.baseline("alice", MIB)
    assert travel.chunk is not None  # and its digest was checked: the profile changes no check
    floor_ms = (hw.switch_s("alice") + hw.switch_s("orchestrator") + hw.copy_s(MIB)) * 1e3
    assert travel.total_ms >= floor_ms
    assert travel.steps_ms["dh_copy"] >= hw.copy_s(MIB) * 1e3
    assert travel.steps_ms["tls"] >= hw.exchange_s() * 1e3
    # The baseline's read overlaps its transfer (one deadline for the chunk); its write comes after.
    assert base.total_ms >= hw.copy_s(MIB) * 1e3 and base.steps_ms["gpu_write"] >= hw.write_s(MIB) * 1e3


@pytest.mark.integration
def test_the_travel_json_names_every_injected_cost(processes, tmp_path: Path) -> None:
    out = tmp_path / "travel.json"
    res = CliRunner().invoke(app, ["travel", "--holders", "1", "--dataset-mib", "1", "--buffer-mib", "1",
                                   "--hardware", PAPER_H100, "--workdir", str(tmp_path), "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    injected = doc["hardware"]["injected"]
    assert doc["hardware"]["profile"] == PAPER_H100 and set(injected) == set(hardware_profile(PAPER_H100).costs())
    assert all("Table 1" in c["source"] and c["injected_at"] for c in injected.values())
    (travel,) = doc["travels"]
    assert travel["total_ms"] >= (injected["switch_to_holder"]["ms"] + injected["switch_to_orchestrator"]["ms"])


def test_the_commands_refuse_an_unknown_profile(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["travel", "--hardware", "h200", "--workdir", str(tmp_path)])
    assert res.exit_code == 1 and "unknown hardware profile" in res.output
