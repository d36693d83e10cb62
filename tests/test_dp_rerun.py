"""A manifest DP-SGD job's sampling and noise key comes from the key broker (purpose "dp", bound to
the orchestrator's measurement and job) and the holders' data: the third hostile review reran an
approved job from scratch, drew a fresh key, and so spent its epsilon twice. The same job over the
same data now draws the same sample and noise, so a rerun trains the same model."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from gputravel.broker import PURPOSES
from gputravel.crypto.pki import CohortPki
from gputravel.errors import BadInput
from gputravel.orchestrator import process
from gputravel.orchestrator.process import check_dp_holders, dp_key
from gputravel.orchestrator.release import anchors_digest
from gputravel.release.seal import anchors
from gputravel.train.privacy import poisson_sample
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
