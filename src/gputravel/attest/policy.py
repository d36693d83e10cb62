"""A data holder's attestation policy: which orchestrators and GPUs it will send data to.

JSON, unknown keys refused so a typo cannot weaken it: {"format": "gputravel-holder-policy-v1",
"orchestrator_measurements": [96 hex chars, ...], "gpu": {"cc_mode": "on", "measurement_result":
"success", "driver_versions": [...], "vbios_versions": [...]} (empty or absent lists: any),
"max_evidence_age_s": 3600, "gpu_reference_values": path relative to the file (optional),
"approved_jobs": [96 hex chars, ...] (the job digests it sends data to; empty or absent: none)}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from gputravel.attest.chain import check_now
from gputravel.attest.errors import AttestationError
from gputravel.attest.quote import JOB_RTMR, MEASUREMENT_BYTES, rtmr_after
from gputravel.attest.verifier import GpuClaims
from gputravel.errors import BadInput

POLICY_FORMAT = "gputravel-holder-policy-v1"
FUTURE_SKEW_S = 300  # claims stamped up to this far in the future are tolerated (clock skew)
_TOP_KEYS = {"format", "orchestrator_measurements", "gpu", "max_evidence_age_s", "gpu_reference_values",
             "approved_jobs"}
_GPU_KEYS = {"cc_mode", "measurement_result", "driver_versions", "vbios_versions"}


@dataclass(frozen=True)
class GpuRequirements:
    """GPU claims a holder requires of the GPU its orchestrator attested."""

    driver_versions: tuple[str, ...] = ()  # empty: any
    vbios_versions: tuple[str, ...] = ()  # empty: any

    def check(self, claims: GpuClaims) -> None:
        if not claims.cc_mode:
            raise AttestationError("cc_mode", "the policy requires the GPU in CC mode")
        if claims.measurement_result != "success":
            raise AttestationError("measurement", "the policy requires GPU measurement result success")
        if self.driver_versions and claims.driver_version not in self.driver_versions:
            raise AttestationError("policy", f"GPU driver version {claims.driver_version!r} is not accepted")
        if self.vbios_versions and claims.vbios_version not in self.vbios_versions:
            raise AttestationError("policy", f"GPU VBIOS version {claims.vbios_version!r} is not accepted")


@dataclass(frozen=True)
class Policy:
    orchestrator_measurements: tuple[bytes, ...]
    gpu: GpuRequirements = field(default_factory=GpuRequirements)
    max_evidence_age_s: int = 3600
    gpu_reference_values: Path | None = None
    approved_jobs: tuple[bytes, ...] = ()  # job digests (48 bytes each) this holder sends data to; empty: none

    def check_job(self, rtmr: tuple[bytes, ...], job_digest: bytes) -> None:
        """The quoted RTMR[3] replays to `job_digest` (the orchestrator's event log) and that job is approved."""
        if not isinstance(job_digest, bytes) or len(job_digest) != MEASUREMENT_BYTES \
                or rtmr[JOB_RTMR] != rtmr_after([job_digest]):
            raise AttestationError("job", f"the quote's RTMR[{JOB_RTMR}] does not match the job the orchestrator names")
        named = job_digest.hex()  # whole: what `gputravel job approve --digest` takes
        if not self.approved_jobs:
            raise AttestationError("job", f"the orchestrator runs job {named}; this holder approved no job: "
                                          "review its manifest and run `gputravel job approve`")
        if job_digest not in self.approved_jobs:
            raise AttestationError("job", f"the orchestrator runs job {named}; this holder approved no such job")

    def check_gpu(self, claims: GpuClaims, now: datetime) -> None:
        """The GPU claims meet this policy at `now`, or AttestationError."""
        check_now(now)
        age = int(now.timestamp()) - claims.verified_at
        if age > self.max_evidence_age_s:
            raise AttestationError("expired", f"GPU attestation is {age} s old; the policy allows "
                                              f"{self.max_evidence_age_s} s")
        if age < -FUTURE_SKEW_S:
            raise AttestationError("expired", "GPU attestation is dated in the future")
        self.gpu.check(claims)

    # ------------------------------------------------------------------ JSON
    @classmethod
    def load(cls, path: Path) -> Policy:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except OSError:
            raise BadInput(f"policy {path}: cannot read the file") from None
        except ValueError as e:
            raise BadInput(f"policy {path}: invalid JSON (line {getattr(e, 'lineno', '?')})") from None
        except RecursionError:
            raise BadInput(f"policy {path}: invalid JSON (nested too deeply)") from None
        return cls.from_json(raw, base_dir=path.parent, where=f"policy {path}")

    @classmethod
    def from_json(cls, raw: object, *, base_dir: Path | None = None, where: str = "policy") -> Policy:
        if not isinstance(raw, dict):
            raise BadInput(f"{where}: expected a JSON object")
        _keys(raw, _TOP_KEYS, {"format", "orchestrator_measurements"}, where)
        if raw["format"] != POLICY_FORMAT:
            raise BadInput(f"{where}: format must be {POLICY_FORMAT!r}")
        age = raw.get("max_evidence_age_s", 3600)
        if type(age) is not int or age < 1:
            raise BadInput(f"{where}: max_evidence_age_s must be a positive integer (seconds)")
        ref = raw.get("gpu_reference_values")
        if ref is not None and not isinstance(ref, str):
            raise BadInput(f"{where}: gpu_reference_values must be a path string")
        ref_path = None if ref is None else (Path(base_dir or ".") / ref)
        return cls(_measurements(raw["orchestrator_measurements"], where),
                   _gpu(raw.get("gpu", {}), where), age, ref_path,
                   _measurements(raw.get("approved_jobs", []), where, "approved_jobs"))

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "format": POLICY_FORMAT,
            "orchestrator_measurements": [m.hex() for m in self.orchestrator_measurements],
            "gpu": {"cc_mode": "on", "measurement_result": "success",
                    "driver_versions": list(self.gpu.driver_versions),
                    "vbios_versions": list(self.gpu.vbios_versions)},
            "max_evidence_age_s": self.max_evidence_age_s,
            "approved_jobs": [j.hex() for j in self.approved_jobs],
        }
        if self.gpu_reference_values is not None:
            out["gpu_reference_values"] = str(self.gpu_reference_values)
        return out


def _keys(raw: dict, allowed: set[str], required: set[str], where: str) -> None:
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise BadInput(f"{where}: unknown keys {unknown}; allowed: {sorted(allowed)}")
    missing = sorted(required - set(raw))
    if missing:
        raise BadInput(f"{where}: missing keys {missing}")


def _measurements(raw: object, where: str, key: str = "orchestrator_measurements") -> tuple[bytes, ...]:
    if not isinstance(raw, list):
        raise BadInput(f"{where}: {key} must be a list of hex strings")
    out = []
    for i, item in enumerate(raw):
        try:
            value = bytes.fromhex(item)
        except (TypeError, ValueError):
            value = b""
        if len(value) != MEASUREMENT_BYTES:
            raise BadInput(f"{where}: {key}[{i}] must be {2 * MEASUREMENT_BYTES} hex characters")
        out.append(value)
    return tuple(out)


def _strings(raw: object, key: str, where: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(s, str) and s for s in raw):
        raise BadInput(f"{where}: gpu.{key} must be a list of non-empty strings")
    return tuple(raw)


def _gpu(raw: object, where: str) -> GpuRequirements:
    if not isinstance(raw, dict):
        raise BadInput(f"{where}: gpu must be an object")
    _keys(raw, _GPU_KEYS, set(), where + ": gpu")
    if raw.get("cc_mode", "on") != "on":
        raise BadInput(f"{where}: gpu.cc_mode must be \"on\" (a GPU outside CC mode is never accepted)")
    if raw.get("measurement_result", "success") != "success":
        raise BadInput(f"{where}: gpu.measurement_result must be \"success\"")
    return GpuRequirements(_strings(raw.get("driver_versions", []), "driver_versions", where),
                           _strings(raw.get("vbios_versions", []), "vbios_versions", where))
