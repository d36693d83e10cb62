"""A resumed job goes on only with the travel log its checkpoint names (orchestrator/travel_log.py).

The hostile review's finding: an orchestrator stopped mid-job (it checkpoints) whose audit.log
was moved away silently started a new log when it came back, trained on from the checkpoint,
and closed that log at the end: `audit verify` said "chain OK, log closed" over a log from seq 0
without the travels before the stop; a closed log of another job, with the same key, passed as
well. Now every checkpoint records the log's head (job id, signer, seq, hash, travel count), a
resume refuses to travel unless the log is there and holds that head, every entry names the
job, and the closing entry counts the job's travels.

In process: the real training loop (train/loop.py) on a tiny model, each batch fetch logged as
the orchestrator logs a travel, with the real TravelLog as the loop's anchor; one deployed
cohort (the review's own steps) at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gputravel.cli.audit import audit_app
from gputravel.crypto.pki import CohortPki, MemberIdentity
from gputravel.errors import BadInput, TravelLogMismatch
from gputravel.orchestrator.audit import AuditEvent, AuditLog, ChunkId, Failure, AuditError, read_log, verify_log
from gputravel.orchestrator.travel_log import TravelLog
from gputravel.train.loader import LocalSource
from gputravel.train.loop import TrainConfig, train
from gputravel.train.rundir import checkpoint_extra

GPU = "GPU-TEST-0"
JOB = TrainConfig(steps=8, batch=2, seq_len=16, buffer_bytes=128, n_layer=1, n_head=1, n_embd=16, threads=1,
                  sample_tokens=0, warmup_steps=1, loader="local")
TOKENS = {name: np.random.default_rng(k).integers(0, 257, 4096, dtype=np.uint16) for k, name in enumerate(("a", "b"))}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> CohortPki:
    return CohortPki.create(tmp_path_factory.mktemp("pki"), ["orchestrator", "other"])


@pytest.fixture(scope="module")
def orch(pki: CohortPki) -> MemberIdentity:
    return pki.member("orchestrator")


class Travelling:
    """Each fetch logged first, as the orchestrator logs each travel (orchestrator/cvm.py)."""

    def __init__(self, log: TravelLog) -> None:
        self.log, self.inner, self.fetches = log, LocalSource(TOKENS), 0

    def sizes(self):
        return self.inner.sizes()

    def fetch(self, visit):
        self.log.check_open()
        self.fetches += 1
        self.log.aborted(visit.holder, visit.token_offset * 2, self.fetches, self.fetches + 1)
        return self.inner.fetch(visit)


def first_part(tmp_path: Path, orch: MemberIdentity) -> tuple[Path, Path, dict]:
    """A job stopped after 4 of its 8 steps: its log (not closed), and its checkpoint's record."""
    log_path, run = tmp_path / "audit.log", tmp_path / "run"
    log = TravelLog(str(log_path), orch.key_pem, GPU)
    steps: list[int] = []
    first = train(JOB, Travelling(log), run_dir=run, on_step=lambda e: steps.append(e.step),
                  should_stop=lambda: len(steps) >= 4, anchor=log)
    log.close()
    assert first.stopped and len(first.losses) == 4
    recorded = checkpoint_extra(run / "checkpoint.pt")["travel_log"]
    entries = read_log(log_path)
    assert recorded["seq"] == len(entries) - 1 and recorded["job"] == entries[0].job.hex()
    assert recorded["travels"] == len(entries) == entries[-1].travels
    return log_path, run / "checkpoint.pt", recorded


def resume(log_path: Path, checkpoint: Path, orch: MemberIdentity) -> tuple[Travelling, TravelLog]:
    log = TravelLog(str(log_path), orch.key_pem, GPU)
    source = Travelling(log)
    try:
        train(JOB, source, run_dir=checkpoint.parent, resume_from=checkpoint, anchor=log)
    finally:
        log.close()
    return source, log


def another_jobs_log(path: Path, orch: MemberIdentity, *, closed: bool) -> None:
    with AuditLog.create(path, orch.key_pem, gpu=GPU) as log:  # a job id of its own
        for i in range(6):
            log.append("travel", ChunkId("a", i << 12, 4096), time=1.0 + i, epoch_before=i, epoch_after=i + 1,
                       chunk_digest=bytes([i]) * 32, holder_key=bytes(32))
        if closed:
            log.seal(time=9.0, epoch=6)


def test_a_resume_continues_the_same_log_and_the_closing_entry_counts_every_travel(tmp_path: Path,
                                                                                    orch: MemberIdentity) -> None:
    log_path, checkpoint, recorded = first_part(tmp_path, orch)
    before = read_log(log_path)
    source, log = resume(log_path, checkpoint, orch)
    assert source.fetches > 0
    reopened = TravelLog(str(log_path), orch.key_pem, GPU)
    reopened.job_done(epoch=0)
    reopened.close()
    summary = verify_log(log_path, orch.cert_pem, job=before[0].job, known_head=bytes.fromhex(recorded["hash"]))
    entries = read_log(log_path)
    assert entries[:len(before)] == before  # the same log, continued
    assert summary.closed and summary.continues is None and summary.count == len(before) + source.fetches + 1
    closing = entries[-1]
    assert closing.event is AuditEvent.CLOSED and closing.travels == len(before) + source.fetches == summary.travels
    assert [e.travels for e in entries[:-1]] == list(range(1, len(entries)))
    result = CliRunner().invoke(audit_app, ["verify", str(log_path), "--key", str(_cert(tmp_path, orch))])
    assert result.exit_code == 0 and f"job {closing.job.hex()}, {closing.travels} travels" in result.output


def test_a_resume_whose_log_was_moved_away_is_refused_and_no_log_is_started(tmp_path: Path,
                                                                            orch: MemberIdentity) -> None:
    """The review's steps: the log moved away between the stop and the restart."""
    log_path, checkpoint, recorded = first_part(tmp_path, orch)
    moved = log_path.rename(tmp_path / "moved-away.log")
    with pytest.raises(TravelLogMismatch, match=r"no travel log at .*moved or deleted") as info:
        resume(log_path, checkpoint, orch)
    assert f"seq {recorded['seq']}" in str(info.value) and recorded["job"] in str(info.value)
    assert not log_path.exists()  # never silently started anew
    log_path.write_bytes(b"")  # an empty file (what the supervisor lends the orchestrator) is no better
    with pytest.raises(TravelLogMismatch, match="is empty"):
        resume(log_path, checkpoint, orch)
    assert log_path.read_bytes() == b""
    log_path.unlink()
    moved.rename(log_path)  # put back: the job goes on
    source, _ = resume(log_path, checkpoint, orch)
    assert source.fetches > 0


def test_a_resume_on_another_jobs_log_or_a_cut_one_is_refused(tmp_path: Path, orch: MemberIdentity) -> None:
    log_path, checkpoint, _ = first_part(tmp_path, orch)
    ours = log_path.read_bytes()
    log_path.unlink()
    another_jobs_log(log_path, orch, closed=True)  # the same key, another job, closed: refused at boot
    with pytest.raises(BadInput, match="is closed"):
        resume(log_path, checkpoint, orch)
    log_path.unlink()
    another_jobs_log(log_path, orch, closed=False)  # ... and not closed (cut before its close): not ours
    with pytest.raises(TravelLogMismatch, match="another job's log") as info:
        resume(log_path, checkpoint, orch)
    assert "nothing travelled" in str(info.value)
    log_path.write_bytes(ours[:-5])  # our own, cut mid-entry: refused when opened
    with pytest.raises(AuditError, match="truncated final entry"):
        resume(log_path, checkpoint, orch)


def test_a_log_cut_to_whole_entries_before_the_checkpoints_head_is_refused(tmp_path: Path,
                                                                          orch: MemberIdentity) -> None:
    log_path, checkpoint, _ = first_part(tmp_path, orch)
    entries = read_log(log_path)
    log_path.write_bytes(_prefix(log_path.read_bytes(), len(entries) - 2))  # a valid, shorter chain
    assert verify_log(log_path, orch.cert_pem).count == len(entries) - 2
    with pytest.raises(TravelLogMismatch, match="does not hold that entry"):
        resume(log_path, checkpoint, orch)


def test_a_checkpoint_of_another_orchestrator_is_continued_in_a_log_that_names_where_it_follows(
        tmp_path: Path, pki: CohortPki, orch: MemberIdentity) -> None:
    """A run resumed in a new cohort (the demo's --resume: a new orchestrator key) cannot
    continue the first orchestrator's log: its own log follows the checkpoint's head (seq 0's
    prev_hash), counts on from it, names the same job, and `audit verify` says it is not the
    job's whole log even once closed (exit 4)."""
    log_path, checkpoint, recorded = first_part(tmp_path, orch)
    other = pki.member("other")
    second = tmp_path / "audit-1.log"
    log = TravelLog(str(second), other.key_pem, GPU)
    source = Travelling(log)
    train(JOB, source, run_dir=checkpoint.parent, resume_from=checkpoint, anchor=log)
    log.job_done(epoch=0)
    log.close()
    entries = read_log(second)
    assert entries[0].seq == 0 and entries[0].prev_hash.hex() == recorded["hash"]
    assert entries[0].job.hex() == recorded["job"] and entries[0].travels == recorded["travels"] + 1
    summary = verify_log(second, other.cert_pem)
    assert summary.closed and summary.continues.hex() == recorded["hash"]
    assert summary.travels == recorded["travels"] + source.fetches
    cert = tmp_path / "other.pem"
    cert.write_bytes(other.cert_pem)
    result = CliRunner().invoke(audit_app, ["verify", str(second), "--key", str(cert), "--json",
                                            str(tmp_path / "o.json")])
    assert result.exit_code == 4 and "continues an earlier log of its job" in result.output, result.output
    assert json.loads((tmp_path / "o.json").read_text())["continues"] == recorded["hash"]
    # The first orchestrator's log holds the head the second follows.
    assert verify_log(log_path, orch.cert_pem, known_head=(recorded["seq"], bytes.fromhex(recorded["hash"])))
    # A log at that path already holding entries that do not follow the head is refused.
    third = tmp_path / "audit-2.log"
    another_jobs_log(third, other, closed=False)
    with pytest.raises(TravelLogMismatch, match="do not continue it"):
        TravelLog(str(third), other.key_pem, GPU).resume(recorded)


def test_entries_name_their_job_and_count_its_travels_without_a_gap(tmp_path: Path, orch: MemberIdentity) -> None:
    path = tmp_path / "audit.log"
    another_jobs_log(path, orch, closed=True)
    entries = read_log(path)
    assert len({e.job for e in entries}) == 1 and [e.travels for e in entries] == [1, 2, 3, 4, 5, 6, 6]
    with pytest.raises(AuditError) as info:
        verify_log(path, orch.cert_pem, job=bytes(16))
    assert (info.value.failure, info.value.seq) == (Failure.JOB, 0)
    # A continuation needs a travel before it; a log that starts its job counts from 1.
    with pytest.raises(BadInput, match="after at least one travel"):
        AuditLog.create(tmp_path / "b.log", orch.key_pem, gpu=GPU, after=(bytes(range(48)), 0))
    with AuditLog.create(tmp_path / "c.log", orch.key_pem, gpu=GPU, after=(bytes(range(48)), 6)) as log:
        assert log.append("refused", ChunkId("a", 0, 0), time=1.0, epoch_before=0, epoch_after=0).travels == 7
        assert log.seal(time=2.0, epoch=0).travels == 7


def _prefix(data: bytes, n: int) -> bytes:
    """The first ``n`` whole records of a log file."""
    pos = 0
    for _ in range(n):
        pos += 4 + int.from_bytes(data[pos:pos + 4], "big")
    return data[:pos]


def _cert(tmp_path: Path, orch: MemberIdentity) -> Path:
    cert = tmp_path / "orchestrator.pem"
    cert.write_bytes(orch.cert_pem)
    return cert


@pytest.mark.timeout(600)  # three orchestrators, and the holders' CVMs booted again after each
def test_a_deployed_orchestrator_restarted_without_its_log_refuses_to_train(processes) -> None:
    """The review's steps on the deployed services: stop the orchestrator mid-job, move its
    audit.log away, start it again: it refuses (TravelLogMismatch) before any travel, and starts
    no log; with the log put back it resumes and continues that log."""
    import test_service_deploy as deploy  # its shells of `gputravel serve`

    where = Path(tempfile.mkdtemp(prefix="gputravel-logswap-"))
    os.chmod(where, 0o711)  # as root the parties run under their own accounts (see deploy.where)
    d = deploy._init(where, "comedies", 1200)
    log, cert = d / "state" / "orchestrator" / "audit.log", d / "public" / "orchestrator.pem"
    shells: list[deploy.Shell] = []
    try:
        shells += [deploy._serve(where, "host"), deploy._serve(where, "gpu-0")]
        holders = [deploy._serve(where, f"holder-{n}") for n in ("north", "south")]
        shells += holders
        deploy._until(lambda: all(h.said("up") for h in holders), 90 * processes, "both holders up", shells)
        first = deploy._serve(where, "orchestrator")
        shells.append(first)
        deploy._until(lambda: deploy._status(d).get("step", 0) >= 5, 180 * processes, "training under way", shells)
        assert first.stop() == 0
        head = verify_log(log, cert.read_bytes()).head_hash
        moved = log.rename(where / "moved-away.log")
        deploy._until(lambda: all(h.said("rejoining") for h in holders), 60 * processes, "the holders to boot again",
                      shells)
        again = deploy._serve(where, "orchestrator", "orchestrator-again")
        assert again.proc.wait(timeout=300 * processes) == 1, again.log.read_text()[-3000:]
        (failed,) = [e for e in again.events() if e.get("event") == "failed"]
        assert failed["kind"] == "TravelLogMismatch" and "no travel log at" in failed["why"], failed
        assert not log.exists() and not (d / "public" / "audit.log").exists()  # nothing started, nothing published
        assert again.said("step") == 0
        moved.rename(log)
        deploy._until(lambda: all(h.said("rejoining") >= 2 for h in holders), 60 * processes,
                      "the holders to boot again", shells)
        third = deploy._serve(where, "orchestrator", "orchestrator-third")
        shells.append(third)
        deploy._until(lambda: third.said("step") >= 1, 180 * processes, "training resumed", shells)
        assert third.stop() == 0
        resumed = verify_log(log, cert.read_bytes(), known_head=head)  # the same log, continued past the stop
        assert resumed.continues is None and resumed.head_hash != head and not resumed.closed
    finally:
        codes = [s.stop() for s in reversed(shells)]
        shutil.rmtree(where, ignore_errors=True)
    assert all(c == 0 for c in codes), codes
