"""A manifest DP-SGD job's sampling and noise key comes from the key broker (purpose "dp", bound to
the orchestrator's measurement and job) and the holders' data: the third hostile review reran an
approved job from scratch, drew a fresh key, and so spent its epsilon twice. The same job over the
same data now draws the same sample and noise, so a rerun trains the same model."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from types import SimpleNamespace

import pytest

from gputravel.broker import PURPOSES
from gputravel.crypto.pki import CohortPki
from gputravel.data.demo_records import demo_holders
from gputravel.data.records import common_schema
from gputravel.errors import BadInput
from gputravel.manifest import JobManifest, Outputs
from gputravel.orchestrator import process
from gputravel.orchestrator.process import check_dp_holders, dp_key
from gputravel.orchestrator.release import anchors_digest
from gputravel.release.seal import anchors
from gputravel.train import scripted
from gputravel.train.privacy import poisson_sample
from test_dp_training import job as dp_job  # tests/test_dp_training.py: a DP job over tabular records
from test_release_anchors import _orchestrator  # tests/test_release_anchors.py: a manifest job's orchestrator


def test_the_dp_key_is_the_jobs_and_the_datas_and_nothing_else() -> None:
    cuts = {"north": SimpleNamespace(digest="aa"), "south": SimpleNamespace(digest="bb")}
    key = dp_key(b"s" * 32, cuts)
    assert dp_key(b"s" * 32, dict(reversed(list(cuts.items())))) == key  # the order holders joined in: no matter
    assert dp_key(b"s" * 32, {**cuts, "south": SimpleNamespace(digest="bc")}) != key  # other data: another key
    assert dp_key(b"t" * 32, cuts) != key  # another measurement or job: the broker's other key
    assert len(key) == 32 and "dp" in PURPOSES
    # The same key draws the same sample at every step: a rerun trains on the same records.
    assert all(poisson_sample(key, step, 500, 0.05).equal(poisson_sample(key, step, 500, 0.05)) for step in range(5))


def test_a_manifest_dp_job_over_fewer_or_other_holders_than_it_names_is_refused() -> None:
    """The host picks whom the orchestrator awaits: a run over {A, B} after one over {A, B, C} would draw
    another key (the key follows the data) and spend A's and B's epsilon again (the review of this stop)."""
    cut = SimpleNamespace(digest="aa")
    check_dp_holders(["a", "b", "c"], {"c": cut, "a": cut, "b": cut})
    with pytest.raises(BadInput, match=r"missing \['c'\], not named \[\]"):
        check_dp_holders(["a", "b", "c"], {"a": cut, "b": cut})
    with pytest.raises(BadInput, match=r"missing \[\], not named \['d'\]"):
        check_dp_holders(["a", "b"], {"a": cut, "b": cut, "d": cut})


def test_the_orchestrator_trains_a_manifest_dp_job_on_its_brokers_dp_key(tmp_path, monkeypatch) -> None:
    """docs/security.md row 74, through the orchestrator's own path (`_ending`, `_ending_args`): a
    DP job fetches the broker's "dp" key and trains on its HMAC over the holders' data, so two runs
    of one job over the same data draw one key; a job without DP fetches none."""
    fetched: list[str] = []

    def broker(socket_path, purpose, quote, timeout, broker_key) -> bytes:  # the broker's key for (measurement, job)
        fetched.append(purpose)
        return hashlib.sha256(b"broker/" + purpose.encode()).digest()

    monkeypatch.setattr(process, "fetch_key", broker)
    pki = CohortPki.create(tmp_path / "pki", ["orchestrator", "alice", "bob"])
    orch = _orchestrator(tmp_path / "pki", anchors_digest(anchors(pki.ca_pem)))
    cmd = SimpleNamespace(world_size=1, resume_checkpoint="")
    cuts = {"alice": SimpleNamespace(digest="aa"), "bob": SimpleNamespace(digest="bb")}
    dp, plain = SimpleNamespace(dp_epsilon=3.0), SimpleNamespace(dp_epsilon=0.0)

    keys = [process._ending_args(process._ending(orch, cmd, dp), dp, cuts)["dp_key"] for _ in range(2)]
    assert sorted(fetched) == sorted(["checkpoint", "model", "dp"] * 2)
    assert keys[0] == keys[1] == dp_key(hashlib.sha256(b"broker/dp").digest(), cuts)  # a rerun: the same key
    fetched.clear()
    ending = process._ending(orch, cmd, plain)
    assert "dp" not in fetched and "dp_key" not in process._ending_args(ending, plain, cuts)
    with pytest.raises(BadInput, match="missing"):  # the host awaited a subset
        process._ending_args(process._ending(orch, cmd, dp), dp, {"alice": cuts["alice"]})
    with pytest.raises(BadInput, match="dp"):  # never a fresh key in its place
        process._ending_args(process._ending(orch, cmd, plain), dp, cuts)


def test_run_training_hands_the_brokers_dp_key_to_the_job(tmp_path, monkeypatch) -> None:
    """The hostile review of the test above: it drove `_ending_args` only, so `run_training` dropping
    the key on its way to `run_job` passed. Here `run_training` itself, up to `run_job`."""
    class Handed(Exception):
        pass

    def run_job(cfg, source, **kw):
        raise Handed(kw.get("dp_key"))

    monkeypatch.setattr(process, "fetch_key", lambda sock, purpose, *a: hashlib.sha256(purpose.encode()).digest())
    monkeypatch.setattr(scripted, "run_job", run_job)
    holders = demo_holders("tabular", 2, tmp_path / "data")
    cfg = dp_job(holders)
    schema = common_schema(holders).canonical_json()
    names = [name for name, _ in holders]
    pki = CohortPki.create(tmp_path / "pki", ["orchestrator", *names])
    orch = _orchestrator(tmp_path / "pki", anchors_digest(anchors(pki.ca_pem)))
    manifest = JobManifest.for_job(cfg, holders=names, quorum=1, outputs=Outputs(model="sealed"))
    orch.config = replace(orch.config, job_json=cfg.canonical_json(), manifest_json=manifest.to_json(),
                          buffer_bytes=cfg.buffer_bytes, schema=schema)
    hellos = {n: SimpleNamespace(holder=n, dataset_bytes=8192, piece_bytes=4096, manifest=(b"m",), tokenizer="",
                                 schema=schema, train_records=40, eval_records=8) for n in names}
    orch.travel_sm, orch.holders, orch.travel_log = SimpleNamespace(holders=hellos), dict.fromkeys(names), None
    cmd = SimpleNamespace(config_json=cfg.canonical_json(), world_size=1, rank=0, resume_checkpoint="", run_dir="")
    with pytest.raises(Handed) as handed:
        process.run_training(orch, cmd, control=None, membership=None)
    cuts = {n: process._cut(h, True) for n, h in hellos.items()}
    assert handed.value.args[0] == dp_key(hashlib.sha256(b"dp").digest(), cuts)
