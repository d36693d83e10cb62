"""Issue 28 end to end through a local cohort's processes: a job with a manifest seals its
checkpoints with the key broker's key, tells each holder its held-out metrics, and seals the model
to the recipients once the quorum of holders signed; the recipient's key opens weights equal to
those a local run of the same job trains (G2)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gputravel.broker.seal import is_sealed
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.local import Cohort
from gputravel.data.demo_records import demo_holders
from gputravel.errors import BadInput
from gputravel.files import RECORDS
from gputravel.jobs.training import TrainingJobConfig, resolve
from gputravel.manifest import JobManifest
from gputravel.orchestrator.audit import verify_log
from gputravel.protocol.layout import layout_for
from gputravel.release import NotARecipient, open_release, raw_public
from gputravel.train.job import TrainConfig
from gputravel.train.loader import LocalSource
from gputravel.train.loop import train
from gputravel.train.rundir import Kept, load_checkpoint

pytestmark = pytest.mark.integration

JOB = TrainConfig(workload="tabular", steps=24, batch=8, buffer_bytes=16384, threads=1, eval_every=12, warmup_steps=2,
                  checkpoint_every=12)


def _cohort(tmp: Path, manifest: JobManifest, train: TrainConfig, holders, decline: str = "") -> CohortConfig:
    specs = tuple(HolderSpec(n, p, RECORDS, sign_release=n != decline) for n, p in holders)
    return CohortConfig(holders=specs, buffer_bytes=train.buffer_bytes, layout=layout_for(train.buffer_bytes),
                        schema=train.record_schema, job_json=train.canonical_json(), manifest_json=manifest.to_json(),
                        broker_dir=str(tmp / "broker"), output_dirs=(str(tmp / "run"),), audit_log=str(tmp / "audit.log"))


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("release")
    holders = demo_holders("tabular", 3, tmp / "data")
    job = resolve(TrainingJobConfig(train=JOB, holders=holders, run_dir=str(tmp / "run"))).train
    alice = X25519PrivateKey.generate()
    manifest = JobManifest.for_job(job, holders=[n for n, _ in holders], quorum=2,
                                   recipients=[("alice", raw_public(alice))])
    cfg = _cohort(tmp, manifest, job, holders, decline="holder-3")
    with Cohort(cfg) as cohort:
        report = cohort.train(job.canonical_json(), str(tmp / "run"))
        certificate = cohort.orchestrator_certificate()
    local = train(job.replace(loader="local"), LocalSource.of(job, holders), kept=Kept(weights=True))
    return tmp, job, manifest, alice, report, local, certificate


def _state(blob: bytes) -> dict:
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)


def test_the_model_is_released_to_the_recipient_after_a_quorum_and_equals_the_local_runs(processes, released):
    tmp, job, manifest, alice, report, local, _ = released
    release = report["release"]
    assert release["signed"] == ["holder-1", "holder-2"] and set(release["declined"]) == {"holder-3"}
    assert release["released_to"] == ["alice"]
    statement, weights = open_release((tmp / "run" / "model.release").read_bytes(), alice)
    assert statement.job_digest == manifest.digest()
    ours, theirs = _state(weights), _state(local.weights)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert report["losses"] == local.losses


def test_outsider_opens_release_gets_nothing(processes, released):
    tmp, *_ = released
    with pytest.raises(NotARecipient, match="not sealed to that key"):
        open_release((tmp / "run" / "model.release").read_bytes(), X25519PrivateKey.generate())


def test_host_reads_run_dir_finds_the_checkpoint_and_model_sealed(processes, released):
    tmp, job, *_ = released
    run = tmp / "run"
    for name in ("checkpoint.pt", "model.sealed"):
        data = (run / name).read_bytes()
        assert is_sealed(data), name
        with pytest.raises(BadInput):
            load_checkpoint(run / name, torch.nn.Linear(1, 1))
    assert not (run / "sample.txt").exists()


def test_the_travel_log_records_each_approval_the_signatures_and_the_release(processes, released):
    tmp, _, manifest, _, _, _, certificate = released
    summary = verify_log(tmp / "audit.log", certificate)
    events = [(e.event.value, e.holder) for e in summary.notes]
    assert {("approved", h) for h in ("holder-1", "holder-2", "holder-3")} <= set(events)
    assert ("signed", "holder-1") in events and ("signed", "holder-2") in events
    assert ("signed", "holder-3") not in events and any(ev == "released" for ev, _ in events)
    approved = [e for e in summary.notes if e.event.value == "approved"]
    assert all(e.note.digest == manifest.digest() for e in approved)


def test_the_holders_heard_their_metrics(processes, released):
    _, _, _, _, report, _, _ = released
    assert set(report["eval"]["per_holder"]) == {"holder-1", "holder-2", "holder-3"}
    json.dumps(report["release"])  # numbers and names only
