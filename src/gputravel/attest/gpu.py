"""GPU evidence, H100-style: a GET_MEASUREMENTS exchange signed by the firmware leaf key, and the
pure device side that answers it (`EmulatedGpuFirmware`). Wire format in docs/attestation.md;
opaque types follow NVIDIA's table except CC mode (0x8001), which a real H100 reports via NVML."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import msgpack
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.attest.chain import leaf_fwid, sha384, sign_p384
from gputravel.errors import BadInput
from gputravel.protocol.codec import Message, encode

NONCE_BYTES = 32
DIGEST_BYTES = 48
MAX_OPAQUE_BYTES = 0xFFFF
REFERENCE_FORMAT = "gputravel-gpu-reference-values-v1"
_COMPONENTS = ("FSP", "GSP-FMC", "GSP-RM", "SEC2", "VBIOS", "PMU", "CC config", "driver ucode")

Rng = Callable[[int], bytes]


class OpaqueType(IntEnum):
    DRIVER_VERSION = 3
    VBIOS_VERSION = 6
    FWID = 20
    CC_MODE = 0x8001  # gputravel's own; value b"\x01" when CC mode is on


# ----------------------------------------------------------------------------- messages
class GetMeasurements(Message, tag="attest.gpu.get_measurements"):
    nonce: bytes


class MeasurementBlock(Message, tag="attest.gpu.block"):
    index: int
    digest: bytes


class OpaqueField(Message, tag="attest.gpu.opaque"):
    type: int
    value: bytes


class Measurements(Message, tag="attest.gpu.measurements"):
    responder_nonce: bytes
    blocks: tuple[MeasurementBlock, ...]
    opaque: tuple[OpaqueField, ...]


class GpuEvidence(Message, tag="attest.gpu.evidence"):
    request: bytes
    response: bytes
    signature: bytes
    cert_chain: tuple[bytes, ...]


# ----------------------------------------------------------------------------- measurements
def default_measurements(firmware_version: str = "1.0") -> dict[int, bytes]:
    """Deterministic stand-in digests of the emulated firmware's components, by index."""
    return {
        i: sha384(f"gputravel emulated H100 firmware {firmware_version}: {name}".encode())
        for i, name in enumerate(_COMPONENTS, start=1)
    }


def fwid_of(measurements: Mapping[int, bytes]) -> bytes:
    """The FWID of a firmware build: SHA-384 over its measurements (msgpack, by index)."""
    return sha384(msgpack.packb(sorted([i, d] for i, d in measurements.items()), use_bin_type=True))


def check_measurements(measurements: Mapping[int, bytes]) -> dict[int, bytes]:
    if not isinstance(measurements, Mapping) or not measurements:
        raise BadInput("measurements must be a non-empty mapping of index -> digest")
    out = {}
    for index, digest in measurements.items():
        if type(index) is not int or not 0 < index < 255:
            raise BadInput("measurement indices must be integers 1..254")
        if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
            raise BadInput(f"measurement {index} must be a {DIGEST_BYTES}-byte SHA-384 digest")
        out[index] = digest
    return out


@dataclass(frozen=True)
class ReferenceValues:
    """Golden values a verifier compares a report with (the emulation's stand-in for RIMs)."""

    measurements: tuple[tuple[int, bytes], ...]
    driver_version: str
    vbios_version: str

    @classmethod
    def of(cls, measurements: Mapping[int, bytes], driver_version: str, vbios_version: str) -> ReferenceValues:
        checked = check_measurements(measurements)
        return cls(tuple(sorted(checked.items())), driver_version, vbios_version)

    def as_dict(self) -> dict[int, bytes]:
        return dict(self.measurements)

    def to_json(self) -> dict[str, object]:
        return {
            "format": REFERENCE_FORMAT,
            "emulated": True,
            "driver_version": self.driver_version,
            "vbios_version": self.vbios_version,
            "measurements": {str(i): d.hex() for i, d in self.measurements},
        }

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> ReferenceValues:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested too deeply
            raise BadInput(f"{path}: cannot read reference values (missing file or invalid JSON)") from None
        return cls.from_json(raw, str(path))

    @classmethod
    def from_json(cls, raw: object, where: str = "reference values") -> ReferenceValues:
        keys = {"format", "emulated", "driver_version", "vbios_version", "measurements"}
        if not isinstance(raw, dict) or set(raw) != keys or raw["format"] != REFERENCE_FORMAT:
            raise BadInput(f"{where}: expected a {REFERENCE_FORMAT} object with keys {sorted(keys)}")
        if not isinstance(raw["driver_version"], str) or not isinstance(raw["vbios_version"], str):
            raise BadInput(f"{where}: driver_version and vbios_version must be strings")
        table = raw["measurements"]
        if not isinstance(table, dict):
            raise BadInput(f"{where}: measurements must map index to hex digest")
        try:
            parsed = {int(k): bytes.fromhex(v) for k, v in table.items()}
        except (ValueError, TypeError):
            raise BadInput(f"{where}: measurements must map decimal index to hex digest") from None
        return cls.of(parsed, raw["driver_version"], raw["vbios_version"])


# ----------------------------------------------------------------------------- firmware
class EmulatedGpuFirmware:
    """The device side of GET_MEASUREMENTS. Another `fwid` than the leaf certificate's emulates
    firmware that no longer matches it."""

    def __init__(self, *, leaf_key: ec.EllipticCurvePrivateKey, cert_chain: tuple[bytes, ...],
                 measurements: Mapping[int, bytes], driver_version: str, vbios_version: str, cc_mode: bool = True,
                 fwid: bytes | None = None, rng: Rng = os.urandom) -> None:
        if not isinstance(leaf_key, ec.EllipticCurvePrivateKey) or not cert_chain:
            raise BadInput("firmware needs its leaf key and certificate chain")
        self._key = leaf_key
        self._chain = tuple(cert_chain)
        self._measurements = check_measurements(measurements)
        leaf = x509.load_der_x509_certificate(self._chain[0])
        self._fwid = leaf_fwid(leaf) if fwid is None else fwid
        self._opaque = (
            OpaqueField(OpaqueType.DRIVER_VERSION, driver_version.encode()),
            OpaqueField(OpaqueType.VBIOS_VERSION, vbios_version.encode()),
            OpaqueField(OpaqueType.FWID, self._fwid),
            OpaqueField(OpaqueType.CC_MODE, b"\x01" if cc_mode else b"\x00"),
        )
        self._rng = rng

    def __repr__(self) -> str:
        return f"EmulatedGpuFirmware(fwid={self._fwid.hex()[:16]}..., blocks={len(self._measurements)})"

    def get_evidence(self, nonce: bytes) -> GpuEvidence:
        """Answer GET_MEASUREMENTS for `nonce` (32 bytes) with signed evidence."""
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            raise BadInput(f"nonce must be {NONCE_BYTES} bytes")
        request = encode(GetMeasurements(nonce))
        blocks = tuple(MeasurementBlock(i, d) for i, d in sorted(self._measurements.items()))
        response = encode(Measurements(self._rng(NONCE_BYTES), blocks, self._opaque))
        return GpuEvidence(request, response, sign_p384(self._key, request + response), self._chain)
