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
    # Notes, naming no chunk and counting no travel (issue 28):
    APPROVED = "approved"  # a holder accepted the orchestrator's attestation of this job digest
    SIGNED = "signed"  # a holder signed the release statement of this digest
    RELEASED = "released"  # the model was sealed to the recipients after the signers' quorum


#: The events that are a travel attempt: each names a chunk and counts one travel.
TRAVEL_ATTEMPTS = frozenset({AuditEvent.TRAVEL, AuditEvent.REFUSED, AuditEvent.ABORTED})
NOTES = frozenset({AuditEvent.APPROVED, AuditEvent.SIGNED, AuditEvent.RELEASED})


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
    RELEASE = "release without its signatures"  # a release's signers each signed its statement before it


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


class Note(Message, tag="audit.note"):
    """What an approval, a release signature or the release says (its event says which)."""

    holder: str  # the holder that approved or signed; "" in the release
    digest: bytes  # approved: the job manifest's digest; signed, released: the release statement's
    recipients: tuple[str, ...]  # released: whom the model is sealed to; else empty
    signers: tuple[str, ...]  # released: the holders whose signatures counted, sorted; else empty

    def __post_init__(self) -> None:
        if len(self.digest) != HASH_BYTES:
            raise BadInput(f"a note names a job or release statement by its {HASH_BYTES}-byte digest")


class Entry(Message, tag="audit.entry"):
    seq: int
    time: float  # seconds since the epoch, as the caller's clock said
    gpu: str  # the GPU that travelled: its attested serial
    job: bytes  # the job's random id (JOB_BYTES), the same in every entry of its logs
    event: AuditEvent
    chunk: ChunkId | None  # a travel attempt's; None in the closing entry and the notes
    note: Note | None  # an approval's, a release signature's or the release's; None in the others
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
        if self.travels < (1 if self.event in TRAVEL_ATTEMPTS else 0):
            raise BadInput("an entry counts the job's travels, itself included")
        if self.epoch_before < 0 or self.epoch_after < 0:
            raise BadInput("key epochs must be non-negative")
        if len(self.chunk_mac) > MAX_DIGEST_BYTES:
            raise BadInput(f"a chunk MAC is at most {MAX_DIGEST_BYTES} bytes")
        if (self.event in TRAVEL_ATTEMPTS) != (self.chunk is not None):
            raise BadInput("a travel attempt, and only it, names a chunk")
        if self.event not in TRAVEL_ATTEMPTS and self.chunk_mac:
            raise BadInput("only a travel attempt has a chunk MAC")
        if len(self.prev_hash) != HASH_BYTES:
            raise BadInput(f"prev_hash must be {HASH_BYTES} bytes")
        self._check_note()

    def _check_note(self) -> None:
        if (self.event in NOTES) != (self.note is not None):
            raise BadInput("an approval, a release signature and the release, and only they, carry a note")
        if self.note is None:
            return
        released = self.event == AuditEvent.RELEASED
        if released == bool(self.note.holder) or released != bool(self.note.recipients) \
                or released != bool(self.note.signers):
            raise BadInput("an approval or a release signature names its holder; the release, its recipients and "
                           "signers")
        if list(self.note.signers) != sorted(set(self.note.signers)):
            raise BadInput("a release names its signers sorted, each once")

    @property
    def holder(self) -> str:  # "" for the closing entry and the release
        if self.chunk is not None:
            return self.chunk.holder
        return self.note.holder if self.note is not None else ""


class Record(Message, tag="audit.record"):
    entry: bytes  # the encoded Entry: exactly the bytes that are hashed
    signature: bytes


def entry_hash(entry: Entry) -> bytes:
    return hashlib.sha384(encode(entry)).digest()
