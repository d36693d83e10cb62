"""The orchestrator's travel log: one signed, hash-chained audit entry per travel attempt
(see orchestrator/audit.py). It is signed with the orchestrator's cohort TLS key, the key its attestation
quote binds, so a holder that attested the orchestrator can check the log with
`gputravel audit verify LOG --key orchestrator.pem --holder NAME`."""

from __future__ import annotations

import time
from pathlib import Path

from gputravel.orchestrator.audit import AuditLog, ChunkId
from gputravel.protocol.control import TravelReport


class TravelLog:
    def __init__(self, path: str, key_pem: bytes) -> None:
        # A restarted orchestrator continues its own log (verified first), never a new one over it.
        p = Path(path)
        self._log = AuditLog.open(p, key_pem) if p.exists() else AuditLog.create(p, key_pem)

    def travelled(self, report: TravelReport, dataset_offset: int, epoch_before: int, epoch_after: int) -> None:
        chunk = report.chunk
        if chunk is None:
            self._log.append("refused", ChunkId(report.holder, dataset_offset, 0), time=time.time(),
                             epoch_before=epoch_before, epoch_after=epoch_after)
            return
        self._log.append("travel", ChunkId(report.holder, chunk.dataset_offset, chunk.nbytes), time=time.time(),
                         epoch_before=epoch_before, epoch_after=epoch_after, chunk_digest=chunk.digest)

    def aborted(self, holder: str, dataset_offset: int, epoch_before: int, epoch_after: int) -> None:
        self._log.append("aborted", ChunkId(holder, dataset_offset, 0), time=time.time(),
                         epoch_before=epoch_before, epoch_after=epoch_after)

    def close(self) -> None:
        self._log.close()
