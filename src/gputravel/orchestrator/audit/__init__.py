"""The travel log: an append-only, hash-chained record of every travel, each head signed by the
orchestrator, ending with a signed closing entry when its job is done (:mod:`.entries` says what
an entry holds, :mod:`.verify` how a holder checks it, :mod:`.writer` how it is written)."""

from gputravel.orchestrator.audit.entries import (
    GENESIS_HASH,
    AuditError,
    AuditEvent,
    ChunkId,
    Entry,
    Failure,
    Note,
    entry_hash,
)
from gputravel.orchestrator.audit.verify import AuditSummary, mismatched_chunks, read_log, verify_log
from gputravel.orchestrator.audit.writer import AuditLog

__all__ = [
    "GENESIS_HASH",
    "AuditError",
    "AuditEvent",
    "AuditLog",
    "AuditSummary",
    "ChunkId",
    "Entry",
    "Failure",
    "Note",
    "entry_hash",
    "mismatched_chunks",
    "read_log",
    "verify_log",
]
