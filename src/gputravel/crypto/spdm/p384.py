"""The handshake's P-384 operations: ephemeral ECDH keys from the injected rng, deterministic
ECDSA (RFC 6979) as raw ``r || s``, and the device's leaf key."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.hazmat.primitives.asymmetric.utils import (
    Prehashed,
    decode_dss_signature,
    encode_dss_signature,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from gputravel.errors import BadInput, IntegrityError, ProtocolError

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing.TypeIs from Python 3.13

SIGNATURE_BYTES = 96  # raw r || s, 48 bytes each
_SCALAR_BYTES = 48
# Order of the P-384 group (SEC 2 / FIPS 186-4), to turn rng bytes into a private scalar.
_P384_ORDER = int(
    "ffffffffffffffffffffffffffffffffffffffffffffffffc7634d81f4372ddf581a0db248b0a77aecec196accc52973",
    16,
)

Rng = Callable[[int], bytes]
#: Maps the device's chain to the key that must have signed (the requester requires P-384).
ChainVerifier = Callable[[tuple[bytes, ...]], CertificatePublicKeyTypes]


def draw(rng: Rng, n: int) -> bytes:
    out = rng(n)
    if not isinstance(out, bytes) or len(out) != n:
        raise BadInput(f"rng must return exactly {n} bytes")
    return out


def ephemeral_key(rng: Rng) -> ec.EllipticCurvePrivateKey:
    # From the injected rng so sessions replay; 64 bytes mod n-1 keep the bias below 2**-128.
    scalar = int.from_bytes(draw(rng, 64), "big") % (_P384_ORDER - 1) + 1
    return ec.derive_private_key(scalar, ec.SECP384R1())


def public_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.X962, PublicFormat.UncompressedPoint)


def load_point(data: bytes) -> ec.EllipticCurvePublicKey:
    # Uncompressed only (0x04 || X || Y): what the message format promises.
    if not isinstance(data, bytes) or len(data) != 1 + 2 * _SCALAR_BYTES or data[0] != 4:
        raise ProtocolError("public key is not an uncompressed P-384 point")
    try:
        return ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP384R1(), data)
    except ValueError:
        raise ProtocolError("public key is not a valid P-384 point") from None


def sign(key: ec.EllipticCurvePrivateKey, digest: bytes) -> bytes:
    der = key.sign(digest, ec.ECDSA(Prehashed(hashes.SHA384()), deterministic_signing=True))
    r, s = decode_dss_signature(der)
    s = min(s, _P384_ORDER - s)  # low-s: (r, n-s) verifies too, and one signature must have one encoding
    return r.to_bytes(_SCALAR_BYTES, "big") + s.to_bytes(_SCALAR_BYTES, "big")


def verify(key: ec.EllipticCurvePublicKey, signature: bytes, digest: bytes) -> None:
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        raise IntegrityError("device signature is malformed")
    r = int.from_bytes(signature[:_SCALAR_BYTES], "big")
    s = int.from_bytes(signature[_SCALAR_BYTES:], "big")
    if s > _P384_ORDER // 2:  # a relay's (r, n-s) twin would change evidence bytes and digests
        raise IntegrityError("device signature is not in low-s form")
    try:
        key.verify(encode_dss_signature(r, s), digest, ec.ECDSA(Prehashed(hashes.SHA384())))
    except InvalidSignature:
        raise IntegrityError("device signature does not verify") from None


def is_p384(key: object) -> TypeIs[ec.EllipticCurvePublicKey]:
    return isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP384R1)


def load_leaf_key(chain_der: tuple[bytes, ...]) -> CertificatePublicKeyTypes:
    """Default `verify_chain`: the leaf's public key, checking NOTHING else (attestation passes
    a real one: attest.spdm_chain_verifier)."""
    try:
        return x509.load_der_x509_certificate(chain_der[0]).public_key()
    except (ValueError, UnsupportedAlgorithm):  # parsed lazily: a flipped byte can surface either
        raise ProtocolError("device leaf certificate is not valid DER") from None
