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
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.errors import BadInput
from gputravel.orchestrator.audit.entries import (
    GENESIS_HASH,
    LENGTH,
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
                 prev_hash: bytes) -> None:
        self.path = path
        self.gpu = gpu
        self._key = key
        self._fd = fd
        self._next_seq = next_seq
        self._prev = prev_hash
        self._lock = threading.Lock()
        self._broken = False
        self._sealed = False  # the closing entry is signed: nothing may follow

    def __repr__(self) -> str:  # the signing key never shows
        return f"AuditLog({os.fspath(self.path)!r}, gpu={self.gpu!r}, next_seq={self._next_seq})"

    @classmethod
    def create(cls, path: str | os.PathLike[str], signing_key: bytes | ec.EllipticCurvePrivateKey, *,
               gpu: str) -> AuditLog:
        """Start a new, empty log of ``gpu`` (its attested serial); refuses to overwrite a file."""
        key, p, gpu = load_signer(signing_key), Path(path), check_gpu(gpu)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            raise BadInput(f"audit log {os.fspath(p)!r} already exists (use AuditLog.open)") from None
        _fsync_dir(p)
        return cls(p, key, gpu, fd, 0, GENESIS_HASH)

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
        return cls(p, key, gpu, fd, summary.head_seq + 1, summary.head_hash)

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
        mac = self._mac(chunk, chunk_digest, holder_key)
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
    def _mac(chunk: ChunkId, chunk_digest: bytes, holder_key: bytes | None) -> bytes:
        if not isinstance(chunk_digest, (bytes, bytearray, memoryview)):
            raise BadInput("chunk_digest must be bytes")  # bytes(n) would make n zero bytes
        if not chunk_digest:
            return b""
        if type(chunk) is not ChunkId:
            raise BadInput("chunk must be a ChunkId")
        if holder_key is None:
            raise BadInput("a chunk digest is logged only keyed with its holder's travel-log key")
        return chunk_mac(holder_key, chunk.holder, chunk.dataset_offset, chunk.nbytes, bytes(chunk_digest))

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
        self._next_seq, self._prev = entry.seq + 1, digest
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
        try:
            entry = Entry(seq=self._next_seq, time=float(time), gpu=self.gpu, event=event, chunk=chunk,
                          epoch_before=epoch_before, epoch_after=epoch_after, chunk_mac=mac,
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
