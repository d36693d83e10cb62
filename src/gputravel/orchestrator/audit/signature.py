"""The orchestrator's ECDSA P-384 signature on every entry's ``(seq, hash)``, so any prefix of the
log is a signed head a holder can check on its own; and loading its keys."""

from __future__ import annotations

import struct

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)

from gputravel.errors import BadInput
from gputravel.orchestrator.audit.entries import AuditError, Failure

_SCALAR_BYTES = 48
SIGNATURE_BYTES = 2 * _SCALAR_BYTES
# Domain separation: a head's signature never passes for another statement made with the key.
_SIGNED_PREFIX = b"gputravel/audit/v1/head\x00"
_SEQ = struct.Struct(">Q")
# P-384's order: with s <= n/2, one valid signature encoding per entry, so no byte changes unnoticed.
_P384_ORDER = int("ffffffffffffffffffffffffffffffffffffffffffffffffc7634d81f4372ddf"
                  "581a0db248b0a77aecec196accc52973", 16)


def _signed_message(seq: int, digest: bytes) -> bytes:
    return _SIGNED_PREFIX + _SEQ.pack(seq) + digest


def sign_head(key: ec.EllipticCurvePrivateKey, seq: int, digest: bytes) -> bytes:
    """The low-s signature of the head ``(seq, digest)``."""
    r, s = decode_dss_signature(key.sign(_signed_message(seq, digest), ec.ECDSA(hashes.SHA384())))
    s = min(s, _P384_ORDER - s)  # (r, n - s) verifies too: keep the low one only
    return r.to_bytes(_SCALAR_BYTES, "big") + s.to_bytes(_SCALAR_BYTES, "big")


def verify_head(key: ec.EllipticCurvePublicKey, seq: int, digest: bytes, signature: bytes) -> None:
    """AuditError (SIGNATURE) unless ``signature`` is the canonical signature of the head."""
    if len(signature) != SIGNATURE_BYTES:
        raise AuditError(Failure.SIGNATURE, seq, f"a signature is {SIGNATURE_BYTES} bytes")
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


def load_signer(key: bytes | ec.EllipticCurvePrivateKey) -> ec.EllipticCurvePrivateKey:
    """The orchestrator's P-384 signing key from an unencrypted private-key PEM (or object)."""
    if isinstance(key, bytes):
        try:
            key = serialization.load_pem_private_key(key, password=None)  # type: ignore[assignment]
        except (ValueError, TypeError):
            raise BadInput("the signing key is not an unencrypted private-key PEM") from None
    if not (isinstance(key, ec.EllipticCurvePrivateKey) and _is_p384(key)):
        raise BadInput("the signing key must be an ECDSA P-384 private key")
    return key
