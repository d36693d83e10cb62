"""SPDM-style session establishment between the driver (requester) and the device (responder).

Sans-IO: both sides are plain state machines that take a message and return the next one.
No sockets, threads or clocks; randomness comes from an injectable `rng(n) -> bytes`, so a
deterministic rng reproduces a whole session byte for byte (the responder signs with
deterministic ECDSA, RFC 6979, for the same reason).

Flow (a cut-down SPDM 1.2 with the cryptography H100 uses: ECDHE secp384r1, SHA-384, ECDSA
P-384):

    requester                               responder
    GetCertificate          ------------->
                            <-------------  Certificate(chain, leaf first)
    KeyExchange(nonce, eph pub) --------->
                            <-------------  KeyExchangeResponse(nonce, eph pub, sig, verify)
    Finish(requester_verify) ------------>
                            <-------------  FinishResponse()

Both sides then hold the 48-byte export master secret (`session_secret`), from which
`channel.derive_epoch_keys` derives every channel key.

Transcript encoding (private, but deterministic and unambiguous): each message contributes
    lp(type name) || u32 field count || for each field: lp(field name) || tag || value
where lp(x) = u32 big-endian length || x, and the value is lp(bytes) for tag b"B", or
u32 count || lp(item)... for tag b"T" (a tuple of bytes). Fields left out of a partial
encoding (the signature and verify data, which cannot cover themselves) are simply absent,
and the field count says so.

Key schedule (after SPDM 1.2, labels shortened):
    handshake = HKDF-Extract(salt=0^48, ECDH shared secret)
    th1       = SHA-384(transcript through KeyExchangeResponse incl. signature, excl. verify)
    rsp_hs    = Expand(handshake, "spdm1.2 rsp hs data" || th1); req_hs likewise with "req"
    finished  = Expand(rsp_hs / req_hs, "spdm1.2 finished")
    responder_verify = HMAC(rsp finished, th1)
    requester_verify = HMAC(req finished, SHA-384(transcript ... || Finish excl. verify))
    master    = HKDF-Extract(salt=Expand(handshake, "spdm1.2 derived"), 0^48)
    export    = Expand(master, "spdm1.2 exp master" || SHA-384(transcript through Finish))
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, fields

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import constant_time, hashes, hmac
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import (
    Prehashed,
    decode_dss_signature,
    encode_dss_signature,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from gputravel.crypto.channel import _hkdf_expand
from gputravel.errors import BadInput, IllegalTransition, IntegrityError, ProtocolError

__all__ = [
    "NONCE_BYTES",
    "SECRET_BYTES",
    "SIGNATURE_BYTES",
    "Certificate",
    "Finish",
    "FinishResponse",
    "GetCertificate",
    "KeyExchange",
    "KeyExchangeResponse",
    "SpdmRequester",
    "SpdmResponder",
    "load_leaf_key",
]

NONCE_BYTES = 32
SECRET_BYTES = 48  # SHA-384 output size
SIGNATURE_BYTES = 96  # raw r || s, 48 bytes each
_SCALAR_BYTES = 48
# Order of the P-384 group (SEC 2 / FIPS 186-4), to turn rng bytes into a private scalar.
_P384_ORDER = int(
    "ffffffffffffffffffffffffffffffffffffffffffffffffc7634d81f4372ddf581a0db248b0a77aecec196accc52973",
    16,
)

Rng = Callable[[int], bytes]
ChainVerifier = Callable[[tuple[bytes, ...]], ec.EllipticCurvePublicKey]


# ----------------------------------------------------------------------------- messages
@dataclass(frozen=True)
class GetCertificate:
    pass


@dataclass(frozen=True)
class Certificate:
    chain_der: tuple[bytes, ...]  # leaf first

    def __post_init__(self) -> None:
        # A wire codec may hand back a list (msgpack has no tuple); keep the field hashable
        # and the transcript encoding identical on both sides.
        if isinstance(self.chain_der, list):
            object.__setattr__(self, "chain_der", tuple(self.chain_der))


@dataclass(frozen=True)
class KeyExchange:
    requester_nonce: bytes
    requester_public: bytes  # SEC1 uncompressed P-384 point


@dataclass(frozen=True)
class KeyExchangeResponse:
    responder_nonce: bytes
    responder_public: bytes
    signature: bytes  # raw r || s over SHA-384(transcript without signature and verify)
    responder_verify: bytes  # HMAC-SHA384


@dataclass(frozen=True)
class Finish:
    requester_verify: bytes


@dataclass(frozen=True)
class FinishResponse:
    pass


_MESSAGE_TYPES = (GetCertificate, Certificate, KeyExchange, KeyExchangeResponse, Finish, FinishResponse)


# ----------------------------------------------------------------------------- transcript
def _lp(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _encode(msg: object, omit: frozenset[str] = frozenset()) -> bytes:
    """Canonical transcript bytes of `msg` (see the module docstring)."""
    kept = [f for f in fields(msg) if f.name not in omit]
    parts = [_lp(type(msg).__name__.encode("ascii")), struct.pack(">I", len(kept))]
    for f in kept:
        value = getattr(msg, f.name)
        parts.append(_lp(f.name.encode("ascii")))
        if isinstance(value, bytes):
            parts += [b"B", _lp(value)]
        elif isinstance(value, tuple) and all(isinstance(v, bytes) for v in value):
            parts += [b"T", struct.pack(">I", len(value))] + [_lp(v) for v in value]
        else:
            raise ProtocolError(f"{type(msg).__name__}.{f.name} has an unsupported type")
    return b"".join(parts)


class _Transcript:
    def __init__(self) -> None:
        self._data = bytearray()

    def append(self, msg: object) -> None:
        self._data += _encode(msg)

    def digest_with(self, msg: object | None = None, omit: frozenset[str] = frozenset()) -> bytes:
        """SHA-384 of the transcript so far, plus a partial encoding of `msg` if given."""
        h = hashes.Hash(hashes.SHA384())
        h.update(bytes(self._data))
        if msg is not None:
            h.update(_encode(msg, omit))
        return h.finalize()

    def bytes(self) -> bytes:
        return bytes(self._data)


_SIG_FIELDS = frozenset({"signature", "responder_verify"})
_RSP_VERIFY = frozenset({"responder_verify"})
_REQ_VERIFY = frozenset({"requester_verify"})


# ----------------------------------------------------------------------------- key schedule
def _extract(salt: bytes, ikm: bytes) -> bytes:
    """HKDF-Extract (RFC 5869 section 2.2) over SHA-384: an HMAC keyed with the salt."""
    return _mac(salt, ikm)


def _expand(secret: bytes, info: bytes) -> bytes:
    return _hkdf_expand(hashes.SHA384(), secret, info, SECRET_BYTES)


def _mac(key: bytes, data: bytes) -> bytes:
    mac = hmac.HMAC(key, hashes.SHA384())
    mac.update(data)
    return mac.finalize()


class _KeySchedule:
    """Secrets derived from the ECDH shared secret; identical on both sides."""

    def __init__(self, shared: bytes, th1: bytes) -> None:
        self._handshake = _extract(bytes(SECRET_BYTES), shared)
        self._th1 = th1
        self._rsp_finished = _expand(_expand(self._handshake, b"spdm1.2 rsp hs data" + th1), b"spdm1.2 finished")
        self._req_finished = _expand(_expand(self._handshake, b"spdm1.2 req hs data" + th1), b"spdm1.2 finished")

    def __repr__(self) -> str:
        return "_KeySchedule(<secret>)"

    def responder_verify(self) -> bytes:
        return _mac(self._rsp_finished, self._th1)

    def requester_verify(self, th_finish: bytes) -> bytes:
        return _mac(self._req_finished, th_finish)

    def export_master(self, th2: bytes) -> bytes:
        master = _extract(_expand(self._handshake, b"spdm1.2 derived"), bytes(SECRET_BYTES))
        return _expand(master, b"spdm1.2 exp master" + th2)


# ----------------------------------------------------------------------------- helpers
def _draw(rng: Rng, n: int) -> bytes:
    out = rng(n)
    if not isinstance(out, bytes) or len(out) != n:
        raise BadInput(f"rng must return exactly {n} bytes")
    return out


def _ephemeral_key(rng: Rng) -> ec.EllipticCurvePrivateKey:
    # Drawn from the injected rng (not generate_private_key) so sessions are reproducible in
    # tests. 64 bytes reduced mod n-1 keeps the modulo bias below 2**-128.
    scalar = int.from_bytes(_draw(rng, 64), "big") % (_P384_ORDER - 1) + 1
    return ec.derive_private_key(scalar, ec.SECP384R1())


def _public_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.X962, PublicFormat.UncompressedPoint)


def _load_point(data: bytes) -> ec.EllipticCurvePublicKey:
    # Uncompressed only (0x04 || X || Y): what the message format promises.
    if not isinstance(data, bytes) or len(data) != 1 + 2 * _SCALAR_BYTES or data[0] != 4:
        raise ProtocolError("public key is not an uncompressed P-384 point")
    try:
        return ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP384R1(), data)
    except ValueError:
        raise ProtocolError("public key is not a valid P-384 point") from None


def _check_nonce(nonce: object) -> None:
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise ProtocolError(f"nonce must be {NONCE_BYTES} bytes")


def _sign(key: ec.EllipticCurvePrivateKey, digest: bytes) -> bytes:
    der = key.sign(digest, ec.ECDSA(Prehashed(hashes.SHA384()), deterministic_signing=True))
    r, s = decode_dss_signature(der)
    return r.to_bytes(_SCALAR_BYTES, "big") + s.to_bytes(_SCALAR_BYTES, "big")


def _verify(key: ec.EllipticCurvePublicKey, signature: bytes, digest: bytes) -> None:
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        raise IntegrityError("device signature is malformed")
    r = int.from_bytes(signature[:_SCALAR_BYTES], "big")
    s = int.from_bytes(signature[_SCALAR_BYTES:], "big")
    try:
        key.verify(encode_dss_signature(r, s), digest, ec.ECDSA(Prehashed(hashes.SHA384())))
    except InvalidSignature:
        raise IntegrityError("device signature does not verify") from None


def _is_p384(key: object) -> bool:
    return isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP384R1)


def load_leaf_key(chain_der: tuple[bytes, ...]) -> ec.EllipticCurvePublicKey:
    """Default `verify_chain`: takes the leaf's public key and checks NOTHING else.

    This is the attestation seam: a real verifier checks the chain against a trusted vendor
    root (and the FWID, measurements...) and is passed to SpdmRequester as `verify_chain`.
    """
    try:
        return x509.load_der_x509_certificate(chain_der[0]).public_key()
    except (ValueError, UnsupportedAlgorithm):  # parsed lazily: a flipped byte can surface either
        raise ProtocolError("device leaf certificate is not valid DER") from None


class _Machine:
    """Shared state-machine plumbing."""

    _role = "spdm"

    def __init__(self, rng: Rng) -> None:
        if not callable(rng):
            raise BadInput("rng must be callable")
        self._rng = rng
        self._state = "idle"
        self._transcript = _Transcript()
        self._secret: bytes | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(state={self._state!r})"

    @property
    def state(self) -> str:
        return self._state

    @property
    def transcript(self) -> bytes:
        """The canonical transcript so far (public data: no secrets)."""
        return self._transcript.bytes()

    @property
    def session_secret(self) -> bytes:
        """The 48-byte export master secret; only once the session is established."""
        if self._secret is None:
            raise IllegalTransition(self._role, self._state, "read the session secret")
        return self._secret

    def _expect(self, state: str, action: str) -> None:
        if self._state != state:
            raise IllegalTransition(self._role, self._state, action)

    def _fail(self, exc: Exception) -> Exception:
        # After an authentication failure the session is dead: no retry on the same state.
        self._state = "failed"
        return exc


def _expect_type(msg: object, cls: type) -> None:
    if type(msg) is not cls:
        raise ProtocolError(f"expected {cls.__name__}, got {type(msg).__name__}")


# ----------------------------------------------------------------------------- responder
class SpdmResponder(_Machine):
    """The device side: holds the identity key and answers requests in order."""

    _role = "spdm responder"

    def __init__(
        self,
        identity_key: ec.EllipticCurvePrivateKey,
        chain_der: tuple[bytes, ...],
        rng: Rng = os.urandom,
    ) -> None:
        super().__init__(rng)
        if not isinstance(identity_key, ec.EllipticCurvePrivateKey) or not _is_p384(identity_key.public_key()):
            raise BadInput("identity_key must be a P-384 private key")
        chain = tuple(chain_der)
        if not chain or not all(isinstance(c, bytes) for c in chain):
            raise BadInput("chain_der must be a non-empty tuple of DER certificates")
        try:
            leaf_key = load_leaf_key(chain)
        except ProtocolError:
            raise BadInput("the leaf of chain_der is not a DER certificate") from None
        if not _is_p384(leaf_key) or leaf_key.public_numbers() != identity_key.public_key().public_numbers():
            raise BadInput("identity_key does not match the leaf certificate of chain_der")
        self._key = identity_key
        self._chain = chain
        self._schedule: _KeySchedule | None = None

    def handle(self, msg: object) -> object:
        """Process one request and return the response message."""
        handlers = {
            GetCertificate: ("idle", self._on_get_certificate),
            KeyExchange: ("certificate_sent", self._on_key_exchange),
            Finish: ("awaiting_finish", self._on_finish),
        }
        if type(msg) not in handlers:
            if isinstance(msg, _MESSAGE_TYPES):
                raise IllegalTransition(self._role, self._state, f"handle {type(msg).__name__}")
            raise ProtocolError(f"not an SPDM request: {type(msg).__name__}")
        state, handler = handlers[type(msg)]
        self._expect(state, f"handle {type(msg).__name__}")
        return handler(msg)

    def _on_get_certificate(self, msg: GetCertificate) -> Certificate:
        response = Certificate(chain_der=self._chain)
        self._transcript.append(msg)
        self._transcript.append(response)
        self._state = "certificate_sent"
        return response

    def _on_key_exchange(self, msg: KeyExchange) -> KeyExchangeResponse:
        _check_nonce(msg.requester_nonce)
        peer = _load_point(msg.requester_public)
        self._transcript.append(msg)
        ephemeral = _ephemeral_key(self._rng)
        unsigned = KeyExchangeResponse(
            responder_nonce=_draw(self._rng, NONCE_BYTES),
            responder_public=_public_bytes(ephemeral),
            signature=b"",
            responder_verify=b"",
        )
        signature = _sign(self._key, self._transcript.digest_with(unsigned, _SIG_FIELDS))
        signed = KeyExchangeResponse(
            unsigned.responder_nonce, unsigned.responder_public, signature, b""
        )
        th1 = self._transcript.digest_with(signed, _RSP_VERIFY)
        self._schedule = _KeySchedule(ephemeral.exchange(ec.ECDH(), peer), th1)
        response = KeyExchangeResponse(
            signed.responder_nonce, signed.responder_public, signature, self._schedule.responder_verify()
        )
        self._transcript.append(response)
        self._state = "awaiting_finish"
        return response

    def _on_finish(self, msg: Finish) -> FinishResponse:
        assert self._schedule is not None
        expected = self._schedule.requester_verify(self._transcript.digest_with(msg, _REQ_VERIFY))
        given = msg.requester_verify
        if not isinstance(given, bytes) or not constant_time.bytes_eq(given, expected):
            raise self._fail(IntegrityError("requester verify data does not match"))
        self._transcript.append(msg)
        self._secret = self._schedule.export_master(self._transcript.digest_with())
        self._schedule = None  # the handshake secrets are no longer needed
        self._state = "established"
        return FinishResponse()


# ----------------------------------------------------------------------------- requester
class SpdmRequester(_Machine):
    """The driver side (in the orchestrator's CVM): authenticates the device, derives the key.

    `verify_chain` maps the device's certificate chain to the public key that must have
    signed the key exchange. The default only loads the leaf key and verifies nothing: it is
    the seam where attestation (chain to a trusted root, FWID, ...) plugs in.
    """

    _role = "spdm requester"

    def __init__(self, rng: Rng = os.urandom, *, verify_chain: ChainVerifier | None = None) -> None:
        super().__init__(rng)
        self._verify_chain = verify_chain if verify_chain is not None else load_leaf_key
        self._chain: tuple[bytes, ...] | None = None
        self._device_key: ec.EllipticCurvePublicKey | None = None
        self._ephemeral: ec.EllipticCurvePrivateKey | None = None
        self._schedule: _KeySchedule | None = None

    @property
    def device_chain(self) -> tuple[bytes, ...]:
        if self._chain is None:
            raise IllegalTransition(self._role, self._state, "read the device chain")
        return self._chain

    def get_certificate(self) -> GetCertificate:
        self._expect("idle", "send GetCertificate")
        msg = GetCertificate()
        self._transcript.append(msg)
        self._state = "awaiting_certificate"
        return msg

    def handle_certificate(self, msg: Certificate) -> None:
        self._expect("awaiting_certificate", "handle Certificate")
        _expect_type(msg, Certificate)
        chain = msg.chain_der
        if not isinstance(chain, tuple) or not chain or not all(isinstance(c, bytes) for c in chain):
            raise ProtocolError("Certificate.chain_der must be a non-empty tuple of bytes")
        key = self._verify_chain(chain)
        if not _is_p384(key):
            raise ProtocolError("device key is not a P-384 public key")
        self._transcript.append(msg)
        self._chain, self._device_key = chain, key
        self._state = "have_certificate"

    def key_exchange(self) -> KeyExchange:
        self._expect("have_certificate", "send KeyExchange")
        self._ephemeral = _ephemeral_key(self._rng)
        msg = KeyExchange(
            requester_nonce=_draw(self._rng, NONCE_BYTES),
            requester_public=_public_bytes(self._ephemeral),
        )
        self._transcript.append(msg)
        self._state = "awaiting_key_exchange_response"
        return msg

    def handle_key_exchange_response(self, msg: KeyExchangeResponse) -> Finish:
        self._expect("awaiting_key_exchange_response", "handle KeyExchangeResponse")
        _expect_type(msg, KeyExchangeResponse)
        _check_nonce(msg.responder_nonce)
        peer = _load_point(msg.responder_public)
        assert self._device_key is not None and self._ephemeral is not None
        try:
            _verify(self._device_key, msg.signature, self._transcript.digest_with(msg, _SIG_FIELDS))
        except IntegrityError as exc:
            raise self._fail(exc) from None
        th1 = self._transcript.digest_with(msg, _RSP_VERIFY)
        schedule = _KeySchedule(self._ephemeral.exchange(ec.ECDH(), peer), th1)
        self._ephemeral = None  # forward secrecy hygiene: the shared secret is consumed
        given = msg.responder_verify
        if not isinstance(given, bytes) or not constant_time.bytes_eq(given, schedule.responder_verify()):
            raise self._fail(IntegrityError("responder verify data does not match"))
        self._transcript.append(msg)
        unverified = Finish(requester_verify=b"")
        finish = Finish(schedule.requester_verify(self._transcript.digest_with(unverified, _REQ_VERIFY)))
        self._transcript.append(finish)
        self._schedule = schedule
        self._state = "awaiting_finish_response"
        return finish

    def handle_finish_response(self, msg: FinishResponse) -> None:
        self._expect("awaiting_finish_response", "handle FinishResponse")
        _expect_type(msg, FinishResponse)
        assert self._schedule is not None
        self._secret = self._schedule.export_master(self._transcript.digest_with())
        self._schedule = None
        self._state = "established"
