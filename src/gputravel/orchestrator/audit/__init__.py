"""The travel log: an append-only, hash-chained record of every travel, signed by the orchestrator.

Each :class:`Entry` says which GPU travelled (``gpu``: the serial the orchestrator attested),
who got it (the chunk id names the holder), what happened (``travel``, ``refused``,
``aborted``), the key epoch before and after, and the MAC of the digest of the chunk that was
copied, keyed with its holder's travel-log key (the log is public; the bare digest would
confirm a guessed chunk to anyone). It is encoded with the project's codec; its hash is
SHA-384 over that encoding, and every entry carries the hash of the one before it (48 zero
bytes for seq 0). The orchestrator signs every entry's ``(seq, hash)`` with its ECDSA P-384
key, so any prefix of the log is a signed head a holder can check on its own; when its job is
done it signs a closing entry (``closed``), the last: a log without one may be missing entries
at its end.

* :mod:`.entries`   - the entries, the on-disk record format, and how a log fails;
* :mod:`.signature` - the signature on each head, and loading the orchestrator's keys;
* :mod:`.verify`    - reading a log and verifying it (what a holder runs);
* :mod:`.writer`    - :class:`AuditLog`, the orchestrator's durable, signing writer.

Pure functions take the time as an argument; nothing here reads the clock.
"""

from gputravel.orchestrator.audit.entries import (
    GENESIS_HASH,
    AuditError,
    AuditEvent,
    ChunkId,
    Entry,
    Failure,
    entry_hash,
)
from gputravel.orchestrator.audit.signature import load_verifier
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
    "entry_hash",
    "load_verifier",
    "mismatched_chunks",
    "read_log",
    "verify_log",
]
