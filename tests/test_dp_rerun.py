"""A manifest DP-SGD job's sampling and noise key comes from the key broker (purpose "dp", bound to
the orchestrator's measurement and job) and the holders' data: the third hostile review reran an
approved job from scratch, drew a fresh key, and so spent its epsilon twice. The same job over the
same data now draws the same sample and noise, so a rerun trains the same model."""

from __future__ import annotations

from types import SimpleNamespace

from gputravel.broker import PURPOSES
from gputravel.orchestrator.process import dp_key
from gputravel.train.privacy import poisson_sample


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
    import pytest

    from gputravel.errors import BadInput
    from gputravel.orchestrator.process import check_dp_holders

    cut = SimpleNamespace(digest="aa")
    check_dp_holders(["a", "b", "c"], {"c": cut, "a": cut, "b": cut})
    with pytest.raises(BadInput, match=r"missing \['c'\], not named \[\]"):
        check_dp_holders(["a", "b", "c"], {"a": cut, "b": cut})
    with pytest.raises(BadInput, match=r"missing \[\], not named \['d'\]"):
        check_dp_holders(["a", "b"], {"a": cut, "b": cut, "d": cut})
