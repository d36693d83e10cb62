"""`gputravel bench scale` and what lets a cohort grow: the capacity check that replaced the
16-holder cap, and holders booting several at a time with their GPU probes still one at a
time. No timing assertions: the numbers live in the benchmark."""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from gputravel.bench.scale import parse_holders
from gputravel.cli.app import app
from gputravel.cohort import capacity, supervisor
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.local import Cohort
from gputravel.errors import BadInput
from gputravel.jobs.travel import TravelJobConfig

MIB = 1 << 20
ROW_KEYS = {"holders", "travels", "median_ms", "p90_ms", "fixed_ms", "steps_ms", "boot_s", "rss_mib",
            "rss_private_mib", "boot_cpu_s", "verified", "loadavg", "same_holder_median_ms", "same_holder_fixed_ms",
            "vs_1_holder"}


@pytest.mark.integration
def test_scale_smoke_json_shape(processes, tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    res = CliRunner().invoke(app, ["bench", "scale", "--holders", "1,3", "--travels", "3", "--json", str(out)])
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    assert {"machine", "date", "command", "travels", "buffer_mib", "rows"} <= set(result)
    assert result["command"] == f"gputravel bench scale --holders 1,3 --travels 3 --buffer-mib 1 --json {out}"
    assert [r["holders"] for r in result["rows"]] == [1, 3]
    for r in result["rows"]:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["verified"] and r["travels"] == 3
        assert 0 < r["median_ms"] <= r["p90_ms"] and 0 < r["fixed_ms"] < r["median_ms"]
        assert r["boot_s"] > 0 and r["boot_cpu_s"] > 0 and 0 < r["rss_private_mib"] < r["rss_mib"]
    assert result["rows"][0]["vs_1_holder"] == 1.0


def test_holder_counts_are_checked() -> None:
    assert parse_holders("1, 8,64") == [1, 8, 64]
    for bad in ("", "1,x", "0", str(capacity.MAX_HOLDERS + 1)):
        with pytest.raises(BadInput, match="--holders"):
            parse_holders(bad)


def test_the_cap_is_what_the_machine_carries(monkeypatch: pytest.MonkeyPatch) -> None:
    """No fixed 16 any more: the bound is the uid block, then descriptors and memory, each named."""
    assert TravelJobConfig(holders=64).holders == 64
    with pytest.raises(BadInput, match=f"between 1 and {capacity.MAX_HOLDERS}"):
        TravelJobConfig(holders=capacity.MAX_HOLDERS + 1)
    with pytest.raises(BadInput, match="uids"):
        capacity.check(capacity.MAX_HOLDERS + 1, sysmem_bytes=MIB, dataset_bytes=MIB)
    capacity.check(64, sysmem_bytes=9 * MIB, dataset_bytes=MIB)  # this machine carries the benchmark's row

    monkeypatch.setattr(resource, "getrlimit", lambda _: (256, 256))
    with pytest.raises(BadInput, match=r"RLIMIT_NOFILE.*ulimit -n"):
        capacity.check(64, sysmem_bytes=9 * MIB, dataset_bytes=MIB)
    capacity.check(32, sysmem_bytes=9 * MIB, dataset_bytes=MIB)

    monkeypatch.setattr(capacity, "available_mib", lambda: 2000)
    with pytest.raises(BadInput, match="MemAvailable"):
        capacity.check(32, sysmem_bytes=9 * MIB, dataset_bytes=MIB)
    capacity.check(2, sysmem_bytes=9 * MIB, dataset_bytes=MIB)


def _holders(tmp_path: Path, n: int) -> tuple[HolderSpec, ...]:
    specs = []
    for i in range(1, n + 1):
        path = tmp_path / f"h{i}.bin"
        path.write_bytes(os.urandom(MIB))
        specs.append(HolderSpec(f"h{i}", str(path)))
    return tuple(specs)


def test_holders_start_in_a_window_and_come_up_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """At most BOOT_WINDOW holders are started and not yet up; they come up (certified, then
    probe, then Ready: Supervisor._await_up) one after another, in order, so no two probes of
    the GPU overlap (paper 4.1)."""
    monkeypatch.setattr(supervisor, "BOOT_WINDOW", 2)
    events: list[str] = []
    sup = supervisor.Supervisor.__new__(supervisor.Supervisor)
    sup.config = SimpleNamespace(holders=tuple(HolderSpec(f"h{i}", "-") for i in range(1, 5)))
    monkeypatch.setattr(sup, "_holder_config", lambda h, late: {"name": h.name}, raising=False)
    monkeypatch.setattr(sup, "_launched_as", lambda spec: spec, raising=False)
    monkeypatch.setattr(sup, "_launch", lambda spec, fd: events.append(f"start {spec.key}") or (spec.key, {}, None),
                        raising=False)
    monkeypatch.setattr(sup, "_await_up", lambda key, config, child: events.append(f"up {key}"), raising=False)
    sup._boot_holders()
    assert events == ["start h1", "start h2", "up h1", "start h3", "up h2", "start h4", "up h3", "up h4"]


@pytest.mark.integration
def test_a_cohort_booted_in_a_window_travels_to_every_holder(processes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "BOOT_WINDOW", 2)
    with Cohort(CohortConfig(holders=_holders(tmp_path, 4), buffer_bytes=MIB, device_timeout=5)) as cohort:
        for name in ("h1", "h2", "h3", "h4", "h2"):
            report = cohort.travel(name, 0)
            assert report.chunk is not None and report.refused is None


def _children() -> set[int]:
    """Our child processes (any state but reaped), read from /proc."""
    me, out = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        out.add(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return out


@pytest.mark.integration
def test_a_holder_failing_inside_the_boot_window_leaves_nothing(processes, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """h2 fails to boot while h3 is already started: every process is stopped and reaped."""
    monkeypatch.setattr(supervisor, "BOOT_WINDOW", 3)
    specs = _holders(tmp_path, 3)
    before = _children()
    cohort = Cohort(CohortConfig(holders=specs, buffer_bytes=MIB))
    os.unlink(specs[1].dataset)  # validated at config time, gone at boot time
    with pytest.raises(BadInput, match="does not exist"):
        with cohort:
            pass
    assert cohort.children == {} and _children() <= before
