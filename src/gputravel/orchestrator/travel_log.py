"""The orchestrator's travel log: one signed, hash-chained audit entry per travel attempt
(see orchestrator/audit/). It is signed with the orchestrator's cohort TLS key, the key its attestation
quote binds, and every entry names the GPU the orchestrator attested (its serial), so a holder
that attested the orchestrator and saw that GPU's serial can check the log with
`gputravel audit verify LOG --key orchestrator.pem --holder NAME --gpu SERIAL`.

The log is published, so a copied chunk's digest is logged only keyed with its holder's
travel-log key (the holder's hello carries it, on every join); when the job is done the log is
closed with a signed closing entry, and this orchestrator travels no more."""

from __future__ import annotations

import time
from pathlib import Path

from gputravel.errors import BadInput
from gputravel.orchestrator.audit import AuditLog, ChunkId
from gputravel.protocol.control import TravelReport


class TravelLog:
    def __init__(self, path: str, key_pem: bytes, gpu: str) -> None:
        # A restarted orchestrator continues its own log (verified first), never a new one over
        # it; a log that names another GPU, or none (an earlier version's), is refused, and so
        # is a closed one: its job is done, and a continuation could be cut back to its close.
        p = Path(path)
        self._log = AuditLog.open(p, key_pem, gpu=gpu) if p.exists() else AuditLog.create(p, key_pem, gpu=gpu)

    @property
    def closed(self) -> bool:
        """The job is done: the closing entry is signed, and no travel may follow."""
        return self._log.sealed

    def check_open(self) -> None:
        """BadInput if the job is done (before a travel: it could not be logged)."""
        if self._log.sealed:
            raise BadInput("this orchestrator's job is done and its travel log closed: no travel may follow; "
                           "a new job needs a new orchestrator and log")

    def travelled(self, report: TravelReport, dataset_offset: int, epoch_before: int, epoch_after: int,
                  holder_key: bytes) -> None:
        """Log a travel; its chunk's digest keyed with ``holder_key``, the holder's travel-log key."""
        chunk = report.chunk
        if chunk is None:
            self._log.append("refused", ChunkId(report.holder, dataset_offset, 0), time=time.time(),
                             epoch_before=epoch_before, epoch_after=epoch_after)
            return
        self._log.append("travel", ChunkId(report.holder, chunk.dataset_offset, chunk.nbytes), time=time.time(),
                         epoch_before=epoch_before, epoch_after=epoch_after, chunk_digest=chunk.digest,
                         holder_key=holder_key)

    def aborted(self, holder: str, dataset_offset: int, epoch_before: int, epoch_after: int) -> None:
        self._log.append("aborted", ChunkId(holder, dataset_offset, 0), time=time.time(),
                         epoch_before=epoch_before, epoch_after=epoch_after)

    def job_done(self, epoch: int) -> None:
        """Sign the closing entry: the job is done; nothing follows it (not even after a restart)."""
        self._log.seal(time=time.time(), epoch=epoch)

    def close(self) -> None:
        self._log.close()
