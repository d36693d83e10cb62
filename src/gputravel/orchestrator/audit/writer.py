"""The orchestrator's writer of the travel log: sign each entry and append it durably (one
``write`` and ``fsync`` each, so a crash tears at most the last). A closed log is never continued:
a continuation could be cut back to the closing entry and verify as a complete log."""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.errors import BadInput
from gputravel.orchestrator.audit.entries import (
    GENESIS_HASH,
    HASH_BYTES,
    JOB_BYTES,
    LENGTH,
    NOTES,
    TRAVEL_ATTEMPTS,
    AuditError,
    AuditEvent,
    ChunkId,
    Entry,
    Note,
    Record,
    check_gpu,
)
from gputravel.protocol.manifest import chunk_mac
from gputravel.orchestrator.audit.signature import load_signer, sign_head
from gputravel.orchestrator.audit.verify import intact_length, verify_log
from gputravel.protocol.codec import encode


def _job_id(job: bytes | None) -> bytes:
    if job is None:
        return secrets.token_bytes(JOB_BYTES)
    if not isinstance(job, bytes) or len(job) != JOB_BYTES:
        raise BadInput(f"a job's id is {JOB_BYTES} bytes")
    return job


def _after(after: tuple[bytes, int] | None) -> tuple[bytes, int]:
    """(prev_hash, travels counted) for seq 0: the zero hash and none, or the entry continued."""
    if after is None:
        return GENESIS_HASH, 0
    digest, travels = after
    if not isinstance(digest, bytes) or len(digest) != HASH_BYTES or digest == GENESIS_HASH:
        raise BadInput(f"a log continues the entry whose {HASH_BYTES}-byte hash it names")
    if type(travels) is not int or travels < 1:
        raise BadInput("a log continues another after at least one travel")
    return digest, travels


class AuditLog:
    """The orchestrator's writer for one GPU. One writer per file; ``append`` is thread-safe."""

    def __init__(self, path: Path, key: ec.EllipticCurvePrivateKey, gpu: str, fd: int, next_seq: int,
                 prev_hash: bytes, job: bytes, travels: int, first_prev: bytes = GENESIS_HASH) -> None:
        self.path = path
        self.gpu = gpu
        self._key = key
        self._fd = fd
        self._next_seq = next_seq
        self._prev = prev_hash
        self._job = job
        self._travels = travels  # the job's travel attempts counted so far (in the log it continues too)
        self._first_prev = prev_hash if next_seq == 0 else first_prev  # what seq 0 follows
        self._lock = threading.Lock()
        self._broken = False
        self._sealed = False  # the closing entry is signed: nothing may follow

    def __repr__(self) -> str:  # the signing key never shows
        return f"AuditLog({os.fspath(self.path)!r}, gpu={self.gpu!r}, next_seq={self._next_seq})"

    @classmethod
    def create(cls, path: str | os.PathLike[str], signing_key: bytes | ec.EllipticCurvePrivateKey, *,
               gpu: str, job: bytes | None = None, after: tuple[bytes, int] | None = None) -> AuditLog:
        """A new, empty log (never over a file); ``job`` is random if None, ``after`` as in start_after."""
        key, p, gpu = load_signer(signing_key), Path(path), check_gpu(gpu)
        job = _job_id(job)
        prev, travels = _after(after)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            raise BadInput(f"audit log {os.fspath(p)!r} already exists (use AuditLog.open)") from None
        dir_fd = os.open(p.parent, os.O_RDONLY | os.O_DIRECTORY)  # a crash must not lose the new file
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return cls(p, key, gpu, fd, 0, prev, job, travels)

    @classmethod
    def open(cls, path: str | os.PathLike[str], signing_key: bytes | ec.EllipticCurvePrivateKey, *,
             gpu: str, repair_truncated_tail: bool = False) -> AuditLog:
        """Continue a log that verifies under the signer's key (``repair_truncated_tail`` cuts a torn end)."""
        key, p, gpu = load_signer(signing_key), Path(path), check_gpu(gpu)
        summary = verify_log(p, key.public_key(), gpu=gpu, allow_truncated_tail=repair_truncated_tail)
        if summary.closed:
            raise BadInput(f"audit log {os.fspath(p)!r} is closed: the job it records is done, and nothing may "
                           "follow its closing entry; a new job needs a new log")
        fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        if summary.truncated_tail:
            os.ftruncate(fd, intact_length(p))
            os.fsync(fd)
        job = summary.job if summary.job is not None else _job_id(None)
        return cls(p, key, gpu, fd, summary.head_seq + 1, summary.head_hash, job, summary.travels,
                   summary.continues or GENESIS_HASH)

    def start_after(self, job: bytes, after: tuple[bytes, int]) -> None:
        """Make this empty log continue another orchestrator's after its entry ``after`` = (hash, count)."""
        job, (prev, travels) = _job_id(job), _after(after)
        with self._lock:
            if self._next_seq != 0:
                raise BadInput("only an empty log can start after another")
            self._job, self._prev, self._travels, self._first_prev = job, prev, travels, prev

    @property
    def job(self) -> bytes:
        return self._job

    @property
    def continues(self) -> bytes | None:
        """The hash of the earlier log's entry seq 0 follows; None if it starts its job."""
        with self._lock:
            return self._first_prev if self._first_prev != GENESIS_HASH else None

    @property
    def mark(self) -> tuple[int, bytes, int]:
        """(seq, hash, travels) of the last entry, read at once, for a checkpoint (seq -1: empty)."""
        with self._lock:
            return self._next_seq - 1, self._prev, self._travels

    def holds(self, seq: int, digest: bytes) -> bool:
        """Whether this writer's own file (whatever the path names now) verifies and holds the entry."""
        with self._lock:
            if self._fd < 0:
                raise BadInput("the audit log is closed")
            if self._next_seq <= seq:
                return False
            try:
                verify_log(f"/proc/self/fd/{self._fd}", self._key.public_key(), gpu=self.gpu, job=self._job,
                           known_head=(seq, digest))
            except AuditError:
                return False
            return True

    @property
    def head(self) -> tuple[int, bytes]:
        return self.mark[:2]

    @property
    def sealed(self) -> bool:
        with self._lock:
            return self._sealed

    def append(self, event: AuditEvent | str, chunk: ChunkId, *, time: float, epoch_before: int,
               epoch_after: int, chunk_digest: bytes = b"", holder_key: bytes | None = None) -> Entry:
        """Sign and durably append one entry; a chunk's digest goes in only as its MAC under ``holder_key``."""
        if event == AuditEvent.CLOSED:
            raise BadInput("the closing entry is signed by seal()")
        if event in NOTES:
            raise BadInput("an approval, a release signature or the release is signed by note()")
        if type(chunk) is not ChunkId:
            raise BadInput("chunk must be a ChunkId")
        mac = self._mac(self._job, chunk, chunk_digest, holder_key)
        with self._lock:
            self._writable()
            return self._write(self._next_entry(event, chunk, time, epoch_before, epoch_after, mac))

    def seal(self, *, time: float, epoch: int) -> Entry:
        """Sign the closing entry: the job is done and nothing follows (``open`` refuses it too)."""
        with self._lock:
            self._writable()
            entry = self._write(self._next_entry(AuditEvent.CLOSED, None, time, epoch, epoch, b""))
            self._sealed = True
            return entry

    def note(self, event: AuditEvent | str, note: Note, *, time: float) -> Entry:
        """Sign and append an approval, a release signature or the release: no chunk, no travel
        counted, key epochs 0 (no key moves)."""
        if event not in NOTES:
            raise BadInput(f"{event!r} is not an approval, a release signature or the release")
        if type(note) is not Note:
            raise BadInput("note must be a Note")
        with self._lock:
            self._writable()
            return self._write(self._next_entry(event, None, time, 0, 0, b"", note))

    def _writable(self) -> None:
        if self._fd < 0:
            raise BadInput("the audit log is closed")
        if self._sealed:
            raise BadInput("the audit log is sealed: its job is done, and nothing may follow its closing entry")
        if self._broken:
            raise BadInput("a write to the audit log failed: reopen it with repair_truncated_tail=True")

    @staticmethod
    def _mac(job: bytes, chunk: ChunkId, chunk_digest: bytes, holder_key: bytes | None) -> bytes:
        if not isinstance(chunk_digest, (bytes, bytearray, memoryview)):
            raise BadInput("chunk_digest must be bytes")  # bytes(n) would make n zero bytes
        if not chunk_digest:
            return b""
        if holder_key is None:
            raise BadInput("a chunk digest is logged only keyed with its holder's travel-log key")
        return chunk_mac(holder_key, job, chunk.holder, chunk.dataset_offset, chunk.nbytes, bytes(chunk_digest))

    def _write(self, entry: Entry) -> Entry:  # the lock held
        raw = encode(entry)
        digest = hashlib.sha384(raw).digest()
        payload = encode(Record(entry=raw, signature=sign_head(self._key, entry.seq, digest)))
        try:
            view = memoryview(LENGTH.pack(len(payload)) + payload)
            while view:  # os.write may write less than it was given
                view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
        except OSError:
            self._broken = True  # a partial record may be on disk: no entry may follow it
            raise
        self._next_seq, self._prev, self._travels = entry.seq + 1, digest, entry.travels
        return entry

    def _next_entry(self, event: AuditEvent | str, chunk: ChunkId | None, time: float, epoch_before: int,
                    epoch_after: int, mac: bytes, note: Note | None = None) -> Entry:
        try:
            event = AuditEvent(event)
        except ValueError:
            raise BadInput(f"unknown audit event {event!r}") from None
        if not isinstance(time, (int, float)) or isinstance(time, bool):
            raise BadInput("time must be a number of seconds")
        travels = self._travels + (event in TRAVEL_ATTEMPTS)
        try:
            entry = Entry(seq=self._next_seq, time=float(time), gpu=self.gpu, job=self._job, event=event, chunk=chunk,
                          note=note, travels=travels, epoch_before=epoch_before, epoch_after=epoch_after, chunk_mac=mac,
                          prev_hash=self._prev)
        except TypeError:  # __post_init__ compared a value of the wrong type
            raise BadInput("key epochs must be ints") from None
        encode(entry)  # type-checks every field (BadInput) before anything is signed
        return entry

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
