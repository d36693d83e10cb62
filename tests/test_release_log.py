"""The travel log records what holders approved and signed, and the release (issue 28): signed and
chained as travels are, counting no travel, and `audit verify` shows them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gputravel.cli.audit import audit_app
from gputravel.crypto.pki import CohortPki, MemberIdentity
from gputravel.errors import BadInput
from gputravel.orchestrator.audit import AuditError, AuditEvent, AuditLog, Entry, Failure, Note, verify_log
from gputravel.orchestrator.audit.entries import GENESIS_HASH
from gputravel.orchestrator.travel_log import TravelLog

GPU = "GPU-TEST-0"
JOB = hashlib.sha384(b"job manifest").digest()
STATEMENT = hashlib.sha384(b"release statement").digest()


@pytest.fixture(scope="module")
def orch(tmp_path_factory: pytest.TempPathFactory) -> MemberIdentity:
    return CohortPki.create(tmp_path_factory.mktemp("pki"), ["orchestrator"]).member("orchestrator")


def run_job(path: Path, orch: MemberIdentity, *, signed: tuple[str, ...] = ("alice", "carol")) -> None:
    """Approvals at attestation, two travels, the signatures, the release, the close."""
    log = TravelLog(str(path), orch.key_pem, GPU)
    for holder in ("alice", "bob", "carol"):
        log.approved(holder, JOB)
    log.aborted("alice", 0, 0, 1)
    log.aborted("bob", 0, 1, 2)
    for holder in signed:
        log.release_signed(holder, STATEMENT)
    log.released(STATEMENT, ("lab",), ("carol", "alice"))
    log.job_done(2)
    log.close()


def test_approvals_signatures_and_the_release_are_logged_and_verify(tmp_path: Path, orch: MemberIdentity) -> None:
    run_job(tmp_path / "audit.log", orch)
    summary = verify_log(tmp_path / "audit.log", orch.cert_pem, gpu=GPU)
    assert summary.closed and summary.travels == 2 and len(summary.entries) == 2
    assert [(e.event, e.holder) for e in summary.notes] == [
        (AuditEvent.APPROVED, "alice"), (AuditEvent.APPROVED, "bob"), (AuditEvent.APPROVED, "carol"),
        (AuditEvent.SIGNED, "alice"), (AuditEvent.SIGNED, "carol"), (AuditEvent.RELEASED, "")]
    release = summary.notes[-1].note
    assert release is not None and release.signers == ("alice", "carol") and release.recipients == ("lab",)
    assert all(n.note is not None and n.note.digest == JOB for n in summary.notes[:3])
    mine = verify_log(tmp_path / "audit.log", orch.cert_pem, "bob").notes  # a holder's own, and the release
    assert [(e.event, e.holder) for e in mine] == [(AuditEvent.APPROVED, "bob"), (AuditEvent.RELEASED, "")]


def test_a_release_whose_signers_did_not_sign_before_it_does_not_verify(tmp_path: Path, orch: MemberIdentity) -> None:
    run_job(tmp_path / "audit.log", orch, signed=("alice",))
    with pytest.raises(AuditError) as info:
        verify_log(tmp_path / "audit.log", orch.cert_pem)
    assert info.value.failure is Failure.RELEASE and "carol" in str(info.value)


def test_nothing_follows_the_close_and_notes_keep_their_shape(tmp_path: Path, orch: MemberIdentity) -> None:
    run_job(tmp_path / "audit.log", orch)
    with pytest.raises(BadInput, match="closed"):
        AuditLog.open(tmp_path / "audit.log", orch.key_pem, gpu=GPU)
    with AuditLog.create(tmp_path / "b.log", orch.key_pem, gpu=GPU) as log:
        with pytest.raises(BadInput, match=r"note\(\)"):
            log.append(AuditEvent.APPROVED, None, time=1.0, epoch_before=0, epoch_after=0)  # type: ignore[arg-type]
        with pytest.raises(BadInput, match="names its holder"):
            log.note(AuditEvent.APPROVED, Note("", JOB, (), ()), time=1.0)
        with pytest.raises(BadInput, match="names its holder"):
            log.note(AuditEvent.RELEASED, Note("alice", STATEMENT, ("lab",), ("alice",)), time=1.0)
        with pytest.raises(BadInput, match="sorted"):
            log.note(AuditEvent.RELEASED, Note("", STATEMENT, ("lab",), ("bob", "alice")), time=1.0)
        with pytest.raises(BadInput, match="is not an approval"):
            log.note(AuditEvent.TRAVEL, Note("alice", JOB, (), ()), time=1.0)
        log.seal(time=1.0, epoch=0)
        with pytest.raises(BadInput, match="sealed"):
            log.note(AuditEvent.APPROVED, Note("alice", JOB, (), ()), time=2.0)
    with pytest.raises(BadInput, match="digest"):
        Note("alice", b"short", (), ())
    with pytest.raises(BadInput, match="carry a note"):
        Entry(seq=0, time=1.0, gpu=GPU, job=bytes(16), event=AuditEvent.CLOSED, chunk=None,
              note=Note("alice", JOB, (), ()), travels=0, epoch_before=0, epoch_after=0, chunk_mac=b"",
              prev_hash=GENESIS_HASH)


def test_audit_verify_shows_the_approvals_and_the_release(tmp_path: Path, orch: MemberIdentity) -> None:
    run_job(tmp_path / "audit.log", orch)
    (tmp_path / "orch.pem").write_bytes(orch.cert_pem)
    out = tmp_path / "verdict.json"
    result = CliRunner().invoke(audit_app, ["verify", str(tmp_path / "audit.log"), "--key", str(tmp_path / "orch.pem"),
                                            "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "approvals and release" in result.output and "released" in result.output
    notes = json.loads(out.read_text())["notes"]
    assert [n["event"] for n in notes] == ["approved"] * 3 + ["signed"] * 2 + ["released"]
    assert notes[0]["digest"] == JOB.hex() and notes[-1]["signers"] == ["alice", "carol"]


def test_a_log_from_before_notes_is_refused_as_an_earlier_format(tmp_path: Path, orch: MemberIdentity) -> None:
    """A log the previous gputravel wrote (entries without a note) is said to be one, not tampered."""
    import msgpack

    from gputravel.orchestrator.audit.entries import LENGTH, Record
    from gputravel.orchestrator.audit.signature import load_signer, sign_head
    from gputravel.protocol.codec import encode

    with AuditLog.create(tmp_path / "new.log", orch.key_pem, gpu=GPU) as log:
        log.seal(time=1.0, epoch=0)
    entry = verify_log(tmp_path / "new.log", orch.cert_pem)
    assert entry.closed
    fields = {k: v for k, v in msgpack.unpackb(encode(Entry(
        seq=0, time=1.0, gpu=GPU, job=bytes(16), event=AuditEvent.CLOSED, chunk=None, note=None, travels=0,
        epoch_before=0, epoch_after=0, chunk_mac=b"", prev_hash=GENESIS_HASH)), raw=False).items() if k != "note"}
    raw = msgpack.packb(fields, use_bin_type=True)
    record = encode(Record(entry=raw, signature=sign_head(load_signer(orch.key_pem), 0, hashlib.sha384(raw).digest())))
    (tmp_path / "old.log").write_bytes(LENGTH.pack(len(record)) + record)
    with pytest.raises(AuditError) as info:
        verify_log(tmp_path / "old.log", orch.cert_pem)
    assert info.value.failure is Failure.VERSION and "has no note" in str(info.value)
