"""The orchestrator's writer of the travel log: sign each entry and append it durably.

Each record is written with one ``write`` and ``fsync``-ed, so a crash loses at most the
entry being written (its torn remains read as a truncated final entry, see :mod:`.verify`).
A writer is for one GPU, named when the log is created or opened: every entry it signs names
that GPU, and it refuses to continue a log that names another.

A chunk's digest is logged only keyed with its holder's travel-log key (``append`` takes the
digest and the key and signs their MAC: no caller can put a bare digest in the public log).
``seal`` signs the closing entry when the job is done; after it nothing is appended, and a
closed log is never continued (``open`` refuses it): a continuation could be cut back to the
closing entry and verify as a complete log.

A writer names one job (``job``, random unless given) and counts its travels in every entry;
a log that continues an earlier log of its job (another orchestrator's: ``create(after=...)``,
or ``start_after`` while it is still empty) follows that log's entry and count.
"""

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
    AuditError,
    AuditEvent,
    ChunkId,
    Entry,
    Record,
    check_gpu,
)
from gputravel.protocol.manifest import chunk_mac
from gputravel.orchestrator.audit.signature import load_signer, sign_head
from gputravel.orchestrator.audit.verify import intact_length, verify_log
from gputravel.protocol.codec import encode


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


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


def _fsync_dir(path: Path) -> None:
    # A new file's directory entry must be durable too, or a crash can lose the whole log.
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        """Start a new, empty log of ``gpu`` (its attested serial); refuses to overwrite a file.
        ``job``: the job's id (random if None); ``after``: (hash, count) of the entry of an
        earlier log of the job that this one continues (see :meth:`start_after`)."""
        key, p, gpu = load_signer(signing_key), Path(path), check_gpu(gpu)
        job = _job_id(job)
        prev, travels = _after(after)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            raise BadInput(f"audit log {os.fspath(p)!r} already exists (use AuditLog.open)") from None
        _fsync_dir(p)
        return cls(p, key, gpu, fd, 0, prev, job, travels)

    @classmethod
    def open(cls, path: str | os.PathLike[str], signing_key: bytes | ec.EllipticCurvePrivateKey, *,
             gpu: str, repair_truncated_tail: bool = False) -> AuditLog:
        """Continue an existing log of ``gpu`` after verifying it with the signer's own public
        key (AuditError GPU if its entries name another GPU, VERSION if they name none).

        A torn final record (crash mid-write) is refused unless ``repair_truncated_tail``,
        which cuts it off so that new entries follow the last intact one.
        """
        key, p, gpu = load_signer(signing_key), Path(path), check_gpu(gpu)
        summary = verify_log(p, key.public_key(), gpu=gpu, allow_truncated_tail=repair_truncated_tail)
        if summary.closed:
            raise BadInput(f"audit log {os.fspath(p)!r} is closed: the job it records is done, and nothing may "
                           "follow its closing entry; a new job needs a new log")
        fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        if summary.truncated_tail:
            os.ftruncate(fd, intact_length(p))
            os.fsync(fd)
        # An empty log (created, never written) gets a job of its own, unless start_after gives one.
        job = summary.job if summary.job is not None else _job_id(None)
        return cls(p, key, gpu, fd, summary.head_seq + 1, summary.head_hash, job, summary.travels,
                   summary.continues or GENESIS_HASH)

    def start_after(self, job: bytes, after: tuple[bytes, int]) -> None:
        """Make this still-empty log continue an earlier log of job ``job``, signed by another
        orchestrator: its seq 0 follows the entry whose hash is ``after[0]``, and it counts on
        from that entry's count ``after[1]`` (a run resumed from a checkpoint taken there)."""
        job, (prev, travels) = _job_id(job), _after(after)
        with self._lock:
            if self._next_seq != 0:
                raise BadInput("only an empty log can start after another")
            self._job, self._prev, self._travels, self._first_prev = job, prev, travels, prev

    @property
    def job(self) -> bytes:
        """The job's id, in every entry."""
        return self._job

    @property
    def continues(self) -> bytes | None:
        """The hash of the entry of an earlier log that this one's seq 0 follows; None if it starts its job."""
        with self._lock:
            return self._first_prev if self._first_prev != GENESIS_HASH else None

    @property
    def mark(self) -> tuple[int, bytes, int]:
        """(seq, hash, travels) of the last entry, read at once: what a checkpoint records. An
        empty log's seq is -1; its hash and count are those of the entry it continues, if any."""
        with self._lock:
            return self._next_seq - 1, self._prev, self._travels

    def holds(self, seq: int, digest: bytes) -> bool:
        """Whether the file this writer appends to (read through its own descriptor, whatever
        the path names now) holds entry ``seq`` with hash ``digest``, verified with this
        writer's key as a log of its GPU and job."""
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
        """(seq, hash) of the last entry; (-1, GENESIS_HASH) when empty."""
        with self._lock:
            return self._next_seq - 1, self._prev

    @property
    def sealed(self) -> bool:
        """Whether the closing entry is signed (then nothing more is appended)."""
        with self._lock:
            return self._sealed

    def append(self, event: AuditEvent | str, chunk: ChunkId, *, time: float, epoch_before: int,
               epoch_after: int, chunk_digest: bytes = b"", holder_key: bytes | None = None) -> Entry:
        """Sign and durably append one entry (written and fsync-ed before this returns). A
        chunk's digest is logged as its MAC under ``holder_key``, the chunk's holder's
        travel-log key, which is then required."""
        if event == AuditEvent.CLOSED:
            raise BadInput("the closing entry is signed by seal()")
        mac = self._mac(self._job, chunk, chunk_digest, holder_key)
        with self._lock:
            self._writable()
            return self._write(self._next_entry(event, chunk, time, epoch_before, epoch_after, mac))

    def seal(self, *, time: float, epoch: int) -> Entry:
        """Sign the closing entry: the job is done, and this log ends here. Nothing is appended
        after it, by this writer or any other (``open`` refuses a closed log)."""
        with self._lock:
            self._writable()
            entry = self._write(self._next_entry(AuditEvent.CLOSED, None, time, epoch, epoch, b""))
            self._sealed = True
            return entry

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
        if type(chunk) is not ChunkId:
            raise BadInput("chunk must be a ChunkId")
        if holder_key is None:
            raise BadInput("a chunk digest is logged only keyed with its holder's travel-log key")
        return chunk_mac(holder_key, job, chunk.holder, chunk.dataset_offset, chunk.nbytes, bytes(chunk_digest))

    def _write(self, entry: Entry) -> Entry:
        """Sign ``entry`` and append it durably (the lock held)."""
        raw = encode(entry)
        digest = hashlib.sha384(raw).digest()
        payload = encode(Record(entry=raw, signature=sign_head(self._key, entry.seq, digest)))
        try:
            _write_all(self._fd, LENGTH.pack(len(payload)) + payload)
            os.fsync(self._fd)
        except OSError:
            self._broken = True  # a partial record may be on disk: no entry may follow it
            raise
        self._next_seq, self._prev, self._travels = entry.seq + 1, digest, entry.travels
        return entry

    def _next_entry(self, event: AuditEvent | str, chunk: ChunkId | None, time: float, epoch_before: int,
                    epoch_after: int, mac: bytes) -> Entry:
        try:
            event = AuditEvent(event)
        except ValueError:
            raise BadInput(f"unknown audit event {event!r}") from None
        if chunk is not None and type(chunk) is not ChunkId:
            raise BadInput("chunk must be a ChunkId")
        if not isinstance(time, (int, float)) or isinstance(time, bool):
            raise BadInput("time must be a number of seconds")
        travels = self._travels + (event is not AuditEvent.CLOSED)
        try:
            entry = Entry(seq=self._next_seq, time=float(time), gpu=self.gpu, job=self._job, event=event, chunk=chunk,
                          travels=travels, epoch_before=epoch_before, epoch_after=epoch_after, chunk_mac=mac,
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
