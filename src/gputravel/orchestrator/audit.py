"""The travel log: an append-only, hash-chained record of every travel, signed by the orchestrator.

Each :class:`Entry` says who got the GPU (the chunk id names the holder), what happened
(``travel``, ``refused``, ``aborted``), the key epoch before and after, and the digest of the
chunk that was copied. It is encoded with the project's codec; its hash is SHA-384 over that
encoding, and every entry carries the hash of the one before it (48 zero bytes for seq 0).
The orchestrator signs every entry's ``(seq, hash)`` with its ECDSA P-384 key, so any prefix
of the log is a signed head a holder can check on its own.

File format: one record per entry, appended in order::

    +---------------------------+------------------------------------------------+
    | length: u32 big-endian    | msgpack record {entry: bytes, signature: bytes} |
    +---------------------------+------------------------------------------------+

``entry`` holds the encoded entry (the bytes that are hashed); ``signature`` is raw ``r || s``
(48 bytes each, low-s). Each record is written with one ``write`` and ``fsync``-ed, so a
crash loses at most the entry being written, and its torn remains read as "truncated final
entry" rather than as tampering: a torn record is a strict prefix of a record, which a record
whose length prefix was altered is not. Note the limit of any such log: dropping whole entries
off the end leaves a valid shorter log. A holder that kept a signed head detects that with
``known_head``.

Pure functions take the time as an argument; nothing here reads the clock.
"""

from __future__ import annotations

import enum
import hashlib
import math
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)

from gputravel.errors import BadInput, ProtocolError
from gputravel.protocol.codec import decode, encode, message

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
    "read_log",
    "verify_log",
]

HASH_BYTES = 48  # SHA-384
GENESIS_HASH = bytes(HASH_BYTES)  # the prev_hash of seq 0
MAX_DIGEST_BYTES = 64
MAX_RECORD_BYTES = 16 * 1024  # an entry is a few hundred bytes: anything longer is corruption
_LENGTH = struct.Struct(">I")
_SCALAR_BYTES = 48
_SIGNATURE_BYTES = 2 * _SCALAR_BYTES
# Domain separation: a signature over an audit head can never pass for any other statement
# made with the orchestrator's key (and vice versa).
_SIGNED_PREFIX = b"gputravel/audit/v1/head\x00"
_SEQ = struct.Struct(">Q")
# Order of the P-384 group (SEC 2, FIPS 186-4). Signatures are normalised to s <= n/2 so each
# entry has exactly one valid signature encoding: no byte of the file can change unnoticed.
_P384_ORDER = int("ffffffffffffffffffffffffffffffffffffffffffffffffc7634d81f4372ddf"
                  "581a0db248b0a77aecec196accc52973", 16)


class AuditEvent(enum.StrEnum):
    TRAVEL = "travel"  # the chunk was copied and verified
    REFUSED = "refused"  # the holder could not copy, returned the context
    ABORTED = "aborted"  # the travel failed; the orchestrator took the GPU back and rotated


class Failure(enum.StrEnum):
    """How a log failed to verify (the text reads after "audit log: ... at seq N")."""

    TRUNCATED = "truncated final entry"
    MALFORMED = "malformed entry"
    SEQUENCE = "seq gap"
    CHAIN = "hash chain broken"
    SIGNATURE = "bad signature"
    HEAD = "known head missing"


class AuditError(ProtocolError):
    """The log does not verify; ``failure`` says how and ``seq`` where (the record's position)."""

    def __init__(self, failure: Failure, seq: int, detail: str) -> None:
        super().__init__(f"audit log: {failure} at seq {seq}: {detail}")
        self.failure = failure
        self.seq = seq


# ----------------------------------------------------------------------------- entries
@message("audit.chunk")
@dataclass(frozen=True)
class ChunkId:
    holder: str
    dataset_offset: int
    nbytes: int

    def __post_init__(self) -> None:
        if not self.holder:
            raise BadInput("a chunk id needs the holder's name")
        if self.dataset_offset < 0 or self.nbytes < 0:
            raise BadInput("chunk offset and size must be non-negative")


@message("audit.entry")
@dataclass(frozen=True)
class Entry:
    seq: int
    time: float  # seconds since the epoch, as the caller's clock said
    event: AuditEvent
    chunk: ChunkId
    epoch_before: int
    epoch_after: int
    chunk_digest: bytes  # empty when nothing was copied
    prev_hash: bytes

    def __post_init__(self) -> None:
        if self.seq < 0:
            raise BadInput("seq must be non-negative")
        if not math.isfinite(self.time) or self.time < 0:
            raise BadInput("time must be a finite, non-negative number of seconds")
        if self.epoch_before < 0 or self.epoch_after < 0:
            raise BadInput("key epochs must be non-negative")
        if len(self.chunk_digest) > MAX_DIGEST_BYTES:
            raise BadInput(f"a chunk digest is at most {MAX_DIGEST_BYTES} bytes")
        if len(self.prev_hash) != HASH_BYTES:
            raise BadInput(f"prev_hash must be {HASH_BYTES} bytes")

    @property
    def holder(self) -> str:
        return self.chunk.holder


@message("audit.record")
@dataclass(frozen=True)
class _Record:
    entry: bytes  # the encoded Entry: exactly the bytes that are hashed
    signature: bytes


def entry_hash(entry: Entry) -> bytes:
    """SHA-384 over the entry's encoding (what the next entry's prev_hash must be)."""
    return hashlib.sha384(encode(entry)).digest()


@dataclass(frozen=True)
class _Parsed:
    entry: Entry
    hash: bytes
    signature: bytes
    end: int  # file offset just past this record


# ----------------------------------------------------------------------------- signatures
def _signed_message(seq: int, digest: bytes) -> bytes:
    return _SIGNED_PREFIX + _SEQ.pack(seq) + digest


def _sign(key: ec.EllipticCurvePrivateKey, seq: int, digest: bytes) -> bytes:
    r, s = decode_dss_signature(key.sign(_signed_message(seq, digest), ec.ECDSA(hashes.SHA384())))
    s = min(s, _P384_ORDER - s)  # (r, n - s) verifies too: keep the low one only
    return r.to_bytes(_SCALAR_BYTES, "big") + s.to_bytes(_SCALAR_BYTES, "big")


def _verify(key: ec.EllipticCurvePublicKey, seq: int, digest: bytes, signature: bytes) -> None:
    if len(signature) != _SIGNATURE_BYTES:
        raise AuditError(Failure.SIGNATURE, seq, f"a signature is {_SIGNATURE_BYTES} bytes")
    r = int.from_bytes(signature[:_SCALAR_BYTES], "big")
    s = int.from_bytes(signature[_SCALAR_BYTES:], "big")
    if not (0 < r < _P384_ORDER and 0 < s <= _P384_ORDER // 2):
        raise AuditError(Failure.SIGNATURE, seq, "signature is not in canonical (low-s) form")
    try:
        key.verify(encode_dss_signature(r, s), _signed_message(seq, digest), ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        raise AuditError(Failure.SIGNATURE, seq,
                         "the entry was altered or not signed by this orchestrator key") from None


def _is_p384(key: object) -> bool:
    return isinstance(key, (ec.EllipticCurvePublicKey, ec.EllipticCurvePrivateKey)) and \
        isinstance(key.curve, ec.SECP384R1)


def load_verifier(key: bytes | str | ec.EllipticCurvePublicKey | x509.Certificate) -> ec.EllipticCurvePublicKey:
    """The orchestrator's P-384 public key from a certificate or public-key PEM (or object)."""
    if isinstance(key, x509.Certificate):
        key = key.public_key()  # type: ignore[assignment]
    elif isinstance(key, (bytes, str)):
        pem = key.encode("ascii", "replace") if isinstance(key, str) else key
        try:
            if b"-----BEGIN CERTIFICATE-----" in pem:
                key = x509.load_pem_x509_certificate(pem).public_key()  # type: ignore[assignment]
            else:
                key = serialization.load_pem_public_key(pem)  # type: ignore[assignment]
        except ValueError:
            raise BadInput("the orchestrator key is neither a certificate nor a public-key PEM") from None
    if not (isinstance(key, ec.EllipticCurvePublicKey) and _is_p384(key)):
        raise BadInput("the orchestrator key must be an ECDSA P-384 public key")
    return key


def _load_signer(key: bytes | ec.EllipticCurvePrivateKey) -> ec.EllipticCurvePrivateKey:
    if isinstance(key, bytes):
        try:
            key = serialization.load_pem_private_key(key, password=None)  # type: ignore[assignment]
        except (ValueError, TypeError):
            raise BadInput("the signing key is not an unencrypted private-key PEM") from None
    if not (isinstance(key, ec.EllipticCurvePrivateKey) and _is_p384(key)):
        raise BadInput("the signing key must be an ECDSA P-384 private key")
    return key


# ----------------------------------------------------------------------------- reading
def _records(data: bytes, allow_truncated_tail: bool) -> Iterator[_Parsed]:
    """Parse records in file order; ``seq`` in errors is the record's position."""
    pos, index = 0, 0
    while pos < len(data):
        rest = len(data) - pos
        if rest < _LENGTH.size or (data.startswith(bytes(_LENGTH.size), pos) and data.count(0, pos) == rest):
            # A crash mid-write leaves a prefix of the record or, on some file systems, the
            # file extended with zeros that were never written: both are a torn final entry.
            if allow_truncated_tail:
                return
            raise AuditError(Failure.TRUNCATED, index, "the final record is cut short or zero-filled")
        (length,) = _LENGTH.unpack_from(data, pos)
        if not 0 < length <= MAX_RECORD_BYTES:
            raise AuditError(Failure.MALFORMED, index, f"record length {length} is impossible")
        start, end = pos + _LENGTH.size, pos + _LENGTH.size + length
        if end > len(data):
            if not _is_torn(data[start:]):
                raise AuditError(Failure.MALFORMED, index, "the record length disagrees with its content")
            if allow_truncated_tail:
                return
            raise AuditError(Failure.TRUNCATED, index,
                             f"{end - len(data)} of its {length} bytes are missing (crash mid-write?)")
        yield _parse(data[start:end], index, end)
        pos, index = end, index + 1


def _is_torn(fragment: bytes) -> bool:
    """Whether ``fragment`` is a strict prefix of one msgpack record: what a crash mid-write
    leaves. A complete record (so its length prefix was made longer) or invalid bytes are not."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_RECORD_BYTES)
    unpacker.feed(fragment)  # shorter than the declared length, itself <= MAX_RECORD_BYTES
    try:
        unpacker.unpack()
    except msgpack.OutOfData:
        return True
    except Exception:  # malformed, whatever msgpack chose to raise: corruption, not a crash
        return False
    return False


def _parse(payload: bytes, index: int, end: int) -> _Parsed:
    try:
        record = decode(payload, expect=_Record)
        entry = decode(record.entry, expect=Entry)
    except ProtocolError as exc:
        raise AuditError(Failure.MALFORMED, index, str(exc)) from None
    # Hashes are taken over the stored bytes; a decodable but different encoding of the same
    # entry is refused, so the stored bytes and entry_hash() can never disagree.
    if encode(entry) != record.entry:
        raise AuditError(Failure.MALFORMED, index, "the entry is not in canonical encoding")
    return _Parsed(entry, hashlib.sha384(record.entry).digest(), record.signature, end)


def _read(path: str | os.PathLike[str]) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise BadInput(f"audit log {os.fspath(path)!r} does not exist") from None
    except IsADirectoryError:
        raise BadInput(f"audit log {os.fspath(path)!r} is a directory") from None


def read_log(path: str | os.PathLike[str], *, allow_truncated_tail: bool = False) -> list[Entry]:
    """Every entry of the log, parsed but NOT verified (see :func:`verify_log`)."""
    return [p.entry for p in _records(_read(path), allow_truncated_tail)]


# ----------------------------------------------------------------------------- verifying
@dataclass(frozen=True)
class AuditSummary:
    count: int  # entries that verified
    head_seq: int  # -1 for an empty log
    head_hash: bytes  # GENESIS_HASH for an empty log
    head_signature: bytes  # the orchestrator's signature of the head: keep it as a receipt
    holder: str | None
    entries: tuple[Entry, ...]  # the holder's own entries (every entry when holder is None)
    truncated_tail: bool  # a torn final record was ignored (allow_truncated_tail)


def _verify_chain(parsed: list[_Parsed], key: ec.EllipticCurvePublicKey) -> None:
    prev = GENESIS_HASH
    for index, p in enumerate(parsed):
        if p.entry.seq != index:
            raise AuditError(Failure.SEQUENCE, index, f"found seq {p.entry.seq} (entries reordered or deleted)")
        if p.entry.prev_hash != prev:
            raise AuditError(Failure.CHAIN, index, "prev_hash is not the hash of the entry before")
        _verify(key, index, p.hash, p.signature)
        prev = p.hash


def _check_known_head(parsed: list[_Parsed], known_head: tuple[int, bytes]) -> None:
    seq, digest = known_head
    if seq >= len(parsed):
        raise AuditError(Failure.HEAD, seq, f"the log ends at seq {len(parsed) - 1} (entries dropped?)")
    if parsed[seq].hash != digest:
        raise AuditError(Failure.HEAD, seq, "the entry there is not the one the known head names")


def verify_log(path: str | os.PathLike[str],
               orchestrator_key: bytes | str | ec.EllipticCurvePublicKey | x509.Certificate,
               holder: str | None = None, *, allow_truncated_tail: bool = False,
               known_head: tuple[int, bytes] | None = None) -> AuditSummary:
    """Check seq contiguity, the hash chain and every signature; raise AuditError on the first fault.

    ``allow_truncated_tail`` verifies the intact prefix of a log whose last record is torn.
    ``known_head`` is a (seq, hash) the caller saw signed before: the log must still hold it.
    """
    key = load_verifier(orchestrator_key)
    data = _read(path)
    parsed = list(_records(data, allow_truncated_tail))
    _verify_chain(parsed, key)
    if known_head is not None:
        _check_known_head(parsed, known_head)
    last = parsed[-1] if parsed else None
    return AuditSummary(
        count=len(parsed),
        head_seq=len(parsed) - 1,
        head_hash=last.hash if last else GENESIS_HASH,
        head_signature=last.signature if last else b"",
        holder=holder,
        entries=tuple(p.entry for p in parsed if holder is None or p.entry.holder == holder),
        truncated_tail=(last.end if last else 0) != len(data),
    )


# ----------------------------------------------------------------------------- writing
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
    """The orchestrator's writer. One writer per file; ``append`` is thread-safe."""

    def __init__(self, path: Path, key: ec.EllipticCurvePrivateKey, fd: int, next_seq: int,
                 prev_hash: bytes) -> None:
        self.path = path
        self._key = key
        self._fd = fd
        self._next_seq = next_seq
        self._prev = prev_hash
        self._lock = threading.Lock()
        self._broken = False

    def __repr__(self) -> str:  # the signing key never shows
        return f"AuditLog({os.fspath(self.path)!r}, next_seq={self._next_seq})"

    @classmethod
    def create(cls, path: str | os.PathLike[str],
               signing_key: bytes | ec.EllipticCurvePrivateKey) -> AuditLog:
        """Start a new, empty log; refuses to overwrite an existing file."""
        key, p = _load_signer(signing_key), Path(path)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            raise BadInput(f"audit log {os.fspath(p)!r} already exists (use AuditLog.open)") from None
        _fsync_dir(p)
        return cls(p, key, fd, 0, GENESIS_HASH)

    @classmethod
    def open(cls, path: str | os.PathLike[str], signing_key: bytes | ec.EllipticCurvePrivateKey, *,
             repair_truncated_tail: bool = False) -> AuditLog:
        """Continue an existing log after verifying it with the signer's own public key.

        A torn final record (crash mid-write) is refused unless ``repair_truncated_tail``,
        which cuts it off so that new entries follow the last intact one.
        """
        key, p = _load_signer(signing_key), Path(path)
        summary = verify_log(p, key.public_key(), allow_truncated_tail=repair_truncated_tail)
        fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        if summary.truncated_tail:
            os.ftruncate(fd, _intact_length(p))
            os.fsync(fd)
        return cls(p, key, fd, summary.head_seq + 1, summary.head_hash)

    @property
    def head(self) -> tuple[int, bytes]:
        """(seq, hash) of the last entry; (-1, GENESIS_HASH) when empty."""
        with self._lock:
            return self._next_seq - 1, self._prev

    def append(self, event: AuditEvent | str, chunk: ChunkId, *, time: float, epoch_before: int,
               epoch_after: int, chunk_digest: bytes = b"") -> Entry:
        """Sign and durably append one entry (written and fsync-ed before this returns)."""
        with self._lock:
            if self._fd < 0:
                raise BadInput("the audit log is closed")
            if self._broken:
                raise BadInput("a write to the audit log failed: reopen it with repair_truncated_tail=True")
            entry = self._next_entry(event, chunk, time, epoch_before, epoch_after, chunk_digest)
            raw = encode(entry)
            digest = hashlib.sha384(raw).digest()
            payload = encode(_Record(entry=raw, signature=_sign(self._key, entry.seq, digest)))
            try:
                _write_all(self._fd, _LENGTH.pack(len(payload)) + payload)
                os.fsync(self._fd)
            except OSError:
                self._broken = True  # a partial record may be on disk: no entry may follow it
                raise
            self._next_seq, self._prev = entry.seq + 1, digest
            return entry

    def _next_entry(self, event: AuditEvent | str, chunk: ChunkId, time: float, epoch_before: int,
                    epoch_after: int, chunk_digest: bytes) -> Entry:
        try:
            event = AuditEvent(event)
        except ValueError:
            raise BadInput(f"unknown audit event {event!r}") from None
        if type(chunk) is not ChunkId:
            raise BadInput("chunk must be a ChunkId")
        if not isinstance(time, (int, float)) or isinstance(time, bool):
            raise BadInput("time must be a number of seconds")
        if not isinstance(chunk_digest, (bytes, bytearray, memoryview)):
            raise BadInput("chunk_digest must be bytes")  # bytes(n) would make n zero bytes
        try:
            entry = Entry(self._next_seq, float(time), event, chunk, epoch_before, epoch_after,
                          bytes(chunk_digest), self._prev)
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


def _intact_length(path: Path) -> int:
    """Length of the log's prefix made of complete records."""
    return max((p.end for p in _records(path.read_bytes(), allow_truncated_tail=True)), default=0)
