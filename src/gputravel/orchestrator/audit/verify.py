"""Reading the travel log and verifying it: seq contiguity, the hash chain, every signature.

A crash mid-write leaves a torn final record, which reads as "truncated final entry" rather
than as tampering: a torn record is a strict prefix of a record, which a record whose length
prefix was altered is not. Dropping whole entries off the end leaves a valid shorter log; a
holder that kept a signed head detects that with ``known_head``.

A log names one GPU: each rank's orchestrator keeps its own log and pins its GPU across
re-keys (orchestrator/attester.py), so entries naming two GPUs are never honest, and the
verifier refuses them rather than summarising per GPU. A verifier that knows which GPU it
expects (a holder saw its serial when it attested the GPU) passes ``gpu``: a log of another
GPU, renamed or swapped in with that GPU's key, is refused too.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.errors import BadInput, ProtocolError
from gputravel.orchestrator.audit.entries import (
    GENESIS_HASH,
    LENGTH,
    MAX_RECORD_BYTES,
    AuditError,
    Entry,
    Failure,
    Record,
    check_gpu,
)
from gputravel.orchestrator.audit.signature import load_verifier, verify_head
from gputravel.protocol.codec import TAG_FIELD, decode, encode, tag_of


@dataclass(frozen=True)
class _Parsed:
    entry: Entry
    hash: bytes
    signature: bytes
    end: int  # file offset just past this record


# ----------------------------------------------------------------------------- reading
def _records(data: bytes, allow_truncated_tail: bool) -> Iterator[_Parsed]:
    """Parse records in file order; ``seq`` in errors is the record's position."""
    pos, index = 0, 0
    while pos < len(data):
        rest = len(data) - pos
        if rest < LENGTH.size or (data.startswith(bytes(LENGTH.size), pos) and data.count(0, pos) == rest):
            # A crash mid-write leaves a prefix of the record or, on some file systems, the
            # file extended with zeros that were never written: both are a torn final entry.
            if allow_truncated_tail:
                return
            raise AuditError(Failure.TRUNCATED, index, "the final record is cut short or zero-filled")
        (length,) = LENGTH.unpack_from(data, pos)
        if not 0 < length <= MAX_RECORD_BYTES:
            raise AuditError(Failure.MALFORMED, index, f"record length {length} is impossible")
        start, end = pos + LENGTH.size, pos + LENGTH.size + length
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
        record = decode(payload, expect=Record)
    except ProtocolError as exc:
        raise AuditError(Failure.MALFORMED, index, str(exc)) from None
    try:
        entry = decode(record.entry, expect=Entry)
    except ProtocolError as exc:
        if index == 0 and _names_no_gpu(record.entry):  # an earlier log names no GPU from its start
            raise AuditError(Failure.VERSION, index, "the entry names no GPU: an earlier gputravel wrote this "
                                                     "log; verify it with that version, and start a new log") from None
        raise AuditError(Failure.MALFORMED, index, str(exc)) from None
    # Hashes are taken over the stored bytes; a decodable but different encoding of the same
    # entry is refused, so the stored bytes and entry_hash() can never disagree.
    if encode(entry) != record.entry:
        raise AuditError(Failure.MALFORMED, index, "the entry is not in canonical encoding")
    return _Parsed(entry, hashlib.sha384(record.entry).digest(), record.signature, end)


# The keys of an entry before entries named their GPU (issue 14).
_GPULESS_KEYS = frozenset({TAG_FIELD, *Entry.__struct_fields__} - {"gpu"})


def _names_no_gpu(raw: bytes) -> bool:
    """Whether ``raw`` has exactly the keys of an entry written before entries named their GPU,
    so that such a log is refused as from an earlier version, not as corrupt. Only a hint for
    the error: nothing decoded here is trusted."""
    try:
        fields = msgpack.unpackb(raw, raw=False, max_bin_len=MAX_RECORD_BYTES, max_str_len=MAX_RECORD_BYTES)
    except Exception:  # malformed, whatever msgpack chose to raise
        return False
    return isinstance(fields, dict) and fields.keys() == _GPULESS_KEYS and fields[TAG_FIELD] == tag_of(Entry)


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


def intact_length(path: Path) -> int:
    """Length of the log's prefix made of complete records (where a writer may continue)."""
    return max((p.end for p in _records(path.read_bytes(), allow_truncated_tail=True)), default=0)


# ----------------------------------------------------------------------------- verifying
@dataclass(frozen=True)
class AuditSummary:
    count: int  # entries that verified
    head_seq: int  # -1 for an empty log
    head_hash: bytes  # GENESIS_HASH for an empty log
    head_signature: bytes  # the orchestrator's signature of the head: keep it as a receipt
    holder: str | None
    gpu: str | None  # the GPU every entry names; None for an empty log
    entries: tuple[Entry, ...]  # the holder's own entries (every entry when holder is None)
    truncated_tail: bool  # a torn final record was ignored (allow_truncated_tail)


def _verify_chain(parsed: list[_Parsed], key: ec.EllipticCurvePublicKey) -> None:
    prev = GENESIS_HASH
    for index, p in enumerate(parsed):
        if p.entry.seq != index:
            raise AuditError(Failure.SEQUENCE, index, f"found seq {p.entry.seq} (entries reordered or deleted)")
        if p.entry.prev_hash != prev:
            raise AuditError(Failure.CHAIN, index, "prev_hash is not the hash of the entry before")
        verify_head(key, index, p.hash, p.signature)
        prev = p.hash


def _signed_if_earlier_version(err: AuditError, key: ec.EllipticCurvePublicKey, data: bytes) -> None:
    """An "earlier version" verdict only for a log of that version throughout whose first entry
    this key signed: anyone who can write the file could otherwise turn a tamper verdict into
    that milder one (and its advice to start a new log) by putting an unsigned GPU-less entry
    first (SIGNATURE), or an old signed one before entries of this version (MALFORMED)."""
    if err.failure is not Failure.VERSION:
        return
    records = list(_raw_records(data))  # the first is the one _parse refused: it decodes as a Record
    verify_head(key, 0, hashlib.sha384(records[0].entry).digest(), records[0].signature)
    if not all(_names_no_gpu(r.entry) for r in records):
        raise AuditError(Failure.MALFORMED, err.seq, "an entry of an earlier log format before entries of "
                                                     "this one: not one log") from None


def _raw_records(data: bytes) -> Iterator[Record]:
    """Each whole record, its entry undecoded, until the first that does not parse."""
    pos = 0
    while pos + LENGTH.size <= len(data):
        (length,) = LENGTH.unpack_from(data, pos)
        payload = data[pos + LENGTH.size : pos + LENGTH.size + length]
        if not 0 < length <= MAX_RECORD_BYTES or len(payload) != length:
            return
        try:
            yield decode(payload, expect=Record)
        except ProtocolError:
            return
        pos += LENGTH.size + length


def _check_known_head(parsed: list[_Parsed], known_head: tuple[int, bytes]) -> None:
    seq, digest = known_head
    if seq >= len(parsed):
        raise AuditError(Failure.HEAD, seq, f"the log ends at seq {len(parsed) - 1} (entries dropped?)")
    if parsed[seq].hash != digest:
        raise AuditError(Failure.HEAD, seq, "the entry there is not the one the known head names")


def _check_gpu(parsed: list[_Parsed], expected: str | None) -> str | None:
    """The one GPU the log names (the expected one if given); AuditError (GPU) at the first
    entry naming another. Checked after the chain: a changed ``gpu`` is a bad signature."""
    named = expected if expected is not None else (parsed[0].entry.gpu if parsed else None)
    for index, p in enumerate(parsed):
        if p.entry.gpu != named:
            whose = "the verifier expects" if expected is not None else "the log's first entry names"
            raise AuditError(Failure.GPU, index, f"it names {p.entry.gpu!r}, {whose} {named!r} "
                                                 "(a rank's log names only its own GPU)")
    return named if parsed else None


def verify_log(path: str | os.PathLike[str],
               orchestrator_key: bytes | str | ec.EllipticCurvePublicKey | x509.Certificate,
               holder: str | None = None, *, gpu: str | None = None, allow_truncated_tail: bool = False,
               known_head: tuple[int, bytes] | None = None) -> AuditSummary:
    """Check seq contiguity, the hash chain, every signature, and that every entry names the
    same GPU (``gpu``, if given); raise AuditError on the first fault.

    ``allow_truncated_tail`` verifies the intact prefix of a log whose last record is torn.
    ``known_head`` is a (seq, hash) the caller saw signed before: the log must still hold it.
    """
    key = load_verifier(orchestrator_key)
    expected = check_gpu(gpu) if gpu is not None else None
    data = _read(path)
    try:
        parsed = list(_records(data, allow_truncated_tail))
    except AuditError as err:
        _signed_if_earlier_version(err, key, data)
        raise
    _verify_chain(parsed, key)
    named = _check_gpu(parsed, expected)
    if known_head is not None:
        _check_known_head(parsed, known_head)
    last = parsed[-1] if parsed else None
    return AuditSummary(
        count=len(parsed),
        head_seq=len(parsed) - 1,
        head_hash=last.hash if last else GENESIS_HASH,
        head_signature=last.signature if last else b"",
        holder=holder,
        gpu=named,
        entries=tuple(p.entry for p in parsed if holder is None or p.entry.holder == holder),
        truncated_tail=(last.end if last else 0) != len(data),
    )
