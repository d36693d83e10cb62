"""The orchestrator's travel log (orchestrator/audit/). A checkpoint records its head, and a resumed
job travels only if the log still holds it: a file can be moved, cut or swapped, the record cannot."""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from gputravel.errors import BadInput, TravelLogMismatch
from gputravel.orchestrator.audit import AuditEvent, AuditLog, ChunkId, Note
from gputravel.orchestrator.audit.entries import HASH_BYTES, JOB_BYTES
from gputravel.orchestrator.audit.signature import load_signer
from gputravel.protocol.control import TravelReport


@dataclass(frozen=True)
class LogHead:
    """A travel log's head as a checkpoint records it."""

    job: bytes
    signer: str  # SHA-256 of the signing key's SubjectPublicKeyInfo, hex
    seq: int
    hash: bytes
    travels: int

    def to_dict(self) -> dict[str, object]:  # plain types: a checkpoint is loaded with weights_only
        return {"job": self.job.hex(), "signer": self.signer, "seq": self.seq, "hash": self.hash.hex(),
                "travels": self.travels}

    @classmethod
    def from_dict(cls, values: object) -> LogHead:
        head = None
        if isinstance(values, Mapping):
            with contextlib.suppress(KeyError, TypeError, ValueError):
                head = cls(job=bytes.fromhex(values["job"]), signer=str(values["signer"]), seq=values["seq"],
                           hash=bytes.fromhex(values["hash"]), travels=values["travels"])
        if head is None or len(head.job) != JOB_BYTES or len(head.hash) != HASH_BYTES \
                or type(head.seq) is not int or type(head.travels) is not int or head.seq < 0 or head.travels < 1:
            raise TravelLogMismatch("the checkpoint's record of the travel log is malformed: it is not a checkpoint "
                                    "this orchestrator wrote; resume from one it did")
        return head

    def __str__(self) -> str:
        return f"entry seq {self.seq} (hash {self.hash.hex()[:16]}…) of job {self.job.hex()}'s travel log"


class TravelLog:
    def __init__(self, path: str, key_pem: bytes, gpu: str) -> None:
        # A missing log is created at its first entry: a resumed job first says which it continues.
        self.path, self._key_pem, self._gpu = path, key_pem, gpu
        spki = load_signer(key_pem).public_key().public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
        self._signer = hashlib.sha256(spki).hexdigest()  # the key's fingerprint, as a checkpoint records it
        self._followed: LogHead | None = None  # another orchestrator's head this log continues
        # Approvals seen at joins, written just before the next entry: a resumed job's log must first
        # say which head it continues (resume), and holders join before that.
        self._approvals: list[tuple[Note, float]] = []
        self._log = AuditLog.open(path, key_pem, gpu=gpu) if Path(path).exists() else None

    def _writer(self) -> AuditLog:
        if self._log is None:
            f = self._followed
            self._log = AuditLog.create(self.path, self._key_pem, gpu=self._gpu, job=f.job if f else None,
                                        after=(f.hash, f.travels) if f else None)
        approvals, self._approvals = self._approvals, []
        for note, when in approvals:
            self._log.note(AuditEvent.APPROVED, note, time=when)
        return self._log

    @property
    def closed(self) -> bool:  # the job is done: no travel may follow
        return self._log is not None and self._log.sealed

    def check_open(self) -> None:
        if self.closed:
            raise BadInput("this orchestrator's job is done and its travel log closed: no travel may follow; "
                           "a new job needs a new orchestrator and log")

    # ------------------------------------------------------------------ checkpoints
    def record(self) -> dict[str, object] | None:
        """What a checkpoint records: the head, or the one it follows if not yet written (None: nothing)."""
        if self._log is None or self._log.mark[0] < 0:
            return self._followed.to_dict() if self._followed is not None else None
        seq, digest, travels = self._log.mark
        return LogHead(self._log.job, self._signer, seq, digest, travels).to_dict()

    def resume(self, recorded: object) -> None:
        """Before a resumed job travels: TravelLogMismatch unless this orchestrator's log holds the
        recorded head; another orchestrator's head is continued in this, still empty, log."""
        if recorded is None:
            return
        head = LogHead.from_dict(recorded)
        if head.signer == self._signer:
            self._holds(head)
        else:
            self._follow(head)

    def _holds(self, head: LogHead) -> None:
        where = f"the checkpoint was taken at {head}, which this orchestrator signed"
        keep = ("; nothing travelled. Put that log back at its path (a new log would leave the travels before "
                "the checkpoint out), or start the job afresh without the checkpoint")
        if self._log is None:
            raise TravelLogMismatch(f"{where}, but there is no travel log at {self.path} (moved or deleted?){keep}")
        if self._log.mark[0] < 0:
            raise TravelLogMismatch(f"{where}, but the travel log at {self.path} is empty{keep}")
        if self._log.job != head.job:
            raise TravelLogMismatch(f"{where}, but the travel log at {self.path} is job {self._log.job.hex()}'s: "
                                    f"another job's log{keep}")
        if not self._log.holds(head.seq, head.hash):
            raise TravelLogMismatch(f"{where}, but the travel log at {self.path} does not hold that entry "
                                    f"(cut short, or replaced){keep}")

    def _follow(self, head: LogHead) -> None:
        log = self._log
        if log is not None and log.mark[0] >= 0:
            if not (log.job == head.job and log.continues == head.hash):
                raise TravelLogMismatch(f"the checkpoint was taken at {head}, signed by another orchestrator, but the "
                                        f"travel log at {self.path} already holds entries that do not continue it; "
                                        "nothing travelled. Resume with a log path of its own")
            return  # this log continues that head already (a restart before the next checkpoint)
        self._followed = head
        if log is not None:  # an empty file (lent by the supervisor, or a crash before its first entry)
            log.start_after(head.job, (head.hash, head.travels))

    # ------------------------------------------------------------------ entries
    def travelled(self, report: TravelReport, dataset_offset: int, epoch_before: int, epoch_after: int,
                  holder_key: bytes) -> None:
        chunk = report.chunk
        if chunk is None:
            self._writer().append("refused", ChunkId(report.holder, dataset_offset, 0), time=time.time(),
                                  epoch_before=epoch_before, epoch_after=epoch_after)
            return
        self._writer().append("travel", ChunkId(report.holder, chunk.dataset_offset, chunk.nbytes),
                              time=time.time(), epoch_before=epoch_before, epoch_after=epoch_after,
                              chunk_digest=chunk.digest, holder_key=holder_key)

    def aborted(self, holder: str, dataset_offset: int, epoch_before: int, epoch_after: int) -> None:
        self._writer().append("aborted", ChunkId(holder, dataset_offset, 0), time=time.time(),
                              epoch_before=epoch_before, epoch_after=epoch_after)

    # Issue 28: what holders approved and signed, and whom the model was released to. Each before the
    # closing entry: a closed log is final, so a release after it needs a new log.
    def approved(self, holder: str, job_digest: bytes) -> None:
        """Holder `holder` accepted this orchestrator's attestation of the job `job_digest` (RTMR[3]):
        written before the next entry, so before any byte of its data is logged as travelled."""
        self._approvals.append((Note(holder, bytes(job_digest), (), ()), time.time()))

    def release_signed(self, holder: str, statement_digest: bytes) -> None:
        """Holder `holder` signed the release statement of this digest (a valid signature, as counted)."""
        self._writer().note(AuditEvent.SIGNED, Note(holder, bytes(statement_digest), (), ()), time=time.time())

    def released(self, statement_digest: bytes, recipients: tuple[str, ...], signers: tuple[str, ...]) -> None:
        """The model was sealed to `recipients` under the statement of this digest, signed by `signers`
        (each logged by release_signed before)."""
        note = Note("", bytes(statement_digest), tuple(recipients), tuple(sorted(signers)))
        self._writer().note(AuditEvent.RELEASED, note, time=time.time())

    def job_done(self, epoch: int) -> None:
        self._writer().seal(time=time.time(), epoch=epoch)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
