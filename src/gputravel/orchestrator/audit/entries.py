"""The travel log's entries, the records that carry them (a u32 length, then msgpack {entry,
signature}), and how a log fails. The log is public: a chunk is logged only as its MAC under the
holder's travel-log key, since a bare digest would confirm a guessed chunk. Entries of earlier
formats are refused as :attr:`Failure.VERSION`, never as tampering."""

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
    TRUNCATED = "truncated final entry"
    MALFORMED = "malformed entry"
    SEQUENCE = "seq gap"
    CHAIN = "hash chain broken"
    SIGNATURE = "bad signature"
    HEAD = "known head missing"
    GPU = "entry names another GPU"  # a log names one GPU: the one its verifier expects, if it says
    VERSION = "entry from an earlier log format"  # before entries named their GPU and job, or keyed their digest
    JOB = "entry names another job"  # a log names one job: the one its verifier expects, if it says
    COUNT = "travel count out of step"  # every entry counts the job's travels, one more than the entry before
    AFTER_CLOSE = "entry after the closing entry"  # a closed log is final


class AuditError(ProtocolError):
    """The log does not verify; ``failure`` says how and ``seq`` where (the record's position)."""

    def __init__(self, failure: Failure, seq: int, detail: str) -> None:
        super().__init__(f"audit log: {failure} at seq {seq}: {detail}")
        self.failure = failure
        self.seq = seq


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
    gpu: str  # the GPU that travelled: its attested serial
    job: bytes  # the job's random id (JOB_BYTES), the same in every entry of its logs
    event: AuditEvent
    chunk: ChunkId | None  # None only in the closing entry
    travels: int  # the job's travel attempts so far, this one included; the closing entry's: the total
    epoch_before: int
    epoch_after: int
    chunk_mac: bytes  # protocol.manifest.chunk_mac under the holder's key, never the bare digest; b"": no copy
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
    def holder(self) -> str:  # "" for the closing entry
        return self.chunk.holder if self.chunk is not None else ""


class Record(Message, tag="audit.record"):
    entry: bytes  # the encoded Entry: exactly the bytes that are hashed
    signature: bytes


def entry_hash(entry: Entry) -> bytes:
    return hashlib.sha384(encode(entry)).digest()
