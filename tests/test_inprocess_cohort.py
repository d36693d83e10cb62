"""The in-process cohort (gputravel/testing/cohort.py): the real orchestrator and holder shells,
the real MUX client and host protocol, on one in-process GPU, with no process started. The
travel tests here ran on process cohorts (tests/test_cohort.py) until the shells took their
connections in their constructors; their assertions are unchanged."""

from __future__ import annotations

import os

import pytest

from gputravel.errors import BadInput
from gputravel.jobs.travel import plan
from gputravel.protocol.manifest import chunk_digest
from gputravel.testing import TEST_LAYOUT
from gputravel.testing.cohort import InProcessCohort

RECORD = TEST_LAYOUT.record_bytes  # the buffer: one record (64 KiB), so chunks are small
CANARY = b"\xc4NARY-holder-%d-"


def make_data(nbytes: int, i: int) -> bytes:
    data = bytearray(os.urandom(nbytes))
    c = CANARY % i
    for off in range(0, nbytes - len(c), 4096):
        data[off : off + len(c)] = c
    return bytes(data)


@pytest.fixture
def datasets() -> dict[str, bytes]:
    return {f"h{i}": make_data(size, i) for i, size in enumerate((3 * RECORD, 2 * RECORD + 12345, RECORD), start=1)}


def test_three_holders_every_chunk_verified(datasets, tmp_path) -> None:
    with InProcessCohort(datasets, buffer_bytes=RECORD, workdir=tmp_path, audit_arrival=True) as cohort:
        joined = {n: cohort.orchestrator.travel_sm.holders[n].dataset_bytes for n in cohort.orchestrator.holders}
        assert joined == {n: len(d) for n, d in datasets.items()}
        reports = [cohort.orchestrator.travel(holder, offset) for holder, offset in plan(joined, RECORD)]
    assert len(reports) == 3 + 3 + 1
    for r in reports:
        data = datasets[r.holder]
        assert r.refused is None and r.chunk is not None
        expected = data[r.chunk.dataset_offset : r.chunk.dataset_offset + RECORD]
        assert r.chunk.nbytes == len(expected)
        # The orchestrator checked VRAM against the holder's manifest; check it independently.
        assert r.chunk.digest == chunk_digest(expected)
        assert set(r.steps_ms) >= {"o_cleanup", "dh_switch", "dh_copy", "tls", "o_rotate"}
        # Every holder audited the buffer on arrival: the previous chunk had been scrubbed.
        assert r.nonzero_on_arrival == 0
    assert [r.travel_id for r in reports] == list(range(1, len(reports) + 1))


def test_bad_requests_get_clear_errors_and_the_cohort_carries_on(datasets, tmp_path) -> None:
    with InProcessCohort({**datasets, "void": b""}, buffer_bytes=RECORD, workdir=tmp_path) as cohort:
        orch = cohort.orchestrator
        with pytest.raises(BadInput, match="unknown holder 'nobody'"):
            orch.travel("nobody", 0)
        with pytest.raises(BadInput, match="empty dataset"):
            orch.travel("void", 0)
        with pytest.raises(BadInput, match="not a chunk start"):
            orch.travel("h1", 3 * RECORD)
        with pytest.raises(BadInput, match="not a chunk start"):
            orch.travel("h1", 12345)
        report = orch.travel("h1", RECORD)  # nothing half-done: the next travel just works
        assert report.chunk is not None and report.chunk.digest == chunk_digest(datasets["h1"][RECORD : 2 * RECORD])
