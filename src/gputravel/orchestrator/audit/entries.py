"""What the travel log holds: entries, the records that carry them, and how a log fails.

File format: one record per entry, appended in order::

    +---------------------------+------------------------------------------------+
    | length: u32 big-endian    | msgpack record {entry: bytes, signature: bytes} |
    +---------------------------+------------------------------------------------+

``entry`` holds the encoded entry (the bytes that are hashed); ``signature`` is raw ``r || s``
(48 bytes each, low-s; see :mod:`.signature`). An entry's hash is SHA-384 over its encoding,
and every entry carries the hash of the one before it (48 zero bytes for seq 0).

Every entry names the GPU that travelled (``gpu``): the serial its vendor certified in its
per-device certificate, as the orchestrator verified it over SPDM (orchestrator/attester.py).
It is inside the hashed, signed bytes, so a log says which GPU went to which holder without
trusting the file's name.

The log is public, so an entry never carries a chunk's bare digest (SHA-256 over its pieces'
SHA-256s: a function of the plaintext alone, which anyone who can guess the chunk could
recompute and so confirm what a holder has). It carries ``chunk_mac``: HMAC-SHA256 of that
digest, and of the chunk's place, under its holder's travel-log key
(``protocol.manifest.chunk_mac``), which only the holder and the orchestrator know. Anyone
else learns from an entry only the holder, the offset, the size and the time.

A job's log ends with a closing entry (:attr:`AuditEvent.CLOSED`, no chunk): the orchestrator
signs it when its job is done, and nothing may follow it (the writer refuses, the verifier
too). A log without one may have lost entries at its end: truncation to whole entries leaves
a valid, shorter chain, which only the closing entry, or a head a party kept, shows.

Every entry names its job (``job``: 16 random bytes the orchestrator chose when the job's
first log was created), so one job's log is never taken for another's, and counts the job's
travel attempts (``travels``: this one included; the closing entry's is the total). A log
starts its job (seq 0 follows the zero hash, and counts travel 1) or continues an earlier log
of the same job signed by another orchestrator (a run resumed in a new cohort, with a new key):
then seq 0's ``prev_hash`` is the hash of the entry of that log at which the job's checkpoint
was taken, and its count goes on from that entry's.

Entries of earlier formats do not decode, and the verifier refuses them as
:attr:`Failure.VERSION`, never as tampering: those from before entries named their GPU
(issue 14), those that logged the bare chunk digest (``chunk_digest``, before the key), and
those from before entries named their job.
"""

from __future__ import annotations

import enum
import hashlib
import math
import struct

from gputravel.errors import BadInput, ProtocolError
from gputravel.protocol.codec import Message, encode
from gputravel.protocol.manifest import JOB_BYTES as JOB_BYTES  # re-exported: the log's readers take it from here

HASH_BYTES = 48  # SHA-384
GENESIS_HASH = bytes(HASH_BYTES)  # the prev_hash of seq 0
MAX_DIGEST_BYTES = 64
MAX_GPU_CHARS = 128  # a vendor serial is at most 64; "sha256:" and a hex fingerprint is 71
MAX_RECORD_BYTES = 16 * 1024  # an entry is a few hundred bytes: anything longer is corruption
LENGTH = struct.Struct(">I")  # the length prefix of every record


class AuditEvent(enum.StrEnum):
    TRAVEL = "travel"  # the chunk was copied and verified
    REFUSED = "refused"  # the holder could not copy, returned the context
    ABORTED = "aborted"  # the travel failed; the orchestrator took the GPU back and rotated
    CLOSED = "closed"  # the job is done: the last entry of the log, naming no chunk


class Failure(enum.StrEnum):
    """How a log failed to verify (the text reads after "audit log: ... at seq N")."""

    TRUNCATED = "truncated final entry"
    MALFORMED = "malformed entry"
    SEQUENCE = "seq gap"
    CHAIN = "hash chain broken"
    SIGNATURE = "bad signature"
    HEAD = "known head missing"
    GPU = "entry names another GPU"  # a log names one GPU: the one its verifier expects, if it says
    VERSION = "entry from an earlier log format"  # before entries named their GPU, keyed their digest, or named their job
    JOB = "entry names another job"  # a log names one job: the one its verifier expects, if it says
    COUNT = "travel count out of step"  # every entry counts the job's travels, one more than the entry before
    AFTER_CLOSE = "entry after the closing entry"  # a closed log is final


class AuditError(ProtocolError):
    """The log does not verify; ``failure`` says how and ``seq`` where (the record's position)."""

    def __init__(self, failure: Failure, seq: int, detail: str) -> None:
        super().__init__(f"audit log: {failure} at seq {seq}: {detail}")
        self.failure = failure
        self.seq = seq


# ----------------------------------------------------------------------------- entries
def check_gpu(gpu: object) -> str:
    """``gpu`` if it can name a GPU in a log: 1-128 printable characters (the CLI prints it)."""
    if not isinstance(gpu, str) or not 0 < len(gpu) <= MAX_GPU_CHARS or not gpu.isprintable():
        raise BadInput(f"a GPU is named by 1-{MAX_GPU_CHARS} printable characters")
    return gpu


class ChunkId(Message, tag="audit.chunk"):
    holder: str
    dataset_offset: int
    nbytes: int

    def __post_init__(self) -> None:
        if not self.holder:
            raise BadInput("a chunk id needs the holder's name")
        if self.dataset_offset < 0 or self.nbytes < 0:
            raise BadInput("chunk offset and size must be non-negative")


class Entry(Message, tag="audit.entry"):
    seq: int
    time: float  # seconds since the epoch, as the caller's clock said
    gpu: str  # the GPU that travelled: its attested serial (see the module's docstring)
    job: bytes  # the job's random id (JOB_BYTES), the same in every entry of its logs
    event: AuditEvent
    chunk: ChunkId | None  # None only in the closing entry
    # The job's travel attempts so far, this one included (from 1); the closing entry's is the
    # job's total. A log that continues another goes on from that log's count.
    travels: int
    epoch_before: int
    epoch_after: int
    # HMAC-SHA256 of the chunk's digest and place under its holder's travel-log key
    # (protocol.manifest.chunk_mac); never the bare digest. Empty when nothing was copied.
    chunk_mac: bytes
    prev_hash: bytes

    def __post_init__(self) -> None:
        if self.seq < 0:
            raise BadInput("seq must be non-negative")
        if not math.isfinite(self.time) or self.time < 0:
            raise BadInput("time must be a finite, non-negative number of seconds")
        check_gpu(self.gpu)
        if len(self.job) != JOB_BYTES:
            raise BadInput(f"a job's id is {JOB_BYTES} bytes")
        if self.travels < (0 if self.event == AuditEvent.CLOSED else 1):
            raise BadInput("an entry counts the job's travels, itself included")
        if self.epoch_before < 0 or self.epoch_after < 0:
            raise BadInput("key epochs must be non-negative")
        if len(self.chunk_mac) > MAX_DIGEST_BYTES:
            raise BadInput(f"a chunk MAC is at most {MAX_DIGEST_BYTES} bytes")
        if (self.event == AuditEvent.CLOSED) != (self.chunk is None):
            raise BadInput("the closing entry, and only it, names no chunk")
        if self.event == AuditEvent.CLOSED and self.chunk_mac:
            raise BadInput("the closing entry has no chunk MAC")
        if len(self.prev_hash) != HASH_BYTES:
            raise BadInput(f"prev_hash must be {HASH_BYTES} bytes")

    @property
    def holder(self) -> str:
        """The chunk's holder ("" for the closing entry)."""
        return self.chunk.holder if self.chunk is not None else ""


class Record(Message, tag="audit.record"):
    entry: bytes  # the encoded Entry: exactly the bytes that are hashed
    signature: bytes


def entry_hash(entry: Entry) -> bytes:
    """SHA-384 over the entry's encoding (what the next entry's prev_hash must be)."""
    return hashlib.sha384(encode(entry)).digest()
