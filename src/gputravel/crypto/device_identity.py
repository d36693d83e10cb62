"""The emulated GPU's SPDM identity: a signing key under a two-certificate chain whose root says
it is not NVIDIA's (attest/provision.py builds the real five-certificate one)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gputravel.crypto.certs import issue_certificate, new_key, self_signed_ca, subject_name, utc_now
from gputravel.errors import BadInput

DEVICE_VALID_DAYS = 3650
VENDOR_ROOT_CN = "EMULATED GPU vendor root (not NVIDIA)"
_SERIAL_RE = re.compile(r"[A-Za-z0-9-]{1,64}")


@dataclass(frozen=True)
class DeviceIdentity:
    """The emulated GPU's identity key and certificate chain (leaf first, root last)."""

    private_key: ec.EllipticCurvePrivateKey = field(repr=False)
    chain_der: tuple[bytes, ...]

    @property
    def root_der(self) -> bytes:
        return self.chain_der[-1]


def make_device_identity(*, serial: str = "GPU-EMU-0", now: datetime | None = None) -> DeviceIdentity:
    """An emulated vendor root signing one device certificate for `serial`."""
    if not isinstance(serial, str) or not _SERIAL_RE.fullmatch(serial):
        raise BadInput("serial must be 1-64 characters from A-Z, a-z, 0-9 and '-'")
    start = utc_now(now)
    root_key, root = self_signed_ca(VENDOR_ROOT_CN, start, DEVICE_VALID_DAYS)
    device_key = new_key()
    device = issue_certificate(
        subject=subject_name(f"EMULATED GPU {serial}", x509.NameAttribute(NameOID.SERIAL_NUMBER, serial)),
        public_key=device_key.public_key(), issuer=root.subject, issuer_key=root_key,
        not_before=start, days=DEVICE_VALID_DAYS, is_ca=False,
    )
    der = serialization.Encoding.DER
    return DeviceIdentity(device_key, (device.public_bytes(der), root.public_bytes(der)))
