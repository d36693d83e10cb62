"""The key broker's side of a key request as a sans-IO machine (emulating Trustee/KBS's
request-challenge-attest-resource exchange): messages and `now` in, replies out.

A requester names a purpose and an ephemeral X25519 key; the broker answers with a fresh nonce;
the requester returns a quote whose report data binds that nonce and key. The key the broker then
releases is derived from its secret and the requester's *quoted* MRTD and RTMR[3], so an
orchestrator of another measurement or job gets another key, and nothing it sends can change that.
The broker signs each grant with its identity key, so the requester can tell it from any other
process listening on the same socket path (one the host started, handing out a key it knows).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.hpke import AEAD, KDF, KEM, Suite
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gputravel.errors import BadInput, GputravelError, IntegrityError
from gputravel.protocol.codec import Message, encode

__all__ = ["KEY_BYTES", "PURPOSES", "GrantStatement", "KeyBroker", "KeyChallenge", "KeyEvidence", "KeyGrant",
           "KeyRefused", "KeyRequest", "Reply", "Verify", "derive_key", "grant_signed_by", "key_report_data", "load_broker_key",
           "open_grant", "seal_grant", "sign_grant"]

PURPOSES = ("checkpoint", "model", "dp")  # "dp": DP-SGD's sampling and noise key (issue 29)
KEY_BYTES = 32
NONCE_BYTES = 32
DIGEST_BYTES = 48  # MRTD and RTMR[3], SHA-384 each
REPORT_DATA_BYTES = 64
CHALLENGE_S = 30.0  # how long a challenge may wait for its evidence
_REPORT_LABEL = b"gputravel key broker v1\x00"
_KEY_LABEL = b"gputravel key broker key v1\x00"
_GRANT_LABEL = b"gputravel key broker grant v1\x00"
_SIGNED_LABEL = b"gputravel key broker signed grant v1\x00"
_SUITE = Suite(KEM.X25519, KDF.HKDF_SHA256, AEAD.AES_256_GCM)

#: Verifies a quote against the report data it must carry at `now` (Unix seconds): the quoted
#: (MRTD, RTMR[3]), or an AttestationError naming the claim that failed (process.py: the real one).
Verify = Callable[[bytes, bytes, float], tuple[bytes, bytes]]


# ----------------------------------------------------------------------------- messages
class KeyRequest(Message, tag="broker.key_request"):
    """Requester -> broker: a key for `purpose`, sealed to this ephemeral X25519 key (32 bytes raw)."""

    purpose: str
    public_key: bytes


class KeyChallenge(Message, tag="broker.key_challenge"):
    nonce: bytes


class KeyEvidence(Message, tag="broker.key_evidence"):
    """A quote whose report data is `key_report_data(nonce, public_key)`."""

    quote: bytes


class KeyGrant(Message, tag="broker.key_grant"):
    """The key, HPKE-sealed to the request's public key (info binds the purpose and the nonce), and the
    broker's ECDSA P-384 signature over that exchange and these sealed bytes (`sign_grant`)."""

    sealed: bytes
    signature: bytes


class GrantStatement(Message, tag="broker.grant_statement"):
    """What a grant's signature covers: the exchange (nonce, the requester's key, purpose) and the
    sealed key, so a grant cannot be moved to another exchange. Signed, never sent."""

    nonce: bytes
    public_key: bytes
    purpose: str
    sealed: bytes


class KeyRefused(Message, tag="broker.key_refused"):
    reason: str


# ----------------------------------------------------------------------------- the derivations
def key_report_data(nonce: bytes, public_key: bytes) -> bytes:
    """The 64 bytes of report data a requester's quote carries: SHA-384 of the nonce and its key, zero-padded."""
    digest = hashes.Hash(hashes.SHA384())
    digest.update(_REPORT_LABEL + nonce + public_key)
    return digest.finalize() + bytes(REPORT_DATA_BYTES - DIGEST_BYTES)


def derive_key(secret: bytes, purpose: str, mr_td: bytes, rtmr3: bytes) -> bytes:
    """The 32-byte key of one (measurement, job, purpose): HKDF-SHA256 of the broker's secret."""
    if len(mr_td) != DIGEST_BYTES or len(rtmr3) != DIGEST_BYTES:
        raise BadInput(f"MRTD and RTMR[3] are {DIGEST_BYTES} bytes each")
    info = _KEY_LABEL + purpose.encode() + b"\x00" + mr_td + rtmr3
    return HKDF(hashes.SHA256(), KEY_BYTES, salt=None, info=info).derive(secret)


def _grant_info(purpose: str, nonce: bytes) -> bytes:
    return _GRANT_LABEL + purpose.encode() + b"\x00" + nonce


def seal_grant(key: bytes, public_key: bytes, purpose: str, nonce: bytes) -> bytes:
    return _SUITE.encrypt(key, X25519PublicKey.from_public_bytes(public_key), info=_grant_info(purpose, nonce))


def open_grant(sealed: bytes, private_key: X25519PrivateKey, purpose: str, nonce: bytes) -> bytes:
    """The requester's side: the key in a KeyGrant; IntegrityError if it was not sealed to us for this exchange."""
    try:
        key = _SUITE.decrypt(sealed, private_key, info=_grant_info(purpose, nonce))
    except Exception:  # InvalidTag, a truncated encapsulation: opaque on purpose
        raise IntegrityError("the key broker's grant does not open with this request's key") from None
    if len(key) != KEY_BYTES:
        raise IntegrityError("the key broker's grant holds no key of the expected size")
    return key


def _signed_bytes(nonce: bytes, public_key: bytes, purpose: str, sealed: bytes) -> bytes:
    return _SIGNED_LABEL + encode(GrantStatement(nonce, public_key, purpose, sealed))


def sign_grant(identity: ec.EllipticCurvePrivateKey, nonce: bytes, public_key: bytes, purpose: str,
               sealed: bytes) -> bytes:
    return identity.sign(_signed_bytes(nonce, public_key, purpose, sealed), ec.ECDSA(hashes.SHA384()))


def load_broker_key(hex_der: str) -> ec.EllipticCurvePublicKey:
    """The broker identity an orchestrator was launched to trust: SubjectPublicKeyInfo DER, hex, P-384."""
    try:
        key = serialization.load_der_public_key(bytes.fromhex(hex_der))
    except (ValueError, TypeError):  # not hex, not DER, or a key type not supported
        key = None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP384R1):
        raise BadInput("broker_key is not a P-384 public key (SubjectPublicKeyInfo DER, hex)")
    return key


def grant_signed_by(key: ec.EllipticCurvePublicKey, grant: KeyGrant, nonce: bytes, public_key: bytes,
                    purpose: str) -> bool:
    """Whether `grant` was signed by `key` for this very exchange (an empty signature is not)."""
    try:
        key.verify(grant.signature, _signed_bytes(nonce, public_key, purpose, grant.sealed),
                   ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        return False
    return True


# ----------------------------------------------------------------------------- the machine
@dataclass(frozen=True)
class Reply:
    """What to send to requester `conn`; `close`: the exchange is over, hang up after it."""

    conn: int
    message: KeyChallenge | KeyGrant | KeyRefused
    close: bool


@dataclass(frozen=True)
class _Challenge:
    purpose: str
    public_key: bytes
    nonce: bytes
    deadline: float


class KeyBroker:
    """One broker, any number of requesters, each known by the runtime's connection id: one
    request, one challenge, one piece of evidence, then a grant or a refusal, and hang up."""

    def __init__(self, secret: bytes, verify: Verify, *, identity: ec.EllipticCurvePrivateKey,
                 challenge_s: float = CHALLENGE_S, nonces: Callable[[int], bytes] = os.urandom) -> None:
        if len(secret) != KEY_BYTES:
            raise BadInput(f"the key broker's secret must be {KEY_BYTES} bytes")
        if not isinstance(identity, ec.EllipticCurvePrivateKey) or not isinstance(identity.curve, ec.SECP384R1):
            raise BadInput("the key broker's identity must be a P-384 private key")
        self._secret, self._verify, self._challenge_s, self._nonces = secret, verify, challenge_s, nonces
        self._identity = identity
        self._pending: dict[int, _Challenge] = {}
        self._deadlines: dict[int, float] = {}  # by when each open exchange must take its next step

    def opened(self, conn: int, now: float) -> None:
        """Requester `conn` connected at `now`: its request is due within the challenge's time too."""
        self._deadlines[conn] = now + self._challenge_s

    def receive(self, conn: int, message: object, now: float) -> Reply:
        """Take one message of requester `conn` at `now` (Unix seconds)."""
        self._deadlines.pop(conn, None)
        if isinstance(message, KeyRequest):
            return self._request(conn, message, now)
        challenge = self._pending.pop(conn, None)
        if not isinstance(message, KeyEvidence):
            return _refuse(conn, f"the key broker takes a KeyRequest, then KeyEvidence, not {type(message).__name__}")
        if challenge is None:
            return _refuse(conn, "evidence without a pending challenge: send a KeyRequest first")
        if now > challenge.deadline:
            return _refuse(conn, f"stale challenge: the evidence came after the {self._challenge_s:g} s allowed")
        return self._evidence(conn, challenge, message, now)

    def expire(self, now: float) -> list[Reply]:
        """Refuse every exchange whose next message is overdue at `now` (evidence, or the request itself)."""
        late = [c for c, due in self._deadlines.items() if now > due]
        replies = []
        for conn in late:
            del self._deadlines[conn]
            what = "stale challenge: no evidence" if self._pending.pop(conn, None) else "no key request"
            replies.append(_refuse(conn, f"{what} within {self._challenge_s:g} s"))
        return replies

    def next_deadline(self) -> float | None:
        return min(self._deadlines.values(), default=None)

    def drop(self, conn: int) -> None:
        """Requester `conn` hung up: forget its exchange."""
        self._pending.pop(conn, None)
        self._deadlines.pop(conn, None)

    def _request(self, conn: int, msg: KeyRequest, now: float) -> Reply:
        if conn in self._pending:
            del self._pending[conn]
            return _refuse(conn, "one key request per connection")
        if msg.purpose not in PURPOSES:
            return _refuse(conn, f"unknown purpose {msg.purpose[:32]!r}: the key broker releases {', '.join(PURPOSES)}")
        try:
            X25519PublicKey.from_public_bytes(msg.public_key)
        except ValueError:
            return _refuse(conn, "the request's public key is not a 32-byte X25519 key")
        nonce = self._nonces(NONCE_BYTES)
        self._pending[conn] = _Challenge(msg.purpose, msg.public_key, nonce, now + self._challenge_s)
        self._deadlines[conn] = now + self._challenge_s
        return Reply(conn, KeyChallenge(nonce=nonce), close=False)

    def _evidence(self, conn: int, ch: _Challenge, msg: KeyEvidence, now: float) -> Reply:
        try:
            mr_td, rtmr3 = self._verify(msg.quote, key_report_data(ch.nonce, ch.public_key), now)
            key = derive_key(self._secret, ch.purpose, mr_td, rtmr3)
            sealed = seal_grant(key, ch.public_key, ch.purpose, ch.nonce)
        except GputravelError as exc:  # AttestationError names its claim; nothing of a key is in it
            return _refuse(conn, str(exc))
        except ValueError:  # HPKE refused the public key (a low-order point)
            return _refuse(conn, "the request's public key cannot be sealed to")
        signature = sign_grant(self._identity, ch.nonce, ch.public_key, ch.purpose, sealed)
        return Reply(conn, KeyGrant(sealed=sealed, signature=signature), close=True)


def _refuse(conn: int, reason: str) -> Reply:
    return Reply(conn, KeyRefused(reason=reason), close=True)
