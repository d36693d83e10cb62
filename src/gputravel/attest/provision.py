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

Two ways to get there. `provision_gpu` makes everything, firmware key included, in one
process (the CLI and in-process tests). In a cohort the vendor and the device are apart:
the launcher, standing for the vendor, makes the three CAs above the leaf (`issue_gpu_ca`)
and writes the public firmware state (`GpuIssuer.save_state`); the device process makes its
firmware key itself at boot and sends a certificate request (`enroll_gpu`), which the
vendor signs with the per-device CA's key (`GpuIssuer.certify_request`), held in memory only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.attest.chain import FWID_OID
from gputravel.attest.gpu import EmulatedGpuFirmware, ReferenceValues, default_measurements, fwid_of
from gputravel.attest.roots import Authority
from gputravel.crypto.certs import key_pem, new_key, own_key_request, requested_key
from gputravel.crypto.certs import write_private
from gputravel.crypto.device_identity import DEVICE_VALID_DAYS
from gputravel.errors import BadInput

__all__ = ["GpuDevice", "GpuIssuer", "enroll_gpu", "issue_gpu_ca", "provision_gpu"]

CHAIN_FILE, KEY_FILE = "device-chain.pem", "device-firmware.key"
STATE_FILE, REFERENCE_FILE = "device.json", "reference-values.json"
DEFAULT_DRIVER, DEFAULT_VBIOS = "550.54.15-emulated", "96.00.9F.00.04-emulated"
_SERIAL_RE = re.compile(r"[A-Za-z0-9-]{1,64}")


def _leaf_cn(serial: str) -> str:
    return f"EMULATED GH100 GSP-FMC LF {serial} (not NVIDIA)"


def _pem(chain_der: tuple[bytes, ...]) -> bytes:
    return b"".join(x509.load_der_x509_certificate(d).public_bytes(serialization.Encoding.PEM) for d in chain_der)


class _FirmwareState:
    """What a device's firmware measures and reports (public), shared by the vendor's view
    of a device (`GpuIssuer`) and the device's own (`GpuDevice`)."""

    serial: str
    measurements: tuple[tuple[int, bytes], ...]
    driver_version: str
    vbios_version: str
    cc_mode: bool

    def reference_values(self) -> ReferenceValues:
        return ReferenceValues.of(dict(self.measurements), self.driver_version, self.vbios_version)

    def save_state(self, directory: Path) -> None:
        """device.json and reference-values.json (no key, no chain)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {"serial": self.serial, "driver_version": self.driver_version,
                 "vbios_version": self.vbios_version, "cc_mode": self.cc_mode,
                 "measurements": {str(i): d.hex() for i, d in self.measurements}}
        self.reference_values().save(directory / REFERENCE_FILE)
        (directory / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")


@dataclass(frozen=True)
class GpuDevice(_FirmwareState):
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

    # ------------------------------------------------------------------ files
    def save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_private(directory / KEY_FILE, key_pem(self.leaf_key))
        (directory / CHAIN_FILE).write_bytes(_pem(self.chain_der))
        self.save_state(directory)  # last: device.json marks a complete directory

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
        leaf = x509.load_der_x509_certificate(chain[0]).public_key()
        if not isinstance(leaf, ec.EllipticCurvePublicKey) or \
                leaf.public_numbers() != key.public_key().public_numbers():
            raise BadInput(f"{directory}: the firmware key does not match the leaf certificate")
        return device


@dataclass(frozen=True)
class GpuIssuer(_FirmwareState):
    """The vendor's side of one device whose firmware key is not certified yet: the
    per-device CA (its key signs the firmware leaf) under the provisioner ICA, the identity
    CA and the vendor root, and the firmware state the vendor vouches for. Memory only."""

    ca: Authority = field(repr=False)
    chain_der: tuple[bytes, ...]  # per-device cert, provisioner ICA, identity CA, vendor root
    serial: str
    measurements: tuple[tuple[int, bytes], ...]
    driver_version: str
    vbios_version: str
    cc_mode: bool = True
    now: datetime | None = None
    days: int = DEVICE_VALID_DAYS

    def certify(self, public_key: ec.EllipticCurvePublicKey) -> tuple[bytes, ...]:
        """The 5-certificate chain (firmware leaf first) for the firmware key `public_key`."""
        fwid_ext = x509.UnrecognizedExtension(FWID_OID, fwid_of(dict(self.measurements)))
        leaf = self.ca.issue(_leaf_cn(self.serial), public_key, is_ca=False, now=self.now, days=self.days,
                             serial=self.serial, extensions=[(fwid_ext, False)])
        return (leaf, *self.chain_der)

    def certify_request(self, csr_pem: bytes) -> tuple[bytes, bytes]:
        """For a device that made its firmware key itself and sent `csr_pem`: its chain up to
        the vendor root, and the root, as PEM."""
        chain = self.certify(requested_key(csr_pem, _leaf_cn(self.serial), f"GPU {self.serial}"))
        return _pem(chain[:-1]), _pem(chain[-1:])

    def device(self, leaf_key: ec.EllipticCurvePrivateKey) -> GpuDevice:
        return GpuDevice(self.serial, self.certify(leaf_key.public_key()), leaf_key, self.measurements,
                         self.driver_version, self.vbios_version, self.cc_mode)


def enroll_gpu(directory: Path, certify: Callable[[bytes], tuple[bytes, bytes]]) -> GpuDevice:
    """Run by the device itself at boot, in the directory whose firmware state the vendor
    wrote: make its firmware key there (0600), have
    the vendor certify it (`certify`: request -> (chain without the root, root), PEM), store
    the chain and return the device. Only the request and certificates leave this process."""
    directory = Path(directory)
    try:
        serial = json.loads((directory / STATE_FILE).read_text())["serial"]
    except (OSError, ValueError, TypeError, KeyError):
        raise BadInput(f"{directory} holds no firmware state of an emulated GPU") from None
    if not isinstance(serial, str) or not _SERIAL_RE.fullmatch(serial):
        raise BadInput(f"{directory}: the firmware state names no valid serial")
    chain_pem, root_pem = certify(own_key_request(directory / KEY_FILE, _leaf_cn(serial)))
    (directory / CHAIN_FILE).write_bytes(chain_pem + root_pem)
    return GpuDevice.load(directory)


def issue_gpu_ca(
    vendor: Authority,
    *,
    serial: str = "GPU-EMU-0",
    now: datetime | None = None,
    days: int = DEVICE_VALID_DAYS,
    firmware_version: str = "1.0",
    driver_version: str = DEFAULT_DRIVER,
    vbios_version: str = DEFAULT_VBIOS,
    cc_mode: bool = True,
) -> GpuIssuer:
    """The vendor's part of provisioning a device under `vendor`: the three CAs above its
    firmware leaf, and its firmware state. `GpuIssuer.certify` then issues the leaf."""
    if not isinstance(serial, str) or not _SERIAL_RE.fullmatch(serial):
        raise BadInput("serial must be 1-64 characters from A-Z, a-z, 0-9 and '-'")
    measurements = default_measurements(firmware_version)
    identity = vendor.child("EMULATED GH100 Identity CA (not NVIDIA)", now=now, days=days)
    provisioner = identity.child("EMULATED GH100 Provisioner ICA (not NVIDIA)", now=now, days=days)
    device = provisioner.child(f"EMULATED GH100 FSP BROM {serial} (not NVIDIA)", now=now, days=days,
                               serial=serial)
    chain = (device.cert_der, provisioner.cert_der, identity.cert_der, vendor.cert_der)
    return GpuIssuer(device, chain, serial, tuple(sorted(measurements.items())), driver_version, vbios_version,
                     cc_mode, now, days)


def provision_gpu(vendor: Authority, **options: Any) -> GpuDevice:
    """Issue a device's 5-certificate chain under `vendor` and set up its firmware state, its
    firmware key made here too (options: those of `issue_gpu_ca`; for a device that makes its
    own key, see `enroll_gpu`)."""
    return issue_gpu_ca(vendor, **options).device(new_key())
