"""X.509 building blocks shared by the cohort PKI, the device identity and attestation: P-384
keys, ecdsa-with-SHA384 certificates through one :func:`issue_certificate`, private keys 0600
from the start, and requests so that a party's private key never leaves it."""

from __future__ import annotations

import os
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gputravel.errors import BadInput

# Certificates start a little in the past so peers with slightly skewed clocks accept them.
_CLOCK_SKEW = timedelta(minutes=5)
_EMULATION_ORG = "gputravel emulation"


def utc_now(now: datetime | None) -> datetime:
    """``now`` (which must be timezone-aware), or the current UTC time when None."""
    if now is None:
        return datetime.now(timezone.utc)
    if now.tzinfo is None:
        raise BadInput("now must be timezone-aware (e.g. datetime.now(timezone.utc))")
    return now


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP384R1())


def subject_name(common_name: str, *extra: x509.NameAttribute[str]) -> x509.Name:
    """A name in the emulation's organisation, so no certificate passes for a real vendor's."""
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, _EMULATION_ORG), *extra,
         x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def issue_certificate(*, subject: x509.Name, public_key: ec.EllipticCurvePublicKey, issuer: x509.Name,
                      issuer_key: ec.EllipticCurvePrivateKey, not_before: datetime, days: int, is_ca: bool,
                      extensions: Iterable[tuple[x509.ExtensionType, bool]] = ()) -> x509.Certificate:
    """One P-384 certificate signed with ecdsa-with-SHA384 (self-signed if issuer == subject)."""
    if is_ca:
        usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
    else:
        usage = x509.KeyUsage(True, False, False, False, False, False, False, False, False)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before - _CLOCK_SKEW)
        .not_valid_after(not_before + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
        )
    )
    for ext, critical in extensions:
        builder = builder.add_extension(ext, critical=critical)
    return builder.sign(issuer_key, hashes.SHA384())


def self_signed_ca(common_name: str, start: datetime, days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A fresh key and the self-signed CA certificate of `common_name` for it."""
    key, name = new_key(), subject_name(common_name)
    return key, issue_certificate(subject=name, public_key=key.public_key(), issuer=name, issuer_key=key,
                                  not_before=start, days=days, is_ca=True)


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def load_key(pem: bytes) -> ec.EllipticCurvePrivateKey:
    """An unencrypted EC private key from PEM; ValueError or TypeError for anything else."""
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("not an EC private key")
    return key


def key_matches(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> bool:
    """Whether `cert` certifies the public half of `key`."""
    public = cert.public_key()
    return isinstance(public, ec.EllipticCurvePublicKey) and \
        public.public_numbers() == key.public_key().public_numbers()


def write_private(path: Path, data: bytes) -> None:
    # 0600 from creation (never world-readable), and fchmod for a file that existed looser.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- requests
def requested_key(csr_pem: bytes, common_name: str, who: str) -> ec.EllipticCurvePublicKey:
    """Run by the issuer: the P-384 key that self-signed `csr_pem` for `common_name`, or BadInput."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError:
        raise BadInput(f"{who}: the certificate request is not PEM") from None
    key = csr.public_key()
    if not csr.is_signature_valid or not isinstance(key, ec.EllipticCurvePublicKey) \
            or not isinstance(key.curve, ec.SECP384R1):
        raise BadInput(f"{who}: the request is not self-signed by a P-384 key")
    cns = [a.value for a in csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if cns != [common_name]:
        raise BadInput(f"{who}: the request names {cns!r}")
    return key


def own_key_request(path: Path, common_name: str) -> bytes:
    """Run by the party itself: its key at `path` (made once, 0600) and a request to certify it."""
    path = Path(path)
    if path.exists():
        try:
            key = load_key(path.read_bytes())
        except (ValueError, TypeError):
            raise BadInput(f"{path} is not an EC private key") from None
    else:
        key = new_key()
        write_private(path, key_pem(key))
    csr = x509.CertificateSigningRequestBuilder().subject_name(subject_name(common_name)).sign(key, hashes.SHA384())
    return csr.public_bytes(serialization.Encoding.PEM)
