"""The orchestrator's travel log: one signed, hash-chained audit entry per travel attempt
(see orchestrator/audit/). It is signed with the orchestrator's cohort TLS key, the key its attestation
quote binds, and every entry names the GPU the orchestrator attested (its serial), so a holder
that attested the orchestrator and saw that GPU's serial can check the log with
`gputravel audit verify LOG --key orchestrator.pem --holder NAME --gpu SERIAL`."""

from __future__ import annotations

import time
from pathlib import Path

from gputravel.orchestrator.audit import AuditLog, ChunkId
from gputravel.protocol.control import TravelReport


class TravelLog:
    def __init__(self, path: str, key_pem: bytes, gpu: str) -> None:
        # A restarted orchestrator continues its own log (verified first), never a new one over
        # it; a log that names another GPU, or none (an earlier version's), is refused.
        p = Path(path)
        self._log = AuditLog.open(p, key_pem, gpu=gpu) if p.exists() else AuditLog.create(p, key_pem, gpu=gpu)

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
