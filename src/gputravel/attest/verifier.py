"""Verifiers: the interface, and the emulated GPU verifier behind it. Pure: evidence, a challenge
and `now` in; claims or AttestationError out. It follows nv-local-gpu-verifier's order and
claim names (chain, signature, nonce, FWID, measurements), plus CC mode."""

from __future__ import annotations

import hashlib
import hmac
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import datetime
from typing import Generic, TypeVar, cast

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.attest.chain import check_now, common_name, leaf_fwid, sha384, verify_chain, verify_p384
from gputravel.attest.errors import AttestationError, ClaimTracker
from gputravel.attest.gpu import (
    DIGEST_BYTES,
    MAX_OPAQUE_BYTES,
    NONCE_BYTES,
    GetMeasurements,
    GpuEvidence,
    Measurements,
    OpaqueType,
    ReferenceValues,
)
from gputravel.attest.roots import TrustStore
from gputravel.errors import BadInput
from gputravel.protocol.codec import Message

C = TypeVar("C")
GPU_CHAIN_LENGTH = 5
HWMODEL = "EMULATED GH100 (gputravel, not NVIDIA)"


class EAT:
    """Claim names in the style of NVIDIA's local verifier (x-gputravel-* where it has none)."""

    OVERALL = "x-nvidia-overall-att-result"
    NONCE = "eat_nonce"
    PARSED = "x-nvidia-gpu-attestation-report-parsed"
    CHAIN = "x-nvidia-gpu-attestation-report-cert-chain-validated"
    SIGNATURE = "x-nvidia-gpu-attestation-report-signature-verified"
    NONCE_MATCH = "x-nvidia-gpu-attestation-report-nonce-match"
    FWID_MATCH = "x-nvidia-gpu-attestation-report-cert-chain-fwid-match"
    MEASRES = "measres"
    MISMATCHED = "x-nvidia-mismatch-measurement-records"
    DRIVER = "x-nvidia-gpu-driver-version"
    VBIOS = "x-nvidia-gpu-vbios-version"
    CC_MODE = "x-gputravel-gpu-cc-mode"
    EMULATED = "x-gputravel-emulated"
    EVIDENCE = "x-gputravel-evidence-sha384"


class Verifier(ABC, Generic[C]):
    """Turns evidence into claims, or raises AttestationError naming the failed claim."""

    @abstractmethod
    def verify(self, evidence: bytes, challenge: bytes, now: datetime) -> C:
        """`challenge` is what the evidence must answer: the 32-byte nonce for GPU evidence,
        the 64-byte expected report data for a CVM quote."""


class GpuClaims(Message, tag="attest.gpu.claims"):
    """A verified GPU's claims (only produced when every check passed)."""

    nonce: bytes
    evidence_digest: bytes  # SHA-384 of the encoded GpuEvidence
    ueid: str  # device serial from the per-device certificate
    hwmodel: str
    driver_version: str
    vbios_version: str
    fwid: bytes
    cc_mode: bool
    measurement_result: str  # "success"
    verified_at: int  # unix seconds, the `now` it was verified at
    emulated: bool

    def eat(self) -> dict[str, object]:
        return {
            EAT.OVERALL: True, EAT.NONCE: self.nonce.hex(), "iat": self.verified_at,
            "hwmodel": self.hwmodel, "ueid": self.ueid,
            EAT.PARSED: True, EAT.CHAIN: True, EAT.SIGNATURE: True, EAT.NONCE_MATCH: True,
            EAT.FWID_MATCH: True, EAT.MEASRES: self.measurement_result,
            EAT.DRIVER: self.driver_version, EAT.VBIOS: self.vbios_version,
            EAT.CC_MODE: "on" if self.cc_mode else "off",
            EAT.EMULATED: self.emulated, EAT.EVIDENCE: self.evidence_digest.hex(),
        }


_ON_FAIL = {"format": (EAT.PARSED, False), "chain": (EAT.CHAIN, False), "expired": (EAT.CHAIN, False),
            "signature": (EAT.SIGNATURE, False), "nonce": (EAT.NONCE_MATCH, False),
            "fwid": (EAT.FWID_MATCH, False), "cc_mode": (EAT.CC_MODE, "off"),
            "measurement": (EAT.MEASRES, "fail")}


class EmulatedGpuVerifier(Verifier[GpuClaims]):
    """Verifies emulated H100 evidence against the trusted vendor root and reference values."""

    def __init__(self, trust: TrustStore, reference: ReferenceValues) -> None:
        if not isinstance(trust, TrustStore) or not isinstance(reference, ReferenceValues):
            raise BadInput("EmulatedGpuVerifier needs a TrustStore and ReferenceValues")
        self._trust = trust
        self._reference = reference

    def verify(self, evidence: bytes, challenge: bytes, now: datetime) -> GpuClaims:
        check_now(now)
        if not isinstance(challenge, bytes) or len(challenge) != NONCE_BYTES:
            raise BadInput(f"the GPU nonce must be {NONCE_BYTES} bytes")
        p = ClaimTracker({EAT.OVERALL: False, EAT.NONCE: challenge.hex(), EAT.EMULATED: True}, _ON_FAIL)
        digest = sha384(bytes(evidence))
        p.ok(EAT.EVIDENCE, digest.hex())
        ev = p.decode(evidence, GpuEvidence, "GPU evidence")
        try:
            leaf = verify_chain(ev.cert_chain, self._trust.gpu_roots, now, what="GPU",
                                length=GPU_CHAIN_LENGTH)
        except AttestationError as e:
            p.reraise(e)
        p.ok(EAT.CHAIN)
        if not verify_p384(leaf.public_key(), ev.signature, ev.request + ev.response):
            p.fail("signature", "report signature does not verify with the firmware leaf key")
        p.ok(EAT.SIGNATURE)
        request = p.decode(ev.request, GetMeasurements, "GPU request")
        response = p.decode(ev.response, Measurements, "GPU response")
        blocks, opaque = _parse_report(p, response)
        p.ok(EAT.PARSED)
        if not hmac.compare_digest(request.nonce, challenge):
            p.fail("nonce", "the evidence answers another nonce (stale or replayed)")
        p.ok(EAT.NONCE_MATCH)
        fwid = _check_fwid(p, leaf, opaque[OpaqueType.FWID])
        driver, vbios = opaque[OpaqueType.DRIVER_VERSION].decode(), opaque[OpaqueType.VBIOS_VERSION].decode()
        p.ok(EAT.DRIVER, driver)
        p.ok(EAT.VBIOS, vbios)
        if opaque[OpaqueType.CC_MODE] != b"\x01":
            p.fail("cc_mode", "the GPU is not in confidential-computing mode")
        p.ok(EAT.CC_MODE, "on")
        self._check_measurements(p, blocks, driver, vbios)
        return GpuClaims(
            nonce=challenge, evidence_digest=digest, ueid=gpu_identity(ev.cert_chain),
            hwmodel=HWMODEL, driver_version=driver, vbios_version=vbios, fwid=fwid, cc_mode=True,
            measurement_result="success", verified_at=int(now.timestamp()), emulated=True,
        )

    def _check_measurements(self, p: ClaimTracker, blocks: dict[int, bytes], driver: str, vbios: str) -> None:
        ref = self._reference
        if driver != ref.driver_version or vbios != ref.vbios_version:
            p.fail("measurement", "driver or VBIOS version differs from the reference values'")
        expected = ref.as_dict()
        mismatched = sorted(i for i in expected.keys() | blocks.keys()
                            if expected.get(i) is None or blocks.get(i) != expected[i])
        if mismatched:
            first = mismatched[0]
            what = "is missing from the report" if first not in blocks else (
                "is not in the reference values" if first not in expected else "does not match its reference value")
            p.fail("measurement", f"measurement index {first} {what} (mismatched: {mismatched})",
                   **{EAT.MISMATCHED: mismatched})
        p.ok(EAT.MEASRES, "success")


def spdm_chain_verifier(trust: TrustStore, now: datetime) -> Callable[[tuple[bytes, ...]], ec.EllipticCurvePublicKey]:
    """SpdmRequester's `verify_chain`: the device's chain must reach the trusted vendor root at
    `now`; the firmware leaf key, which then signs the key exchange."""
    check_now(now)

    def verify(chain_der: tuple[bytes, ...]) -> ec.EllipticCurvePublicKey:
        leaf = verify_chain(chain_der, trust.gpu_roots, now, what="GPU", length=GPU_CHAIN_LENGTH)
        return cast(ec.EllipticCurvePublicKey, leaf.public_key())  # verify_chain read it: P-384

    return verify


# ----------------------------------------------------------------------------- helpers
_REQUIRED_OPAQUE = (OpaqueType.DRIVER_VERSION, OpaqueType.VBIOS_VERSION, OpaqueType.FWID, OpaqueType.CC_MODE)


def _parse_report(p: ClaimTracker, response: Measurements) -> tuple[dict[int, bytes], dict[int, bytes]]:
    blocks: dict[int, bytes] = {}
    for b in response.blocks:
        if not 0 < b.index < 255 or b.index in blocks or len(b.digest) != DIGEST_BYTES:
            p.fail("format", "measurement blocks must have unique indices 1..254 and 48-byte digests")
        blocks[b.index] = b.digest
    opaque: dict[int, bytes] = {}
    for f in response.opaque:
        if not 0 <= f.type <= 0xFFFF or f.type in opaque or len(f.value) > MAX_OPAQUE_BYTES:
            p.fail("format", "opaque fields must have unique u16 types and at most 65535 bytes")
        opaque[f.type] = f.value
    missing = [t.name for t in _REQUIRED_OPAQUE if t not in opaque]
    if missing:
        p.fail("format", f"report lacks opaque fields {missing}")
    try:
        opaque[OpaqueType.DRIVER_VERSION].decode()
        opaque[OpaqueType.VBIOS_VERSION].decode()
    except UnicodeDecodeError:
        p.fail("format", "driver or VBIOS version is not UTF-8")
    if opaque[OpaqueType.CC_MODE] not in (b"\x00", b"\x01"):
        p.fail("format", "CC mode opaque field must be one byte, 0 or 1")
    return blocks, opaque


def _check_fwid(p: ClaimTracker, leaf: x509.Certificate, report_fwid: bytes) -> bytes:
    try:
        cert_fwid = leaf_fwid(leaf)
    except AttestationError as e:
        p.reraise(e)
    if not hmac.compare_digest(cert_fwid, report_fwid):
        p.fail("fwid", f"FWID in the report differs from the one in {common_name(leaf)}")
    p.ok(EAT.FWID_MATCH)
    return cert_fwid


#: A serial shown as it is (X.520's 64 characters at most); any other (look-alikes, control
#: characters) is replaced by a fingerprint, so no two GPUs read alike and no terminal acts on it.
_SERIAL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def gpu_identity(device_chain: tuple[bytes, ...]) -> str:
    """The GPU's name (UEID, and in the travel log): the serial its per-device certificate
    carries, stable across firmware keys; else (none, or outside _SERIAL) its SHA-256."""
    try:
        serials = x509.load_der_x509_certificate(device_chain[1]).subject.get_attributes_for_oid(
            x509.NameOID.SERIAL_NUMBER)
        serial = str(serials[0].value) if serials else ""
    except ValueError:  # a name the library decodes only when read (an odd string type): no serial
        serial = ""
    if _SERIAL.fullmatch(serial):
        return serial
    return "sha256:" + hashlib.sha256(device_chain[1]).hexdigest()
