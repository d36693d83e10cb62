"""Provisioning an emulated H100: its 5-certificate chain, firmware key and reference values.

    vendor root (from `pki init`, self-signed)
      <- identity CA            "EMULATED GH100 Identity CA (not NVIDIA)"
        <- provisioner ICA      "EMULATED GH100 Provisioner ICA (not NVIDIA)"
          <- per-device cert    "EMULATED GH100 FSP BROM <serial> (not NVIDIA)"   (a CA)
            <- firmware leaf    "EMULATED GH100 GSP-FMC LF <serial> (not NVIDIA)" (FWID ext.)

In a real fleet the identity CA and provisioner ICA are shared by many devices; here each
provisioning makes its own, which a verifier cannot tell apart. A device directory holds:
device-chain.pem (leaf first), device-firmware.key (0600), device.json (firmware state)
and reference-values.json (what a verifier of this device compares with).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.attest.chain import FWID_OID
from gputravel.attest.gpu import (
    EmulatedGpuFirmware,
    ReferenceValues,
    default_measurements,
    fwid_of,
)
from gputravel.attest.roots import Authority
from gputravel.crypto.pki import DEVICE_VALID_DAYS, _key_pem, _new_key, _write_private
from gputravel.errors import BadInput

__all__ = ["GpuDevice", "provision_gpu"]

CHAIN_FILE, KEY_FILE = "device-chain.pem", "device-firmware.key"
STATE_FILE, REFERENCE_FILE = "device.json", "reference-values.json"
DEFAULT_DRIVER, DEFAULT_VBIOS = "550.54.15-emulated", "96.00.9F.00.04-emulated"
_SERIAL_RE = re.compile(r"[A-Za-z0-9-]{1,64}")


@dataclass(frozen=True)
class GpuDevice:
    """One provisioned emulated GPU: what its firmware holds."""

    serial: str
    chain_der: tuple[bytes, ...]  # firmware leaf first, vendor root last
    leaf_key: ec.EllipticCurvePrivateKey = field(repr=False)
    measurements: tuple[tuple[int, bytes], ...]
    driver_version: str
    vbios_version: str
    cc_mode: bool = True

    def firmware(self, **overrides: object) -> EmulatedGpuFirmware:
        """The firmware answering GET_MEASUREMENTS; overrides emulate a changed device."""
        args: dict[str, object] = {
            "leaf_key": self.leaf_key, "cert_chain": self.chain_der, "measurements": dict(self.measurements),
            "driver_version": self.driver_version, "vbios_version": self.vbios_version, "cc_mode": self.cc_mode,
        }
        args.update(overrides)
        return EmulatedGpuFirmware(**args)  # type: ignore[arg-type]

    def reference_values(self) -> ReferenceValues:
        return ReferenceValues.of(dict(self.measurements), self.driver_version, self.vbios_version)

    # ------------------------------------------------------------------ files
    def save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        pem = b"".join(x509.load_der_x509_certificate(d).public_bytes(serialization.Encoding.PEM)
                       for d in self.chain_der)
        _write_private(directory / KEY_FILE, _key_pem(self.leaf_key))
        (directory / CHAIN_FILE).write_bytes(pem)
        state = {"serial": self.serial, "driver_version": self.driver_version,
                 "vbios_version": self.vbios_version, "cc_mode": self.cc_mode,
                 "measurements": {str(i): d.hex() for i, d in self.measurements}}
        self.reference_values().save(directory / REFERENCE_FILE)
        (directory / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")  # last: marks complete

    @staticmethod
    def exists(directory: Path) -> bool:
        return (Path(directory) / STATE_FILE).exists()

    @classmethod
    def load(cls, directory: Path) -> GpuDevice:
        directory = Path(directory)
        try:
            state = json.loads((directory / STATE_FILE).read_text())
            pem = (directory / CHAIN_FILE).read_bytes()
            key = serialization.load_pem_private_key((directory / KEY_FILE).read_bytes(), password=None)
            chain = tuple(c.public_bytes(serialization.Encoding.DER)
                          for c in x509.load_pem_x509_certificates(pem))
            measurements = {int(k): bytes.fromhex(v) for k, v in state["measurements"].items()}
            device = cls(state["serial"], chain, key, tuple(sorted(measurements.items())),  # type: ignore[arg-type]
                         state["driver_version"], state["vbios_version"], bool(state["cc_mode"]))
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            raise BadInput(f"{directory} does not hold a readable emulated GPU device") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey) or len(chain) != 5:
            raise BadInput(f"{directory}: device key or certificate chain is malformed")
        return device


def provision_gpu(
    vendor: Authority,
    *,
    serial: str = "GPU-EMU-0",
    now: datetime | None = None,
    days: int = DEVICE_VALID_DAYS,
    firmware_version: str = "1.0",
    driver_version: str = DEFAULT_DRIVER,
    vbios_version: str = DEFAULT_VBIOS,
    cc_mode: bool = True,
) -> GpuDevice:
    """Issue a device's 5-certificate chain under `vendor` and set up its firmware state."""
    if not isinstance(serial, str) or not _SERIAL_RE.fullmatch(serial):
        raise BadInput("serial must be 1-64 characters from A-Z, a-z, 0-9 and '-'")
    measurements = default_measurements(firmware_version)
    identity = vendor.child("EMULATED GH100 Identity CA (not NVIDIA)", now=now, days=days)
    provisioner = identity.child("EMULATED GH100 Provisioner ICA (not NVIDIA)", now=now, days=days)
    device = provisioner.child(f"EMULATED GH100 FSP BROM {serial} (not NVIDIA)", now=now, days=days,
                               serial=serial)
    leaf_key = _new_key()
    fwid_ext = x509.UnrecognizedExtension(FWID_OID, fwid_of(measurements))
    leaf = device.issue(f"EMULATED GH100 GSP-FMC LF {serial} (not NVIDIA)", leaf_key.public_key(),
                        is_ca=False, now=now, days=days, serial=serial, extensions=[(fwid_ext, False)])
    chain = (leaf, device.cert_der, provisioner.cert_der, identity.cert_der, vendor.cert_der)
    return GpuDevice(serial, chain, leaf_key, tuple(sorted(measurements.items())),
                     driver_version, vbios_version, cc_mode)
