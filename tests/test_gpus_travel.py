"""Issue 14, parallel travels: `travel --gpus N` runs N single-GPU cohorts that share one set of
vendor roots, each travelling to its own share of the holders at the same time as the others."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gputravel.attest.roots import GPU_ROOT_CERT, GPU_ROOT_KEY, TEE_ROOT_CERT, TEE_ROOT_KEY
from gputravel.cli.app import app
from gputravel.crypto.certs import key_pem
from gputravel.cohort import gpus as gpus_module
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.gpus import GpuCohorts
from gputravel.cohort.trust import SharedRoots, TrustOptions
from gputravel.attest import AttestationError
from gputravel.errors import BadInput
from gputravel.jobs import travel as travel_job
from gputravel.jobs.travel import TravelJobConfig
from gputravel.orchestrator.audit import verify_log
from gputravel.protocol.manifest import chunk_digest

MIB = 1 << 20


class WatchedCohorts(GpuCohorts):
    """The job's GpuCohorts, looked at once every cohort has booted (before any travel)."""

    seen: list[dict] = []

    def start(self) -> None:
        super().start()
        trust = [c.trust for c in self.cohorts]
        self.seen.append({
            "roots": [{n: (t.root / "roots" / n).read_bytes() for n in (GPU_ROOT_CERT, TEE_ROOT_CERT)} for t in trust],
            "holder_roots": [(t.holder_dir(h) / GPU_ROOT_CERT).read_bytes()
                             for c, t in zip(self.cohorts, trust, strict=True) for h in c.dataset_bytes],
            "serials": [t.gpu_serial for t in trust],
            "launcher_roots": self.roots,
            "dirs": [c.dir for c in self.cohorts],
            "files": {p: p.read_bytes() for c in self.cohorts for p in c.dir.rglob("*")
                      if p.is_file() and not p.is_symlink()},
            "uids": [set(c.isolation.uids.values()) for c in self.cohorts],
            "isolated": all(c.isolation.on for c in self.cohorts),
            "configs_hold_roots": any(x.roots is not None for c in self.cohorts
                                      for x in (c.config, c.client.config)),  # the cohort is its supervisor
        })

    def close(self) -> None:
        try:  # each GPU's signed travel log, read before the teardown deletes it
            if self.seen and "log_gpus" not in self.seen[-1]:
                self.seen[-1]["log_gpus"] = [verify_log(c.audit_log_path, c.orchestrator_certificate()).gpu
                                             for c in self.cohorts]
        finally:
            super().close()


@pytest.mark.integration
def test_travel_gpus_2_holders_4_travels_in_parallel_each_gpu_to_its_own_holders(processes, tmp_path: Path, monkeypatch) -> None:
    made: list[SharedRoots] = []  # the roots GpuCohorts made, in its memory
    real_make = SharedRoots.make

    def make(**kw) -> SharedRoots:
        made.append(real_make(**kw))
        return made[-1]

    monkeypatch.setattr(gpus_module.SharedRoots, "make", make)
    monkeypatch.setattr(travel_job, "GpuCohorts", WatchedCohorts)
    WatchedCohorts.seen.clear()
    out = tmp_path / "travel.json"
    res = CliRunner().invoke(app, ["travel", "--gpus", "2", "--holders", "4", "--dataset-mib", "2", "--buffer-mib", "1",
                                   "--workdir", str(tmp_path / "data"), "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    travels = doc["travels"]
    assert doc["config"]["gpus"] == 2 and doc["summary"]["verified"] == doc["summary"]["travels"] == len(travels) == 8
    # Each holder travels with one GPU only, and the GPUs' holder sets are disjoint.
    by_gpu = {g: {t["holder"] for t in travels if t["gpu"] == g} for g in (0, 1)}
    assert by_gpu[0] and by_gpu[1] and not by_gpu[0] & by_gpu[1]
    assert by_gpu[0] | by_gpu[1] == {f"holder-{i}" for i in range(1, 5)}
    # Every chunk exactly once, together covering every dataset, each verified by digest.
    assert sorted((t["holder"], t["dataset_offset"]) for t in travels) == \
        sorted((f"holder-{i}", k * MIB) for i in range(1, 5) for k in range(2))
    for t in travels:
        data = (tmp_path / "data" / f"{t['holder']}.bin").read_bytes()[t["dataset_offset"]:t["dataset_offset"] + MIB]
        assert t["refused"] is None and t["chunk"]["dataset_offset"] == t["dataset_offset"]
        assert t["chunk"]["digest"] == chunk_digest(data).hex()
    # The GPUs travel at the same time: some travel of GPU 0 overlaps one of GPU 1.
    assert all(0 <= t["start_s"] < t["end_s"] for t in travels)
    assert any(a["start_s"] < b["end_s"] and b["start_s"] < a["end_s"]
               for a in travels if a["gpu"] == 0 for b in travels if b["gpu"] == 1)

    # One set of vendor roots: both cohorts (and their holders) trust the same certificates.
    (look,) = WatchedCohorts.seen
    assert look["roots"][0] == look["roots"][1]
    assert len(set(look["holder_roots"])) == 1 and look["holder_roots"][0] == look["roots"][0][GPU_ROOT_CERT]
    assert look["serials"] == ["GPU-EMU-0", "GPU-EMU-1"]
    # Each GPU's log names, inside its signed entries, that GPU's attested serial, not the other's.
    assert look["log_gpus"] == look["serials"]
    # No root key anywhere once every cohort has booted: the launcher's roots are gone, and no
    # file of either cohort holds a copy.
    assert len(made) == 1 and look["launcher_roots"] is None and not look["configs_hold_roots"]
    keys = [key_pem(made[0].gpu.key), key_pem(made[0].tee.key)]
    assert not [p for p in look["files"] if p.name in (GPU_ROOT_KEY, TEE_ROOT_KEY)]
    assert not [p for p, data in look["files"].items() if any(k in data for k in keys)]
    if look["isolated"]:  # two supervisors in one process: blocks of uids of their own
        assert look["uids"][0] and look["uids"][1] and not look["uids"][0] & look["uids"][1]
    assert not any(d.exists() for d in look["dirs"])  # torn down after the travels


def test_gpus_must_be_between_one_and_the_holders() -> None:
    with pytest.raises(BadInput, match=r"--gpus must be between 1 and the number of holders \(2\)"):
        TravelJobConfig(holders=2, gpus=3)
    with pytest.raises(BadInput, match="--gpus must be between 1"):
        TravelJobConfig(holders=2, gpus=0)
    assert TravelJobConfig(holders=2, gpus=2).gpus == 2


def test_shares_must_hold_every_holder_once(tmp_path: Path) -> None:
    path = tmp_path / "d.bin"
    path.write_bytes(hashlib.sha256(b"x").digest() * 1024)
    base = CohortConfig(holders=(HolderSpec("a", str(path)), HolderSpec("b", str(path))), buffer_bytes=MIB)
    for shares, why in [((("a",), ()), "empty share"), ((("a", "b"), ("b",)), "several shares"),
                        ((("a",),), "missing"), ((("a",), ("b", "c")), "unknown"), ((), "at least one share")]:
        with pytest.raises(BadInput, match=why):
            GpuCohorts(base, shares)
    assert GpuCohorts(base, (("b",), ("a",))).gpu_of("a") == 1
    with pytest.raises(BadInput, match="SharedRoots"):
        CohortConfig(holders=base.holders, buffer_bytes=MIB, roots=str(tmp_path / "roots"))


@pytest.mark.integration
def test_a_gpu_that_fails_to_boot_closes_those_started_and_drops_the_roots(processes, tmp_path: Path) -> None:
    """GPU 1 chains to a foreign vendor root (TrustOptions, still honoured with shared roots):
    its holder refuses it, GPU 0's cohort is closed, the roots are gone and the refusal goes on."""
    path = tmp_path / "d.bin"
    path.write_bytes(bytes(MIB))
    base = CohortConfig(holders=(HolderSpec("a", str(path)), HolderSpec("b", str(path))), buffer_bytes=MIB)

    def foreign(k: int, config: CohortConfig) -> CohortConfig:
        return dataclasses.replace(config, trust=TrustOptions(gpu_vendor="foreign")) if k else config

    class Kept(GpuCohorts):
        def close(self) -> None:
            self.kept = (list(self.cohorts), self.roots)
            super().close()

    gpus = Kept(base, (("a",), ("b",)), per_gpu=foreign)
    with pytest.raises(AttestationError), gpus:
        pass
    (started, roots) = gpus.kept
    assert len(started) == 2 and started[0].attestations  # GPU 0 had booted and its holder joined
    assert all(c.children == {} and not c.dir.exists() for c in started)  # every process stopped
    assert gpus.cohorts == [] and roots is not None and gpus.roots is None  # dropped on the failure


def test_the_capacity_check_counts_each_gpus_cohort(monkeypatch) -> None:
    """Several GPUs add a cohort each (device with its VRAM, host, TDX module, orchestrator)
    to what the machine must carry: capacity.check says so, naming the GPUs."""
    from gputravel.cohort import capacity

    holders = 8 * capacity.mib_per_holder(MIB, MIB) + capacity.RESERVE_MIB
    monkeypatch.setattr(capacity, "available_mib", lambda: holders + 10)
    capacity.check(8, sysmem_bytes=MIB, dataset_bytes=MIB)  # one GPU: fits
    with pytest.raises(BadInput, match=r"2 GPUs with 8 holders need about .* MiB a GPU with its own cohort"):
        capacity.check(8, sysmem_bytes=MIB, dataset_bytes=MIB, gpus=2, vram_mib=65)
