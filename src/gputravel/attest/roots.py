"""The emulated roots of trust, a GPU vendor root and a CPU-TEE quoting root, named "(not NVIDIA)"
and "(not Intel)". A verifier only reads their certificates (`TrustStore.load`); the keys
(0600) are the emulated vendor's, to provision devices and quoting keys."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.crypto.certs import issue_certificate, key_matches, key_pem, load_key, new_key
from gputravel.crypto.certs import self_signed_ca, subject_name, utc_now, write_private
from gputravel.crypto.device_identity import DEVICE_VALID_DAYS, VENDOR_ROOT_CN
from gputravel.errors import BadInput

GPU_VENDOR_ROOT_CN = VENDOR_ROOT_CN  # "EMULATED GPU vendor root (not NVIDIA)"
TEE_QUOTING_ROOT_CN = "EMULATED CPU-TEE quoting root (not Intel)"
GPU_ROOT_CERT, GPU_ROOT_KEY = "gpu-vendor-root.pem", "gpu-vendor-root.key"
TEE_ROOT_CERT, TEE_ROOT_KEY = "tee-quoting-root.pem", "tee-quoting-root.key"
_FILES = {"gpu": (GPU_ROOT_CERT, GPU_ROOT_KEY), "tee": (TEE_ROOT_CERT, TEE_ROOT_KEY)}
_DER = serialization.Encoding.DER
_PEM = serialization.Encoding.PEM


@dataclass(frozen=True)
class Authority:
    """A CA certificate and its private key: issues the next certificate down a chain."""

    cert_der: bytes
    key: ec.EllipticCurvePrivateKey = field(repr=False)

    @property
    def cert(self) -> x509.Certificate:
        return x509.load_der_x509_certificate(self.cert_der)

    @classmethod
    def self_signed(cls, common_name: str, *, now: datetime | None = None,
                    days: int = DEVICE_VALID_DAYS) -> Authority:
        key, cert = self_signed_ca(common_name, utc_now(now), days)
        return cls(cert.public_bytes(_DER), key)

    def issue(self, common_name: str, public_key: ec.EllipticCurvePublicKey, *, is_ca: bool,
              now: datetime | None = None, days: int = DEVICE_VALID_DAYS, serial: str | None = None,
              extensions: Iterable[tuple[x509.ExtensionType, bool]] = ()) -> bytes:
        """A P-384, ecdsa-with-SHA384 certificate for `public_key`, as DER."""
        extra = [x509.NameAttribute(x509.NameOID.SERIAL_NUMBER, serial)] if serial else []
        cert = issue_certificate(subject=subject_name(common_name, *extra), public_key=public_key,
                      issuer=self.cert.subject, issuer_key=self.key, not_before=utc_now(now),
                      days=days, is_ca=is_ca, extensions=extensions)
        return cert.public_bytes(_DER)

    def child(self, common_name: str, *, now: datetime | None = None,
              days: int = DEVICE_VALID_DAYS, serial: str | None = None) -> Authority:
        """A new intermediate CA (fresh key) issued by this one."""
        key = new_key()
        der = self.issue(common_name, key.public_key(), is_ca=True, now=now, days=days, serial=serial)
        return Authority(der, key)


@dataclass(frozen=True)
class TrustStore:
    """What a verifier trusts: root certificates (DER) for GPU evidence and CVM quotes."""

    gpu_roots: tuple[bytes, ...]
    tee_roots: tuple[bytes, ...]

    @classmethod
    def load(cls, directory: Path) -> TrustStore:
        """Read the root certificates written by `init_roots` (never the keys)."""
        directory = Path(directory)
        return cls((_read_cert(directory / GPU_ROOT_CERT),), (_read_cert(directory / TEE_ROOT_CERT),))


def _read_cert(path: Path) -> bytes:
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        raise BadInput(f"{path} is missing or not a PEM certificate; run `gputravel pki init` first") from None
    return cert.public_bytes(_DER)


def init_roots(directory: Path, *, now: datetime | None = None, days: int = DEVICE_VALID_DAYS) -> TrustStore:
    """Create both emulated roots in `directory`; refuses to overwrite existing ones."""
    directory = Path(directory)
    if not isinstance(days, int) or days < 1:
        raise BadInput("days must be a positive integer")
    existing = [n for pair in _FILES.values() for n in pair if (directory / n).exists()]
    if existing:
        raise BadInput(f"{directory} already holds emulated roots ({', '.join(existing)}); use an empty directory")
    directory.mkdir(parents=True, exist_ok=True)
    for which, cn in (("gpu", GPU_VENDOR_ROOT_CN), ("tee", TEE_QUOTING_ROOT_CN)):
        auth = Authority.self_signed(cn, now=now, days=days)
        cert_name, key_name = _FILES[which]
        write_private(directory / key_name, key_pem(auth.key))
        (directory / cert_name).write_bytes(auth.cert.public_bytes(_PEM))
    return TrustStore.load(directory)


def load_authority(directory: Path, which: str) -> Authority:
    """The emulated vendor's side of a root ("gpu" or "tee"): certificate and private key."""
    if which not in _FILES:
        raise BadInput(f"unknown root {which!r}: use 'gpu' or 'tee'")
    cert_name, key_name = _FILES[which]
    directory = Path(directory)
    cert_der = _read_cert(directory / cert_name)
    try:
        key = load_key((directory / key_name).read_bytes())
    except (OSError, ValueError, TypeError):
        raise BadInput(f"{directory / key_name} is missing or not a PEM EC private key") from None
    if not key_matches(x509.load_der_x509_certificate(cert_der), key):
        raise BadInput(f"{directory / key_name} does not match {cert_name}")
    return Authority(cert_der, key)
