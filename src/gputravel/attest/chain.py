"""X.509 chain checks shared by GPU evidence and CVM quotes, and our private OIDs. Explicit, not a
WebPKI verifier: each failure must name the attestation claim it breaks. The OIDs live under a
UUID arc (X.667, 2.25.<uuid>), which anyone may mint without registration."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID, SignatureAlgorithmOID

from gputravel.attest.errors import AttestationError
from gputravel.crypto.spdm import p384
from gputravel.errors import BadInput, IntegrityError

# urn:uuid:836eb01e-d856-4ded-ba73-e0a9d3a30800 as an OID arc (X.667).
GPUTRAVEL_OID_ARC = "2.25.174703592250151026260892070534287919104"
FWID_OID = x509.ObjectIdentifier(GPUTRAVEL_OID_ARC + ".1")
"""Firmware leaf extension: the raw 48-byte SHA-384 FWID (not DER; see docs/attestation.md)."""
CVM_QUOTE_OID = x509.ObjectIdentifier(GPUTRAVEL_OID_ARC + ".2")
"""RA-TLS certificate extension: the msgpack-encoded emulated CVM quote."""
TCG_DICE_TCBINFO_OID = "2.23.133.5.4.1"
"""Where a real H100 firmware leaf carries its FWID (DICE TcbInfo); documentation only."""

FWID_BYTES = 48


def check_now(now: object) -> datetime:
    """Attestation never reads the clock: `now` is passed in and must be timezone-aware."""
    if not isinstance(now, datetime) or now.tzinfo is None:
        raise BadInput("now must be a timezone-aware datetime (e.g. datetime.now(timezone.utc))")
    return now


def common_name(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else "(no CN)"


def _parse(chain_der: Sequence[bytes], what: str) -> list[x509.Certificate]:
    if not isinstance(chain_der, (tuple, list)) or not chain_der:
        raise AttestationError("chain", f"{what} certificate chain is empty")
    certs = []
    for i, der in enumerate(chain_der):
        try:
            certs.append(x509.load_der_x509_certificate(der))
        except (ValueError, TypeError):
            raise AttestationError("chain", f"{what} certificate {i} is not DER") from None
    return certs


def _check_algorithms(cert: x509.Certificate, i: int, what: str) -> None:
    key = cert.public_key()
    if not (isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP384R1)):
        raise AttestationError("chain", f"{what} certificate {i} key is not ECDSA P-384")
    if cert.signature_algorithm_oid != SignatureAlgorithmOID.ECDSA_WITH_SHA384:
        raise AttestationError("chain", f"{what} certificate {i} is not signed ecdsa-with-SHA384")


def _basic_constraints(cert: x509.Certificate) -> x509.BasicConstraints | None:
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        return None


def _check_issuer_is_ca(issuer: x509.Certificate, i: int, cas_below: int, what: str) -> None:
    bc = _basic_constraints(issuer)
    if bc is None or not bc.ca:
        raise AttestationError("chain", f"{what} certificate {i} issues certificates but is not a CA")
    if bc.path_length is not None and cas_below > bc.path_length:
        raise AttestationError("chain", f"{what} certificate {i} exceeds its path length")
    try:
        usage = issuer.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        return
    if not usage.key_cert_sign:
        raise AttestationError("chain", f"{what} certificate {i} may not sign certificates")


def _check_link(child: x509.Certificate, issuer: x509.Certificate, i: int, what: str) -> None:
    try:
        child.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        raise AttestationError(
            "chain", f"{what} certificate {i} ({common_name(child)}) is not signed by certificate {i + 1}"
        ) from None


def _check_validity(cert: x509.Certificate, i: int, now: datetime, what: str) -> None:
    if now < cert.not_valid_before_utc:
        raise AttestationError("expired", f"{what} certificate {i} ({common_name(cert)}) is not yet valid")
    if now > cert.not_valid_after_utc:
        raise AttestationError("expired", f"{what} certificate {i} ({common_name(cert)}) has expired")


#: What cryptography raises from a malformed certificate, some only when a field is first read:
#: a byte flipped in an unauthenticated chain gets a typed refusal, never a crash.
MALFORMED_CERTIFICATE = (ValueError, TypeError, UnsupportedAlgorithm, x509.DuplicateExtension, x509.InvalidVersion)


def verify_chain(chain_der: Sequence[bytes], trusted_roots_der: Sequence[bytes], now: datetime, *, what: str,
                 length: int | None = None) -> x509.Certificate:
    """Check a chain (leaf first, self-signed root last) and return the leaf: every certificate
    P-384 and ecdsa-with-SHA384, valid at `now`, signed by the next, a CA allowed to sign; the
    leaf no CA; the root byte-for-byte a trusted one. AttestationError("chain" or "expired")."""
    check_now(now)
    try:
        certs = _parse(chain_der, what)
        if length is not None and len(certs) != length:
            raise AttestationError("chain", f"{what} chain has {len(certs)} certificates, expected {length}")
        for i, cert in enumerate(certs):
            _check_algorithms(cert, i, what)
        leaf_bc = _basic_constraints(certs[0])
        if len(certs) > 1 and leaf_bc is not None and leaf_bc.ca:
            raise AttestationError("chain", f"{what} leaf certificate must not be a CA")
        for i in range(len(certs) - 1):
            _check_link(certs[i], certs[i + 1], i, what)
            _check_issuer_is_ca(certs[i + 1], i + 1, i, what)  # certs[1..i] are CAs below it
        root = certs[-1]
        if chain_der[-1] not in set(trusted_roots_der):
            raise AttestationError("chain", f"{what} chain does not end in a trusted root ({common_name(root)})")
        try:
            root.verify_directly_issued_by(root)
        except (ValueError, TypeError, InvalidSignature):
            raise AttestationError("chain", f"{what} root certificate is not self-signed") from None
        for i, cert in enumerate(certs):
            _check_validity(cert, i, now, what)
        return certs[0]
    except MALFORMED_CERTIFICATE:
        raise AttestationError("chain", f"{what} certificate chain holds a malformed certificate") from None


def leaf_fwid(leaf: x509.Certificate) -> bytes:
    """The FWID carried by a firmware leaf, or AttestationError("fwid")."""
    try:
        ext = leaf.extensions.get_extension_for_oid(FWID_OID).value
    except x509.ExtensionNotFound:
        raise AttestationError("fwid", "firmware leaf certificate carries no FWID extension") from None
    except MALFORMED_CERTIFICATE:
        raise AttestationError("fwid", "firmware leaf certificate has malformed extensions") from None
    value = ext.value if isinstance(ext, x509.UnrecognizedExtension) else b""
    if len(value) != FWID_BYTES:
        raise AttestationError("fwid", f"firmware leaf FWID is not {FWID_BYTES} bytes")
    return value


def sign_p384(key: ec.EllipticCurvePrivateKey, data: bytes) -> bytes:
    """Raw r||s (96 bytes) ECDSA P-384 signature over SHA-384(data)."""
    return p384.sign(key, sha384(data))


def verify_p384(key: object, signature: bytes, data: bytes) -> bool:
    """Whether `signature` (raw r||s, 96 bytes) is key's ECDSA P-384 signature over SHA-384(data)."""
    if not p384.is_p384(key):
        return False
    try:
        p384.verify(key, signature, sha384(data))
    except IntegrityError:
        return False
    return True


def sha384(data: bytes) -> bytes:
    h = hashes.Hash(hashes.SHA384())
    h.update(data)
    return h.finalize()
