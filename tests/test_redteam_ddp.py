"""The red team's all-reduce row (redteam/allreduce.py, issue 14), run for real: three ranks and
the host as processes of one gloo world, every record of a DDP step's ring all-reduce carried
by the host's process, which records it and tampers with it.

The tests fail if the ring were not sealed (the canary gradient is found in what the host
carried) or if a tampered, replayed or dropped record went unnoticed (a step completes, with a
wrong sum): `test_the_row_fails_when_the_ring_is_not_sealed` runs the same row with every ring
plain and checks that the verdict then says so. The `replay-longer` case (a full-length record in
place of a hop's short last one, audit finding 4) is the one that made gloo end the receiving
rank (SIGABRT) while the ring posted each receive for its record's exact length: the row then
stops at the fixture, as "rank 1 died without a word".
"""

from __future__ import annotations

import os

import pytest

import torch

from gputravel.redteam.allreduce import (
    CONTROL,
    RECEIVER,
    ROW,
    WORLD,
    canary_gradient,
    carry,
    cases,
    found_in,
    gradient_needles,
    judge,
)
from gputravel.redteam.arena import Attack, Verdict
from gputravel.redteam.canary import Found
from gputravel.redteam.evidence import RankStep, SearchedRing, Tampered
from gputravel.redteam.rows import ATTACKS
from gputravel.redteam.run import judge_row

pytestmark = pytest.mark.usefixtures("processes")  # the row runs ranks and a host in processes

FAULTS = [c.name for c in cases() if c.fault]
HONEST = [c.name for c in cases() if not c.fault and c.name != CONTROL]


# ----------------------------------------------------------------------------- in one process
def test_the_row_runs_with_the_red_team() -> None:
    rows = {a.name: a for a in ATTACKS}
    assert ROW in rows and rows[ROW].adversary == "host" and not rows[ROW].needs_isolation


def test_the_search_finds_the_gradient_in_every_encoding_at_any_offset() -> None:
    gradient = canary_gradient(1024)
    needles = gradient_needles(gradient, WORLD)
    share = gradient / WORLD
    noise = os.urandom(4096)
    assert found_in(noise, needles) == 0
    assert found_in(bytes(4096), needles) == 0  # zeros are no gradient
    for leak in (gradient.numpy().tobytes(), share.numpy().tobytes(), (-share).numpy().tobytes(),
                 share.half().numpy().tobytes(), share.bfloat16().view(torch.int16).numpy().tobytes()):
        piece = leak[12:12 + 40]  # a chunk, not at a record boundary, at an odd offset in the capture
        assert found_in(noise[:3] + piece + noise, needles) == len(piece)
    assert found_in(share.numpy().tobytes()[:7], needles) == 0  # shorter than a run: not counted


def test_a_rows_own_plaintext_counts_in_the_report(tmp_path) -> None:
    """run.judge_row adds what a row found of its own canaries to what the holders' search found."""
    attack = Attack(ROW, "host", "tried", "stopped by", lambda a: True)
    clean = judge_row(attack, Verdict(True, "x", (), Found()), tmp_path, {}, tmp_path)
    leaked = judge_row(attack, Verdict(True, "x", (), Found(sample_bytes=8)), tmp_path, {}, tmp_path)
    assert clean.outcome == "defeated" and clean.plaintext_bytes_obtained == 0
    assert leaked.outcome == "FAILED" and leaked.plaintext_bytes_obtained == 8


# ----------------------------------------------------------------------------- the live row
@pytest.fixture(scope="module")
def sealed(tmp_path_factory):
    return carry(tmp_path_factory.mktemp("ddp-row"))


@pytest.mark.integration
def test_what_the_host_carried_holds_no_gradient_byte_and_the_search_works(sealed) -> None:
    for name in [*HONEST, *FAULTS]:
        carried = sealed.carried[name]
        assert carried.nbytes > 0 and carried.records > 0, name
        assert carried.found == 0, f"{name}: the host found {carried.found} bytes of the gradient"
    # Control: the plain ring's traffic holds the gradient, found by the same search.
    assert sealed.carried[CONTROL].found > sealed.carried[CONTROL].nbytes // 2


@pytest.mark.integration
def test_an_honest_host_changes_nothing(sealed) -> None:
    for name in [*HONEST, CONTROL]:
        assert all(r.completed and r.sum_right for r in sealed.ranks[name].values()), name


@pytest.mark.integration
@pytest.mark.parametrize("fault", FAULTS)
def test_each_tamper_stops_the_receivers_step_never_a_wrong_sum(sealed, fault: str) -> None:
    assert sealed.tampered[fault], f"the host did not {fault} a record"
    hit = sealed.ranks[fault][RECEIVER]
    assert not hit.completed and hit.error == "IntegrityError", hit
    assert "failed authentication" in hit.message and "from rank 0" in hit.message  # the ring's own words
    assert hit.untouched and not hit.sum_right  # the optimizer never stepped
    for rank, out in sealed.ranks[fault].items():
        if rank != RECEIVER:  # what they received was not touched: their steps complete, right
            assert out.completed and out.sum_right, (rank, out)


@pytest.mark.integration
def test_the_verdict_is_defeated_with_its_evidence(sealed) -> None:
    verdict = judge(sealed)
    assert verdict.stopped, "\n".join(r.line() for r in verdict.evidence)
    assert verdict.plaintext is not None and verdict.plaintext.total == 0
    records = set(verdict.evidence)
    assert sealed.carried[CONTROL] in records
    # Each fault, to the record: a full-length record (4096 + the 16-byte tag) for the hop's short last one.
    for tampered in (Tampered(case="flip", fault="flip", record=10, nbytes=4112, delivered=4112),
                     Tampered(case="replay", fault="replay", record=10, nbytes=4112, delivered=4112),
                     Tampered(case="replay-longer", fault="replay", record=11, nbytes=3088, delivered=4112),
                     Tampered(case="cut", fault="cut", record=10, nbytes=4112, delivered=2056),
                     Tampered(case="drop", fault="drop", record=10, nbytes=4112, delivered=-1)):
        assert tampered in records, tampered
    for fault in FAULTS:
        hit = sealed.ranks[fault][RECEIVER]
        assert hit in records and not hit.completed and hit.error == "IntegrityError" and hit.untouched
    assert any(isinstance(r, SearchedRing) and r.nbytes > 0 for r in records)


@pytest.mark.integration
def test_the_row_fails_when_the_ring_is_not_sealed(tmp_path) -> None:
    """The row's defence off: every ring plain. (A dropped record then leaves rank 1 waiting
    for a record that never comes, a timeout rather than a sum: that case is left out.)"""
    seen = carry(tmp_path, sealed=False, only=("encrypted", CONTROL, "flip", "replay"))
    verdict = judge(seen)
    assert not verdict.stopped
    assert verdict.plaintext is not None and verdict.plaintext.total > 0
    assert seen.carried["encrypted"].found > 0
    for fault in ("flip", "replay"):
        hit = seen.ranks[fault][RECEIVER]
        assert hit.completed and not hit.sum_right, hit  # unnoticed: a wrong sum
        assert hit in verdict.evidence and isinstance(hit, RankStep)
