"""The anchors a manifest job counts release signatures under are the ones its measurement binds
(the hostile review of issue 28: an operator relaunched the same measured orchestrator with a CA of
its own and met the quorum with holders it invented)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from gputravel.crypto.pki import CohortPki
from gputravel.errors import BadInput
from gputravel.manifest import JobManifest, Outputs
from gputravel.orchestrator.cvm import OrchestratorConfig
from gputravel.orchestrator.process import _ending
from gputravel.orchestrator.release import anchors_digest, holder_anchors
from gputravel.protocol.layout import Layout
from gputravel.release.seal import anchors
from gputravel.train.job import TrainConfig


def _orchestrator(pki: Path, bound: str) -> SimpleNamespace:
    job = TrainConfig(steps=2)
    manifest = JobManifest.for_job(job, holders=["alice", "bob"], quorum=1, outputs=Outputs(model="sealed"))
    config = OrchestratorConfig(host_socket="", pki_dir=str(pki), layout=Layout(), buffer_bytes=4096,
                                job_json=job.canonical_json(), manifest_json=manifest.to_json(),
                                broker_socket="/nonexistent/broker.sock", broker_key="00", anchors_sha384=bound)
    return SimpleNamespace(config=config, attester=SimpleNamespace(quote=lambda report_data: b""))


def test_a_manifest_job_refuses_anchors_other_than_its_measured_ones(tmp_path: Path) -> None:
    ours = CohortPki.create(tmp_path / "ours", ["orchestrator", "alice", "bob"])
    theirs = CohortPki.create(tmp_path / "theirs", ["orchestrator", "alice", "bob"])  # the operator's own CA
    bound = anchors_digest(anchors(ours.ca_pem))
    cmd, cfg = SimpleNamespace(world_size=1, resume_checkpoint=""), TrainConfig(steps=2)
    for pki, why in ((tmp_path / "theirs", "not the ones its measurement binds"), (tmp_path / "ours", "broker")):
        with pytest.raises(Exception) as err:
            _ending(_orchestrator(pki, bound), cmd, cfg)
        assert why in str(err.value)  # ours gets past the anchors, to the (absent) broker
    with pytest.raises(BadInput, match="measurement binds"):
        _ending(_orchestrator(tmp_path / "ours", ""), cmd, cfg)  # a manifest job with unbound anchors
    assert holder_anchors(theirs.ca_pem, theirs.member("orchestrator").cert_pem) == anchors(theirs.ca_pem)


def test_a_manifest_job_that_keeps_no_checkpoint_resumes_from_none(tmp_path: Path) -> None:
    """The review had the host drop a plaintext checkpoint of its own weights into the run directory
    of a job whose manifest keeps no checkpoint: the job resumed from it."""
    CohortPki.create(tmp_path / "pki", ["orchestrator", "alice", "bob"])
    orch = _orchestrator(tmp_path / "pki", "")
    manifest = JobManifest.from_json(orch.config.manifest_json)
    sealed_none = manifest.model_copy(update={"outputs": Outputs(model="sealed", checkpoints="none")})
    orch.config = replace(orch.config, manifest_json=sealed_none.to_json())
    with pytest.raises(BadInput, match="cannot resume"):
        _ending(orch, SimpleNamespace(world_size=1, resume_checkpoint="/run/checkpoint.pt"), TrainConfig(steps=2))


def test_a_quiet_manifest_job_tells_its_launcher_no_loss_and_no_evaluation() -> None:
    from gputravel.orchestrator.process import _step
    from gputravel.train.loop import StepEvent

    event = StepEvent(step=3, loss=0.25, tokens_per_s=1.0, holder="alice", travels=2, stall_share=0.1, elapsed_s=1.0,
                      evaluated={"alice.accuracy": 0.9})
    told = _step(event, quiet=True)
    assert told.loss != told.loss and told.evaluated == {} and told.step == 3  # NaN: no loss
    assert _step(event, quiet=False).loss == 0.25


def test_a_holder_whose_held_out_share_is_not_the_manifests_is_refused() -> None:
    """The manifest states the held-out share every holder keeps (its evaluation): a holder whose
    split differs would be evaluated on, or trained with, records the holders did not agree to."""
    from gputravel.orchestrator.cvm import Orchestrator
    from gputravel.protocol.travel import HolderHello

    manifest = JobManifest.for_job(TrainConfig(steps=2), holders=["alice", "bob"], quorum=1,
                                   outputs=Outputs(model="sealed"))
    stub = SimpleNamespace(_manifest=manifest)  # share 0.2

    def hello(train: int, held: int) -> HolderHello:
        return HolderHello(holder="alice", dataset_bytes=0, piece_bytes=0, manifest=(), tokenizer="", schema="{}",
                           train_records=train, eval_records=held, probed=True, log_key=b"")

    assert Orchestrator._unfit_split(stub, "alice", hello(80, 20)) == ""  # type: ignore[arg-type]
    why = Orchestrator._unfit_split(stub, "alice", hello(70, 30))  # type: ignore[arg-type]
    assert "holds out 30 of its 100 records" in why and "share of 0.2 (20)" in why
    assert Orchestrator._unfit_split(SimpleNamespace(_manifest=None), "alice", hello(70, 30)) == ""  # type: ignore[arg-type]


def test_a_quiet_manifest_jobs_report_keeps_how_many_steps_ran_and_no_value() -> None:
    from gputravel.orchestrator.process import _allowed

    manifest = JobManifest.for_job(TrainConfig(steps=2), holders=["alice"], quorum=1,
                                   outputs=Outputs(model="sealed", metrics=False, samples=False))
    ending = SimpleNamespace(manifest=manifest)
    report = {"losses": [0.5, 0.4], "eval": {"all": {"loss": 0.4}}, "eval_history": [{}], "final_loss": 0.4,
              "loss_before": 0.5, "loss_after": 0.4, "sample": "to be or not", "stopped": True}
    told = _allowed(dict(report), ending)  # type: ignore[arg-type]
    assert told["losses"] == [None, None] and told["sample"] == "" and told["stopped"] is True
    assert all(told[k] is None for k in ("eval", "eval_history", "final_loss", "loss_before", "loss_after"))
    assert _allowed(dict(report), None) == report  # a job without a manifest reports all
