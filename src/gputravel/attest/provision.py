"""Provisioning an emulated H100: its 5-certificate chain (vendor root, identity CA, provisioner
ICA, per-device CA, firmware leaf with the FWID), firmware key and reference values.

`provision_gpu` makes everything in one process. In a cohort the vendor and the device are
apart: the vendor makes the CAs (`issue_gpu_ca`) and the device makes its own firmware key at
boot and has it certified (`enroll_gpu`); a per-party service saves the issuer once and
discards it after its first use (`GpuIssuer.save`, `GpuIssuer.discard`).
"""

from __future__ import annotations

import dataclasses
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
from gputravel.crypto.certs import key_matches, key_pem, load_key, new_key, own_key_request, requested_key
from gputravel.crypto.certs import write_private
from gputravel.crypto.device_identity import DEVICE_VALID_DAYS
from gputravel.errors import BadInput
from gputravel.files import atomic_write_bytes, write_json

CHAIN_FILE, KEY_FILE = "device-chain.pem", "device-firmware.key"
STATE_FILE, REFERENCE_FILE = "device.json", "reference-values.json"
ISSUER_KEY, ISSUER_CHAIN, ISSUER_STATE = "vendor-ca.key", "vendor-chain.pem", "vendor.json"
DEFAULT_DRIVER, DEFAULT_VBIOS = "550.54.15-emulated", "96.00.9F.00.04-emulated"
_SERIAL_RE = re.compile(r"[A-Za-z0-9-]{1,64}")


def _leaf_cn(serial: str) -> str:
    return f"EMULATED GH100 GSP-FMC LF {serial} (not NVIDIA)"


def _pem(chain_der: tuple[bytes, ...]) -> bytes:
    return b"".join(x509.load_der_x509_certificate(d).public_bytes(serialization.Encoding.PEM) for d in chain_der)


def _der_chain(pem: bytes) -> tuple[bytes, ...]:
    return tuple(c.public_bytes(serialization.Encoding.DER) for c in x509.load_pem_x509_certificates(pem))


@dataclass(frozen=True)
class _FirmwareState:
    """What a device's firmware measures and reports (public): the vendor's and the device's view."""

    serial: str
    measurements: tuple[tuple[int, bytes], ...]
    driver_version: str
    vbios_version: str
    cc_mode: bool

    @staticmethod
    def _parse(state: dict[str, Any]) -> dict[str, Any]:
        """The fields from what `_state` wrote; ValueError, TypeError or KeyError for anything else."""
        fields = {k: state[k] for k in ("serial", "driver_version", "vbios_version", "cc_mode")}
        if not isinstance(fields["serial"], str) or not _SERIAL_RE.fullmatch(fields["serial"]):
            raise ValueError("serial")
        if not isinstance(fields["driver_version"], str) or not isinstance(fields["vbios_version"], str) \
                or not isinstance(fields["cc_mode"], bool):
            raise TypeError("versions or cc_mode")
        measurements = {int(k): bytes.fromhex(v) for k, v in state["measurements"].items()}
        return {**fields, "measurements": tuple(sorted(measurements.items()))}

    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(_FirmwareState)}

    def reference_values(self) -> ReferenceValues:
        return ReferenceValues.of(dict(self.measurements), self.driver_version, self.vbios_version)

    def _state(self) -> dict[str, Any]:
        return {"serial": self.serial, "driver_version": self.driver_version,
                "vbios_version": self.vbios_version, "cc_mode": self.cc_mode,
                "measurements": {str(i): d.hex() for i, d in self.measurements}}

    def save_state(self, directory: Path) -> None:
        """device.json and reference-values.json (no key, no chain)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.reference_values().save(directory / REFERENCE_FILE)
        (directory / STATE_FILE).write_text(json.dumps(self._state(), indent=2) + "\n")


@dataclass(frozen=True, kw_only=True)
class GpuDevice(_FirmwareState):
    """One provisioned emulated GPU: what its firmware holds."""

    chain_der: tuple[bytes, ...]  # firmware leaf first, vendor root last
    leaf_key: ec.EllipticCurvePrivateKey = field(repr=False)

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
            state = cls._parse(json.loads((directory / STATE_FILE).read_text()))
            chain = _der_chain((directory / CHAIN_FILE).read_bytes())
            key = load_key((directory / KEY_FILE).read_bytes())
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            raise BadInput(f"{directory} does not hold a readable emulated GPU device") from None
        if len(chain) != 5:
            raise BadInput(f"{directory}: device key or certificate chain is malformed")
        if not key_matches(x509.load_der_x509_certificate(chain[0]), key):
            raise BadInput(f"{directory}: the firmware key does not match the leaf certificate")
        return cls(**state, chain_der=chain, leaf_key=key)


@dataclass(frozen=True, kw_only=True)
class GpuIssuer(_FirmwareState):
    """The vendor's side of a device whose firmware key is not certified yet: the per-device CA
    and its chain, and the firmware state the vendor vouches for."""

    ca: Authority = field(repr=False)
    chain_der: tuple[bytes, ...]  # per-device cert, provisioner ICA, identity CA, vendor root
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
        return GpuDevice(**self._fields(), chain_der=self.certify(leaf_key.public_key()), leaf_key=leaf_key)

    # ------------------------------------------------------------------ files
    def save(self, directory: Path) -> None:
        """The per-device CA's key (0600), its chain up to the vendor root and the firmware
        state, for a gpu service to certify the firmware key its device makes at first start."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_private(directory / ISSUER_KEY, key_pem(self.ca.key))
        atomic_write_bytes(directory / ISSUER_CHAIN, _pem(self.chain_der))
        # `now` pins certificate times (tests); None means "when the leaf is issued".
        extra = {"days": self.days, "now": self.now.isoformat() if self.now is not None else None}
        write_json(directory / ISSUER_STATE, {**self._state(), **extra})  # last: marks a complete directory

    @staticmethod
    def exists(directory: Path) -> bool:
        return (Path(directory) / ISSUER_STATE).exists() and (Path(directory) / ISSUER_KEY).exists()

    @classmethod
    def load(cls, directory: Path) -> GpuIssuer:
        directory = Path(directory)
        try:
            state = json.loads((directory / ISSUER_STATE).read_text())
            fields = cls._parse(state)
            days, now = state["days"], state["now"]
            now = datetime.fromisoformat(now) if now is not None else None
            chain = _der_chain((directory / ISSUER_CHAIN).read_bytes())
            key = load_key((directory / ISSUER_KEY).read_bytes())
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            raise BadInput(f"{directory} does not hold a readable GPU vendor CA (already used?)") from None
        if type(days) is not int or days < 1 or len(chain) != 4:
            raise BadInput(f"{directory}: the GPU vendor CA's validity or certificate chain is malformed")
        if not key_matches(x509.load_der_x509_certificate(chain[0]), key):
            raise BadInput(f"{directory}: the GPU vendor CA's key does not match its certificate")
        return cls(**fields, ca=Authority(chain[0], key), chain_der=chain, now=now, days=days)

    @staticmethod
    def discard(directory: Path) -> None:
        """Delete what `save` wrote, key first: used once, so that nothing on this machine can
        later certify another firmware key as this GPU. The directory goes too if now empty."""
        directory = Path(directory)
        for name in (ISSUER_KEY, ISSUER_STATE, ISSUER_CHAIN):
            (directory / name).unlink(missing_ok=True)
        try:
            directory.rmdir()
        except OSError:
            pass  # missing already, or holds files that are not ours: leave them


def enroll_gpu(directory: Path, certify: Callable[[bytes], tuple[bytes, bytes]]) -> GpuDevice:
    """Run by the device at boot: make its firmware key (0600) where the vendor wrote its state,
    have `certify` sign the request ((chain less root, root) PEM); the key never leaves."""
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


def issue_gpu_ca(vendor: Authority, *, serial: str = "GPU-EMU-0", now: datetime | None = None,
                 days: int = DEVICE_VALID_DAYS, firmware_version: str = "1.0", driver_version: str = DEFAULT_DRIVER,
                 vbios_version: str = DEFAULT_VBIOS, cc_mode: bool = True) -> GpuIssuer:
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
    return GpuIssuer(serial, tuple(sorted(measurements.items())), driver_version, vbios_version, cc_mode,
                     ca=device, chain_der=chain, now=now, days=days)


def provision_gpu(vendor: Authority, **options: Any) -> GpuDevice:
    """Issue a device's 5-certificate chain under `vendor` and set up its firmware state, its
    firmware key made here too (options: those of `issue_gpu_ca`; for a device that makes its
    own key, see `enroll_gpu`)."""
    return issue_gpu_ca(vendor, **options).device(new_key())
