"""Issue 28 through the demo's services (service/launch.py): the job runs under a manifest every
holder approved; its checkpoints and model are sealed with the key broker's keys; 2 of 3 holders
sign, and the recipient's key opens the released model to the weights a local run trains (G2).
A killed run resumes from its sealed checkpoint with the key broker's state kept beside the run. (A
holder that did not approve the job refuses it before its first byte: tests/test_rtmr.py and the red
team's changed-job and edited-workload rows, on local cohorts.)"""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gputravel.broker.seal import is_sealed
from gputravel.data.demo_records import demo_holders
from gputravel.errors import BadInput, RemoteError
from gputravel.jobs.training import TrainingJobConfig, job_manifest, keys_dir, resolve, run_training_job
from gputravel.manifest import Recipient
from gputravel.release import NotARecipient, keygen, load_private_key, open_release
from gputravel.release.keys import load_public_key
from gputravel.train.job import TrainConfig

pytestmark = pytest.mark.integration

JOB = TrainConfig(workload="tabular", steps=16, batch=8, buffer_bytes=16384, threads=1, eval_every=8, warmup_steps=2,
                  checkpoint_every=4)


def _alice(tmp: Path) -> tuple[Recipient, Path]:
    private, public = keygen("alice", tmp / "keys")
    return Recipient.of("alice", load_public_key(public)), private


@pytest.fixture(scope="module")
def runs(tmp_path_factory, searchable_tmp):
    tmp = tmp_path_factory.mktemp("demo-release")
    holders = demo_holders("tabular", 3, tmp / "data")
    alice, key = _alice(tmp)
    sealed = TrainingJobConfig(train=JOB, holders=holders, run_dir=str(tmp / "run"), release_to=(alice,),
                               decline=("holder-3",))
    report = run_training_job(sealed)
    local = run_training_job(TrainingJobConfig(train=JOB.replace(loader="local"), holders=holders,
                                               run_dir=str(tmp / "local")))
    return tmp, holders, sealed, key, report, local


def _state(blob: bytes) -> dict:
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)


def test_the_demo_releases_the_model_to_alice_after_2_of_3_sign(processes, runs) -> None:
    tmp, _, sealed, key, report, local = runs
    release = report["release"]
    assert release["signed"] == ["holder-1", "holder-2"] and set(release["declined"]) == {"holder-3"}
    assert release["released_to"] == ["alice"] and release["files"]["release"] == str(tmp / "run" / "model.release")
    unnamed = job_manifest(resolve(sealed))  # the flags' manifest, before the cohort's parties are named in it
    assert report["manifest"]["quorum"] == 2 and report["manifest"]["digest"] != unnamed.digest_hex()
    statement, weights = open_release((tmp / "run" / "model.release").read_bytes(), load_private_key(key))
    assert statement.job_digest.hex() == report["manifest"]["digest"]
    ours = _state(weights)
    theirs = torch.load(tmp / "local" / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert report["losses"] == local["losses"]
    with pytest.raises(NotARecipient):  # a key of no recipient's
        open_release((tmp / "run" / "model.release").read_bytes(), X25519PrivateKey.generate())


def test_the_run_directory_holds_only_ciphertext_of_the_model(processes, runs) -> None:
    tmp, *_ = runs
    run = tmp / "run"
    assert is_sealed((run / "checkpoint.pt").read_bytes()) and is_sealed((run / "model.sealed").read_bytes())
    kept = keys_dir(run)  # beside the run directory, never in it
    assert kept.parent == run.parent and kept.stat().st_mode & 0o077 == 0
    assert sorted(p.name for p in (kept / "broker").iterdir()) == ["broker.key", "broker.secret"]
    assert sorted(p.name for p in (kept / "holder-holder-1" / "pki").iterdir()) == ["holder-1.key", "holder-1.pem"]
    assert not (run / "sample.txt").exists()


# The checkpoint reopens (the same broker and holder keys carried on), and the resumed orchestrator's log
# continues the checkpoint's: the approvals of the holders that joined it are written after that.
def test_a_killed_demo_resumes_from_its_sealed_checkpoint_with_the_same_losses_and_releases_later(
        processes, runs, tmp_path, kill_orchestrators) -> None:
    """A kill and --resume reopen the sealed checkpoint; a model kept sealed short of the quorum is
    released later by the same job's --resume, which trains no step again (issue 28, part 4)."""
    _, holders, sealed, key, _, local = runs
    job = replace(sealed, run_dir=str(tmp_path / "run"), decline=("holder-2", "holder-3"))

    def crash_early(event) -> None:
        if event.step == 5:  # after the checkpoint of step 4, before the run can end
            kill_orchestrators()

    with pytest.raises(RemoteError):
        run_training_job(job, on_step=crash_early)
    assert is_sealed((tmp_path / "run" / "checkpoint.pt").read_bytes())
    resumed = run_training_job(replace(job, resume=True))
    assert resumed["losses"] == local["losses"]
    assert resumed["release"]["released_to"] == [] and resumed["release"]["signed"] == ["holder-1"]
    assert not (tmp_path / "run" / "model.release").exists() and (tmp_path / "run" / "model.sealed").exists()
    metrics = (tmp_path / "run" / "metrics.csv").read_text()
    later = run_training_job(replace(job, resume=True, decline=()))
    assert later["release"]["released_to"] == ["alice"] and later["release"]["signed"] == ["holder-1", "holder-2",
                                                                                           "holder-3"]
    assert (tmp_path / "run" / "metrics.csv").read_text() == metrics  # not a step trained again
    _, weights = open_release((tmp_path / "run" / "model.release").read_bytes(), load_private_key(key))
    theirs = torch.load(runs[0] / "local" / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]
    ours = _state(weights)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    steps = [int(line.split(",")[0]) for line in metrics.splitlines()[1:]]
    assert steps == list(range(JOB.steps))


def test_the_demo_refuses_release_flags_it_cannot_honour_and_a_manifest_of_another_job(tmp_path) -> None:
    holders = demo_holders("tabular", 3, tmp_path / "data")
    alice, _ = _alice(tmp_path)
    with pytest.raises(BadInput, match=r"--release-to: a job with a manifest runs on one GPU"):
        TrainingJobConfig(train=JOB.replace(loader="local"), holders=holders, run_dir=str(tmp_path), release_to=(alice,))
    with pytest.raises(BadInput, match=r"--quorum: expected 1 to 3"):
        TrainingJobConfig(train=JOB, holders=holders, run_dir=str(tmp_path), quorum=4)
    with pytest.raises(BadInput, match=r"--decline nobody: not a holder"):
        TrainingJobConfig(train=JOB, holders=holders, run_dir=str(tmp_path), decline=("nobody",))
    cfg = resolve(TrainingJobConfig(train=JOB, holders=holders, run_dir=str(tmp_path)))
    other = job_manifest(replace(cfg, train=cfg.train.replace(lr=0.5)))
    assert job_manifest(replace(cfg, manifest=job_manifest(cfg))) == job_manifest(cfg)
    with pytest.raises(BadInput, match=r"--manifest: its job is not this demo's: it differs in job\.lr"):
        job_manifest(replace(cfg, manifest=other))
    with pytest.raises(BadInput, match=r"--quorum: --manifest names"):
        TrainingJobConfig(train=JOB, holders=holders, run_dir=str(tmp_path), manifest=other, quorum=2)
    assert job_manifest(replace(cfg, gpus=1, train=cfg.train.replace(loader="local"))) is None


def test_the_demos_summary_asks_nothing_of_holders_for_a_sealed_model(capsys) -> None:
    from gputravel.cli.train import _release_summary

    job = {"digest": "ab" * 48, "holders": ["h1", "h2", "h3"], "quorum": 2}
    sealed = {"signed": [], "declined": {h: "nothing to sign" for h in job["holders"]}, "released_to": [],
              "files": {"sealed": "run/model.sealed"}}
    _release_summary({"manifest": {**job, "model": "sealed"}, "release": sealed})
    out = capsys.readouterr().out
    assert "stays sealed" in out and "--release-to" in out and "declined" not in out
    short = {**sealed, "signed": ["h1"], "declined": {"h2": "its config", "h3": "its config"}}
    _release_summary({"manifest": {**job, "model": "release"}, "release": short})
    out = capsys.readouterr().out
    assert "1 of 3 signed" in out and "h2 declined" in out and "short of the quorum" in out
