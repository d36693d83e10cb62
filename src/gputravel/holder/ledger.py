"""A holder's privacy ledger (issue 29): the jobs it approved and the epsilon each may spend of its
data, so it refuses a job that would take the total past its cap, and says by how much.

One signed entry a line (msgpack through the codec, hex, one per line: appended, never rewritten),
each naming the digest of the line before it, signed by the holder's own P-384 TLS key. A ledger
that does not verify (an entry edited, dropped or reordered) refuses every approval and every
start; only a lost tail is not seen by the chain, so every job in the holder's `approved_jobs`
must also be in the ledger.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.errors import BadInput, GputravelError
from gputravel.protocol.codec import Message, decode, encode

__all__ = ["LEDGER_FILE", "LedgerEntry", "PrivacyLedger", "job_epsilon"]

LEDGER_FILE = "privacy-ledger"  # in the holder's state_dir
_LABEL = b"gputravel/privacy-ledger/v1\x00"
_ECDSA = ec.ECDSA(hashes.SHA384())
_GENESIS = "0" * 96
_MAX_BYTES = 16 << 20


class LedgerEntry(Message, tag="ledger.entry"):
    seq: int
    job: str  # the job's digest (hex), as the holder's policy approves it
    epsilon: float  # what the job may spend of this holder's data; math.inf: no DP
    delta: float
    approved_at: float  # seconds since the epoch
    prev: str  # SHA-384 (hex) of the line before; the first names 96 zeros


class SignedEntry(Message, tag="ledger.signed"):
    entry: bytes  # the encoded LedgerEntry
    signature: bytes  # ECDSA P-384 over a label and that encoding


def job_epsilon(dp_epsilon: float) -> float:
    """The epsilon a job's setting spends: its target, or unbounded without DP-SGD (0)."""
    return dp_epsilon if dp_epsilon > 0 else math.inf


def _digest(line: bytes) -> str:
    return hashlib.sha384(line).hexdigest()


@dataclass(frozen=True)
class PrivacyLedger:
    path: Path
    entries: tuple[LedgerEntry, ...]
    head: str  # the digest of the last line (what the next entry names)

    @classmethod
    def load(cls, path: str | Path, public_key: ec.EllipticCurvePublicKey) -> PrivacyLedger:
        """The ledger at `path` (none: empty), each entry checked in order; BadInput on any that is not."""
        path = Path(path)
        try:
            with open(path, "rb") as f:
                data = f.read(_MAX_BYTES + 1)
        except FileNotFoundError:
            return cls(path, (), _GENESIS)
        except OSError as exc:
            raise BadInput(f"{path}: cannot read the privacy ledger ({exc.strerror})") from None
        if len(data) > _MAX_BYTES:
            raise BadInput(f"{path}: larger than a privacy ledger ({_MAX_BYTES} bytes)")
        entries, head = [], _GENESIS
        for n, line in enumerate(data.splitlines(), 1):
            entry = _verified(line, n, head, public_key, path)
            entries.append(entry)
            head = _digest(line)
        return cls(path, tuple(entries), head)

    def spent(self, but: str = "") -> float:
        """The epsilon every approved job may spend, together (but job `but`)."""
        return math.fsum(e.epsilon for e in self.entries if e.job != but) if self.entries else 0.0

    def find(self, job: str) -> LedgerEntry | None:
        return next((e for e in self.entries if e.job == job), None)

    def check(self, holder: str, job: str, epsilon: float, cap: float, why: str = "") -> None:
        """BadInput, saying by how much, if approving `job` at `epsilon` takes the total past `cap`
        (`why`: why the job's epsilon is unbounded, where it has DP-SGD)."""
        total = self.spent(but=job) + epsilon
        if total > cap:
            over = f"unbounded: {why or 'the job has no DP-SGD'}" if math.isinf(epsilon) else f"{total - cap:g} over"
            raise BadInput(f"holder {holder!r}: job {job[:16]}... may spend epsilon {_eps(epsilon)} of its data; "
                           f"its cap is {cap:g} and the jobs it approved before may spend {_eps(self.spent(job))}: "
                           f"{over}")

    def append(self, job: str, epsilon: float, delta: float, key: ec.EllipticCurvePrivateKey,
               now: float) -> PrivacyLedger:
        """This ledger with `job` recorded (once: a job already in it is kept as it is), written first."""
        if self.find(job) is not None:
            return self
        entry = LedgerEntry(len(self.entries) + 1, job, epsilon, delta, now, self.head)
        body = encode(entry)
        line = encode(SignedEntry(body, key.sign(_LABEL + body, _ECDSA))).hex().encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "ab") as f:
            f.write(line + b"\n")
            f.flush()
            os.fsync(f.fileno())
        return PrivacyLedger(self.path, (*self.entries, entry), _digest(line))

    def missing(self, approved: Iterable[str]) -> list[str]:
        """The approved jobs the ledger does not hold (a lost tail, or an approval written by hand)."""
        return [j for j in approved if self.find(j) is None]


def _eps(value: float) -> str:
    return "unbounded" if math.isinf(value) else f"{value:g}"


def _verified(line: bytes, n: int, head: str, key: ec.EllipticCurvePublicKey, path: Path) -> LedgerEntry:
    where = f"{path}: entry {n}"
    try:
        signed = decode(bytes.fromhex(line.decode("ascii")), expect=SignedEntry)
        key.verify(signed.signature, _LABEL + signed.entry, _ECDSA)
        entry = decode(signed.entry, expect=LedgerEntry)
    except (ValueError, UnicodeDecodeError, GputravelError, InvalidSignature):
        raise BadInput(f"{where} does not verify under this holder's key: the ledger was altered; restore it "
                       "from a copy (nothing is approved or served meanwhile)") from None
    if entry.seq != n or entry.prev != head:
        raise BadInput(f"{where} is out of its place (an entry dropped or reordered): the ledger was altered; "
                       "restore it from a copy (nothing is approved or served meanwhile)")
    if not (entry.epsilon > 0 and 0 < entry.delta < 1):
        raise BadInput(f"{where} records no valid epsilon and delta")
    return entry
