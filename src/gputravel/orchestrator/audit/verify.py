"""Reading the travel log and verifying it. A torn final record reads as truncated, not tampered;
entries dropped off the end leave a valid chain, so a verdict says whether the log is closed, and a
party that kept a head detects a cut with ``known_head``."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import msgpack
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.errors import BadInput, GputravelError, ProtocolError
from gputravel.orchestrator.audit.entries import (
    GENESIS_HASH,
    HASH_BYTES,
    JOB_BYTES,
    LENGTH,
    MAX_RECORD_BYTES,
    NOTES,
    TRAVEL_ATTEMPTS,
    AuditError,
    AuditEvent,
    Entry,
    Failure,
    Record,
    check_gpu,
)
from gputravel.orchestrator.audit.signature import load_verifier, verify_head
from gputravel.protocol.manifest import chunk_mac
from gputravel.protocol.codec import TAG_FIELD, decode, encode, tag_of

T = TypeVar("T")


@dataclass(frozen=True)
class _Parsed:
    entry: Entry
    hash: bytes
    signature: bytes
    end: int  # file offset just past this record


# ----------------------------------------------------------------------------- reading
def _records(data: bytes, allow_truncated_tail: bool) -> Iterator[_Parsed]:
    """Parse records in file order (``seq`` in errors is the record's position)."""
    return (_parse(payload, index, end) for payload, index, end in _frames(data, allow_truncated_tail))


def _frames(data: bytes, allow_truncated_tail: bool) -> Iterator[tuple[bytes, int, int]]:
    """Each record's payload, position and end, in file order; a torn tail is said or passed over."""
    pos, index = 0, 0
    while pos < len(data):
        rest = len(data) - pos
        if rest < LENGTH.size or (data.startswith(bytes(LENGTH.size), pos) and data.count(0, pos) == rest):
            # A crash mid-write leaves a prefix of the record, or zeros never written: both torn.
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
        yield data[start:end], index, end
        pos, index = end, index + 1


def _is_torn(fragment: bytes) -> bool:
    """Whether ``fragment`` is a strict prefix of a msgpack record (a crash), not a whole one or junk."""
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
        earlier = _earlier_format(record.entry) if index == 0 else None  # an earlier log is so from its start
        if earlier is not None:
            raise AuditError(Failure.VERSION, index, f"{earlier}: an earlier gputravel wrote this log; verify it "
                                                     "with that version, and start a new log") from None
        raise AuditError(Failure.MALFORMED, index, str(exc)) from None
    # Another decodable encoding of the entry is refused: the stored bytes and entry_hash() agree.
    if encode(entry) != record.entry:
        raise AuditError(Failure.MALFORMED, index, "the entry is not in canonical encoding")
    return _Parsed(entry, hashlib.sha384(record.entry).digest(), record.signature, end)


_UNKEYED_KEYS = frozenset({TAG_FIELD, "seq", "time", "gpu", "event", "chunk", "epoch_before", "epoch_after",
                           "chunk_digest", "prev_hash"})
_JOBLESS_KEYS = _UNKEYED_KEYS - {"chunk_digest"} | {"chunk_mac"}
_NOTELESS_KEYS = _JOBLESS_KEYS | {"job", "travels"}
_EARLIER_FORMATS = {
    _UNKEYED_KEYS - {"gpu"}: "the entry names no GPU",
    _UNKEYED_KEYS: "the entry logs its chunk's bare digest, not keyed with its holder's key",
    _JOBLESS_KEYS: "the entry names no job and counts no travels",
    _NOTELESS_KEYS: "the entry has no note (from before logs recorded approvals and the release)",
}


def _earlier_format(raw: bytes) -> str | None:
    """What marks ``raw`` as an earlier format's entry, or None: a hint for the error, never trusted."""
    try:
        fields = msgpack.unpackb(raw, raw=False, max_bin_len=MAX_RECORD_BYTES, max_str_len=MAX_RECORD_BYTES)
    except Exception:  # malformed, whatever msgpack chose to raise
        return None
    if not isinstance(fields, dict) or fields.get(TAG_FIELD) != tag_of(Entry):
        return None
    return _EARLIER_FORMATS.get(frozenset(fields.keys()))


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
    count: int  # entries that verified (the closing entry included)
    head_seq: int  # -1 for an empty log
    head_hash: bytes  # GENESIS_HASH for an empty log
    head_signature: bytes  # the orchestrator's signature of the head: keep it as a receipt
    holder: str | None
    gpu: str | None  # the GPU every entry names; None for an empty log
    job: bytes | None  # the job every entry names; None for an empty log
    continues: bytes | None  # seq 0's prev_hash if it continues an earlier log of its job, else None
    travels: int  # the job's travel attempts counted up to the log's last entry (0 when empty)
    entries: tuple[Entry, ...]  # the travel attempts: the holder's (all if holder is None), not the close
    truncated_tail: bool  # a torn final record was ignored (allow_truncated_tail)
    closed: bool  # ends with the closing entry; False: still running, or cut short (empty too)
    # The approvals and release signatures (the holder's, if holder is given) and the releases.
    notes: tuple[Entry, ...] = ()


def _verify_chain(parsed: list[_Parsed], key: ec.EllipticCurvePublicKey) -> None:
    # Seq 0 follows the zero hash or an earlier log's entry: its signature covers which.
    prev = parsed[0].entry.prev_hash if parsed else GENESIS_HASH
    for index, p in enumerate(parsed):
        if p.entry.seq != index:
            raise AuditError(Failure.SEQUENCE, index, f"found seq {p.entry.seq} (entries reordered or deleted)")
        if p.entry.prev_hash != prev:
            raise AuditError(Failure.CHAIN, index, "prev_hash is not the hash of the entry before")
        verify_head(key, index, p.hash, p.signature)
        prev = p.hash


def _signed_if_earlier_version(err: AuditError, key: ec.EllipticCurvePublicKey, data: bytes) -> None:
    """An "earlier version" verdict only for a log of that version throughout, its first entry
    signed by this key: else a writer of the file could turn a tamper verdict into that milder one."""
    if err.failure is not Failure.VERSION:
        return
    records: list[Record] = []  # each whole record, its entry undecoded, until the first that does not parse
    with contextlib.suppress(AuditError, ProtocolError):
        for payload, _, _ in _frames(data, allow_truncated_tail=True):
            records.append(decode(payload, expect=Record))  # the first is the one _parse refused: it decodes
    verify_head(key, 0, hashlib.sha384(records[0].entry).digest(), records[0].signature)
    first = _earlier_format(records[0].entry)
    if not all(_earlier_format(r.entry) == first for r in records):
        raise AuditError(Failure.MALFORMED, err.seq, "an entry of an earlier log format before entries of "
                                                     "another one: not one log") from None


def _check_known_head(parsed: list[_Parsed], known_head: tuple[int, bytes] | bytes) -> None:
    """The log must hold the head a party saw: ``(seq, hash)``, or only its hash (anywhere)."""
    if isinstance(known_head, (bytes, bytearray)):
        if len(known_head) != HASH_BYTES:
            raise BadInput(f"a head is the {HASH_BYTES}-byte hash of an entry")
        if not any(p.hash == known_head for p in parsed):
            raise AuditError(Failure.HEAD, len(parsed), f"no entry of the log (seq 0 to {len(parsed) - 1}) has "
                                                        "this hash: entries were cut off its end, or it is another log")
        return
    seq, digest = known_head
    if seq >= len(parsed):
        raise AuditError(Failure.HEAD, seq, f"the log ends at seq {len(parsed) - 1} (entries dropped?)")
    if parsed[seq].hash != digest:
        raise AuditError(Failure.HEAD, seq, "the entry there is not the one the known head names")


def _check_closing(parsed: list[_Parsed], trailing: bool) -> bool:
    """Whether the log is closed; AuditError (AFTER_CLOSE) if anything follows a closing entry."""
    for index, p in enumerate(parsed):
        if p.entry.event is AuditEvent.CLOSED and index != len(parsed) - 1:
            raise AuditError(Failure.AFTER_CLOSE, index + 1, f"the log was closed at seq {index}")
    closed = bool(parsed) and parsed[-1].entry.event is AuditEvent.CLOSED
    if closed and trailing:
        raise AuditError(Failure.AFTER_CLOSE, len(parsed), f"bytes follow the closing entry at seq {len(parsed) - 1}")
    return closed


def _check_one(parsed: list[_Parsed], failure: Failure, expected: T | None, named_in: Callable[[Entry], T],
               show: Callable[[T | None], str]) -> T | None:
    """The one GPU or job every entry names (the expected one if given); AuditError at another."""
    named = expected if expected is not None else (named_in(parsed[0].entry) if parsed else None)
    whose = "the verifier expects" if expected is not None else "the log's first entry names"
    for index, p in enumerate(parsed):
        if named_in(p.entry) != named:
            raise AuditError(failure, index, f"it names {show(named_in(p.entry))}, {whose} {show(named)} "
                                             "(a log names only one)")
    return named if parsed else None


def _check_count(parsed: list[_Parsed]) -> int:
    """The job's travels up to the last entry; AuditError (COUNT) where a count is not one more
    than the entry before's (the close's: equal), or seq 0's disagrees with what it follows."""
    if not parsed:
        return 0
    first = parsed[0].entry
    before = first.travels - (first.event in TRAVEL_ATTEMPTS)  # counted before seq 0
    if (first.prev_hash == GENESIS_HASH) != (before == 0):
        why = ("it starts its job, so it counts from travel 1" if first.prev_hash == GENESIS_HASH
               else "it continues an earlier log, after at least one travel")
        raise AuditError(Failure.COUNT, 0, f"seq 0 counts {before} travels before it: {why}")
    count = before
    for index, p in enumerate(parsed):
        count += p.entry.event in TRAVEL_ATTEMPTS
        if p.entry.travels != count:
            raise AuditError(Failure.COUNT, index, f"it counts {p.entry.travels} travels of its job, "
                                                   f"the entries before it {count}")
    return count


def _check_releases(parsed: list[_Parsed]) -> None:
    """AuditError (RELEASE) at a release whose signers did not each sign its statement before it."""
    signed: set[tuple[str, bytes]] = set()
    for index, p in enumerate(parsed):
        note = p.entry.note
        if note is None:
            continue
        if p.entry.event is AuditEvent.SIGNED:
            signed.add((note.holder, note.digest))
        elif p.entry.event is AuditEvent.RELEASED:
            missing = [h for h in note.signers if (h, note.digest) not in signed]
            if missing:
                raise AuditError(Failure.RELEASE, index, f"it names signers {', '.join(missing)} whose signature of "
                                                         "its statement the log does not hold before it")


def verify_log(path: str | os.PathLike[str],
               orchestrator_key: bytes | str | ec.EllipticCurvePublicKey | x509.Certificate,
               holder: str | None = None, *, gpu: str | None = None, job: bytes | None = None,
               allow_truncated_tail: bool = False,
               known_head: tuple[int, bytes] | bytes | None = None) -> AuditSummary:
    """AuditError at the first fault: seq, chain, signature, one GPU and job, the count, a release's
    signatures, nothing after a close, ``known_head`` still held. A log not ``closed`` may be missing entries at its end."""
    key = load_verifier(orchestrator_key)
    expected = check_gpu(gpu) if gpu is not None else None
    if job is not None and (not isinstance(job, bytes) or len(job) != JOB_BYTES):
        raise BadInput(f"a job's id is {JOB_BYTES} bytes")
    data = _read(path)
    try:
        parsed = list(_records(data, allow_truncated_tail))
    except AuditError as err:
        _signed_if_earlier_version(err, key, data)
        raise
    _verify_chain(parsed, key)
    named = _check_one(parsed, Failure.GPU, expected, lambda e: e.gpu, repr)
    named_job = _check_one(parsed, Failure.JOB, job, lambda e: e.job, lambda j: f"job {j.hex() if j else None}")
    travels = _check_count(parsed)
    _check_releases(parsed)
    last = parsed[-1] if parsed else None
    torn = (last.end if last else 0) != len(data)
    closed = _check_closing(parsed, torn)
    if known_head is not None:
        _check_known_head(parsed, known_head)
    return AuditSummary(
        count=len(parsed),
        head_seq=len(parsed) - 1,
        head_hash=last.hash if last else GENESIS_HASH,
        head_signature=last.signature if last else b"",
        holder=holder,
        gpu=named,
        job=named_job,
        continues=parsed[0].entry.prev_hash if parsed and parsed[0].entry.prev_hash != GENESIS_HASH else None,
        travels=travels,
        entries=tuple(p.entry for p in parsed
                      if p.entry.chunk is not None and (holder is None or p.entry.holder == holder)),
        truncated_tail=torn,
        closed=closed,
        notes=tuple(p.entry for p in parsed if p.entry.event in NOTES
                    and (holder is None or p.entry.holder in (holder, ""))),
    )


# ----------------------------------------------------------------------------- a holder's own entries
def mismatched_chunks(entries: Iterable[Entry], holder_key: bytes,
                      digest_of: Callable[[int, int], bytes]) -> tuple[int, ...]:
    """A holder's check of its own entries: the seqs whose MAC is not that of ``digest_of``'s chunk."""
    bad = []
    for e in entries:
        if e.chunk is None or not e.chunk_mac:
            continue
        c = e.chunk
        try:
            want = chunk_mac(holder_key, e.job, c.holder, c.dataset_offset, c.nbytes,
                             digest_of(c.dataset_offset, c.nbytes))
        except GputravelError:
            bad.append(e.seq)
            continue
        if not hmac.compare_digest(want, e.chunk_mac):
            bad.append(e.seq)
    return tuple(bad)
