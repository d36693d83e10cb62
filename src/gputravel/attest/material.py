"""What each party reads from its own trust directory (paper 4.5), written by the launcher
(cohort/trust.py): here, below the parties and the launcher, so all read the same files by
the same names."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from gputravel.attest.errors import CLAIMS, AttestationError
from gputravel.attest.gpu import ReferenceValues
from gputravel.attest.policy import Policy
from gputravel.attest.provision import REFERENCE_FILE, GpuDevice, enroll_gpu
from gputravel.attest.roots import TrustStore
from gputravel.crypto.device_identity import DeviceIdentity
from gputravel.errors import BadInput

__all__ = ["LIMITS_FILE", "POLICY_FILE", "REFERENCE_FILE", "DeviceMaterial", "HolderMaterial",
           "OrchestratorMaterial", "attestation_error_from", "utcnow"]

POLICY_FILE = "policy.json"
LIMITS_FILE = "attestation.json"


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


# ----------------------------------------------------------------------------- each process's share
@dataclass(frozen=True)
class DeviceMaterial:
    """What the device process holds: its SPDM identity and its attestation firmware."""

    device: GpuDevice

    @classmethod
    def enroll(cls, directory: str, certify: Callable[[bytes], tuple[bytes, bytes]]) -> DeviceMaterial:
        """Run by the device process at boot: make its firmware key in `directory`, have the
        vendor (the launcher) certify it over `certify` (attest.enroll_gpu)."""
        if not directory:
            raise BadInput("the device has no provisioned firmware state (gpu_dir is empty)")
        return cls(enroll_gpu(Path(directory), certify))

    def identity(self) -> DeviceIdentity:
        # The SPDM responder signs with the firmware leaf key, under the 5-certificate chain.
        return DeviceIdentity(self.device.leaf_key, self.device.chain_der)


@dataclass(frozen=True)
class OrchestratorMaterial:
    """The orchestrator's share: roots, reference values, GPU claims' age limit, and where its
    TDX module listens (it holds no quoting key)."""

    trust: TrustStore
    reference: ReferenceValues
    max_evidence_age_s: int
    quoting_socket: str = ""

    @classmethod
    def load(cls, directory: str) -> OrchestratorMaterial:
        if not directory:
            raise BadInput("the orchestrator has no trust material (trust_dir is empty): it cannot attest the GPU")
        path = Path(directory)
        try:
            limits = json.loads((path / LIMITS_FILE).read_text())
        except (OSError, ValueError):
            raise BadInput(f"{path}: attestation limits missing or unreadable") from None
        if not isinstance(limits, dict) or type(limits.get("max_evidence_age_s")) is not int or \
                not isinstance(limits.get("quoting_socket", ""), str):
            raise BadInput(f"{path}: malformed attestation limits")
        return cls(TrustStore.load(path), ReferenceValues.load(path / REFERENCE_FILE), limits["max_evidence_age_s"],
                   limits.get("quoting_socket", ""))


@dataclass(frozen=True)
class HolderMaterial:
    """What a holder holds: the roots it trusts, its policy (the pinned orchestrator) and the
    GPU's reference values, to verify the GPU's own evidence."""

    trust: TrustStore
    policy: Policy
    reference: ReferenceValues

    @classmethod
    def load(cls, directory: str) -> HolderMaterial:
        if not directory:
            raise BadInput("this holder has no trust material (trust_dir is empty): it will not join an "
                           "orchestrator it cannot attest")
        path = Path(directory)
        policy = Policy.load(path / POLICY_FILE)
        return cls(TrustStore.load(path), policy,
                   ReferenceValues.load(policy.gpu_reference_values or path / REFERENCE_FILE))


# ----------------------------------------------------------------------------- errors across processes
_REASON = re.compile(r"attestation failed \[(\w+)\]: (.*)", re.DOTALL)


def attestation_error_from(kind: str, reason: str, where: str) -> AttestationError | None:
    """Rebuild the AttestationError a child reported (control `Failed`), claim included."""
    if kind != "AttestationError":
        return None
    found = _REASON.search(reason)
    if found is None or found.group(1) not in CLAIMS:
        return None
    return AttestationError(found.group(1), f"{where}: {found.group(2)}")
