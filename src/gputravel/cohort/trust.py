"""A cohort's trust material (paper 4.5): who gets which part of the chain of trust (trust/roots,
device, orchestrator, holders/NAME). No CVM ever holds a root's key, the quoting key or the GPU's
firmware key: the CPU-TEE root and the GPU's per-device CA stay in the launcher's memory until they
certify the keys the TDX module and the device made themselves, and are dropped then.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives import serialization

from gputravel.attest import (
    Authority, GpuIssuer, GpuRequirements, Policy, init_roots, issue_gpu_ca, load_authority, orchestrator_measurement,
)
from gputravel.attest.material import LIMITS_FILE, POLICY_FILE, REFERENCE_FILE
from gputravel.attest.roots import GPU_ROOT_CERT, GPU_ROOT_KEY, TEE_ROOT_CERT, TEE_ROOT_KEY
from gputravel.attest.roots import GPU_VENDOR_ROOT_CN, TEE_QUOTING_ROOT_CN
from gputravel.errors import BadInput
from gputravel.orchestrator.job import job_digest

if TYPE_CHECKING:
    from gputravel.orchestrator.cvm import OrchestratorConfig

__all__ = ["CohortTrust", "SharedRoots", "TrustOptions", "certify_device", "measure_orchestrator", "measured_config",
           "pin_orchestrator", "provision_cohort_trust"]

#: Where the orchestrator runs, not what it does: left out of its measurement so a holder's pin holds
#: wherever the cohort is placed. Every other field, an unknown new one too, is measured.
PLACEMENT_FIELDS = frozenset({"host_socket", "pki_dir", "trust_dir", "listen_host", "listen_port", "pace_mbit",
                              "audit_log", "broker_socket"})
#: The job it runs: left out of its measurement (MRTD) too, because the orchestrator measures it into
#: RTMR[3] at boot instead (orchestrator/job.py), which holders approve by digest (policy approved_jobs).
JOB_FIELDS = frozenset({"job_json", "manifest_json"})
GPU_VENDORS = ("cohort", "foreign")
_HEX96 = re.compile(r"[0-9a-f]{96}")


# ----------------------------------------------------------------------------- options
@dataclass(frozen=True)
class TrustOptions:
    """The defaults give an honest cohort; each other value breaks one link on purpose, to be refused."""

    max_evidence_age_s: int = 3600  # holders' limit on the age of the orchestrator's GPU attestation
    # Measurements (hex) the holders' policies accept; None: the orchestrator being launched.
    pinned_measurements: tuple[str, ...] | None = None
    # Orchestrator configuration changes made *after* the holders pinned it (field, value).
    orchestrator_changes: tuple[tuple[str, object], ...] = ()
    gpu_vendor: str = "cohort"  # "foreign": the GPU chains to a vendor root nobody trusts
    gpu_cc_mode: bool = True
    # Job digests (hex) the holders' policies approve; None: the job being launched's.
    approved_jobs: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if type(self.max_evidence_age_s) is not int or self.max_evidence_age_s < 2:
            raise BadInput("max_evidence_age_s must be an integer of at least 2 seconds")
        if self.gpu_vendor not in GPU_VENDORS:
            raise BadInput(f"gpu_vendor must be one of {GPU_VENDORS}, not {self.gpu_vendor!r}")
        for m in self.pinned_measurements or ():
            if not isinstance(m, str) or not _HEX96.fullmatch(m):
                raise BadInput("pinned measurements must be 96 lower-case hex characters each")
        for j in self.approved_jobs or ():
            if not isinstance(j, str) or not _HEX96.fullmatch(j):
                raise BadInput("approved jobs must be 96 lower-case hex characters each")
        for change in self.orchestrator_changes:
            if not (isinstance(change, tuple) and len(change) == 2 and isinstance(change[0], str)):
                raise BadInput("orchestrator_changes must be (field name, value) pairs")


# ----------------------------------------------------------------------------- measurement
def measured_config(config: OrchestratorConfig) -> dict[str, object]:
    """What goes into the orchestrator's MRTD: every field but its placement and its job."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in PLACEMENT_FIELDS | JOB_FIELDS}


def measure_orchestrator(config: OrchestratorConfig) -> bytes:
    return orchestrator_measurement(measured_config(config))


# ----------------------------------------------------------------------------- provisioning
@dataclass(frozen=True)
class CohortTrust:
    """Where each process's share of the trust material lies, and what the holders pinned."""

    root: Path
    gpu_serial: str
    gpu_driver: str
    pinned: tuple[bytes, ...] = ()
    approved: tuple[bytes, ...] = ()  # the job digests the holders' policies approve
    # The CPU-TEE root, in the launcher's memory only, until it certifies the TDX module's key.
    tee_root: Authority | None = field(default=None, repr=False, compare=False)
    # The GPU vendor's CA for this device, in memory only, until it certifies the device's key.
    gpu_vendor: GpuIssuer | None = field(default=None, repr=False, compare=False)

    @property
    def device_dir(self) -> Path:
        return self.root / "device"

    @property
    def orchestrator_dir(self) -> Path:
        return self.root / "orchestrator"

    def holder_dir(self, name: str) -> Path:
        return self.root / "holders" / name


@dataclass(frozen=True)
class SharedRoots:
    """The vendor roots several GPUs' cohorts share, in memory only: no key of theirs reaches disk."""

    gpu: Authority = field(repr=False)
    tee: Authority = field(repr=False)

    @classmethod
    def make(cls, now: datetime | None = None) -> SharedRoots:
        return cls(Authority.self_signed(GPU_VENDOR_ROOT_CN, now=now), Authority.self_signed(TEE_QUOTING_ROOT_CN, now=now))

    def write_certificates(self, directory: Path) -> None:
        directory.mkdir(parents=True)
        for auth, name in ((self.gpu, GPU_ROOT_CERT), (self.tee, TEE_ROOT_CERT)):
            (directory / name).write_bytes(auth.cert.public_bytes(serialization.Encoding.PEM))


def provision_cohort_trust(directory: Path, *, options: TrustOptions, now: datetime | None = None,
                           quoting_socket: str = "", roots_from: SharedRoots | None = None,
                           gpu_index: int = 0) -> CohortTrust:
    """The roots (fresh or `roots_from`), GPU-EMU-`gpu_index`'s CAs, the device's and orchestrator's shares."""
    directory = Path(directory)
    roots = directory / "roots"
    if roots_from is not None:
        roots_from.write_certificates(roots)
    shared = roots_from if roots_from is not None else _fresh_roots(roots, now)
    gpu = _provision_device(directory, shared.gpu, options, now, gpu_index)
    gpu.save_state(directory / "device")
    gpu.reference_values().save(roots / REFERENCE_FILE)  # what the vendor publishes: the launcher's copy
    _private_dir(directory / "orchestrator", roots)
    limits = {"max_evidence_age_s": options.max_evidence_age_s, "quoting_socket": quoting_socket}
    (directory / "orchestrator" / LIMITS_FILE).write_text(json.dumps(limits) + "\n")
    return CohortTrust(directory, gpu.serial, gpu.driver_version, tee_root=shared.tee, gpu_vendor=gpu)


def _fresh_roots(roots: Path, now: datetime | None) -> SharedRoots:
    """This cohort's own roots, read back into memory and their keys deleted from the disk at once."""
    init_roots(roots, now=now)
    made = SharedRoots(load_authority(roots, "gpu"), load_authority(roots, "tee"))
    for name in (GPU_ROOT_KEY, TEE_ROOT_KEY):
        (roots / name).unlink()
    return made


def certify_device(trust: CohortTrust, csr_pem: bytes) -> tuple[CohortTrust, tuple[bytes, bytes]]:
    """The vendor certifies the device's firmware key and its CA is dropped: (trust, (chain, root))."""
    if trust.gpu_vendor is None:
        raise BadInput("the GPU vendor's CA is gone: nothing can certify a firmware key")
    issued = trust.gpu_vendor.certify_request(csr_pem)
    return dataclasses.replace(trust, gpu_vendor=None), issued


def pin_orchestrator(trust: CohortTrust, *, orchestrator: OrchestratorConfig, holders: tuple[str, ...],
                     options: TrustOptions) -> CohortTrust:
    """Write each holder's policy pinning `orchestrator`'s measurement (code and config) and approving its
    job (RTMR[3]), right before it boots."""
    pinned = (tuple(bytes.fromhex(m) for m in options.pinned_measurements)
              if options.pinned_measurements is not None else (measure_orchestrator(orchestrator),))
    approved = (tuple(bytes.fromhex(j) for j in options.approved_jobs)
                if options.approved_jobs is not None else (job_digest(orchestrator),))
    policy = Policy(pinned, GpuRequirements(driver_versions=(trust.gpu_driver,)), options.max_evidence_age_s,
                    Path(REFERENCE_FILE), approved)
    for name in holders:  # the roots and the reference values too: each holder verifies the GPU itself
        _private_dir(trust.holder_dir(name), trust.root / "roots")
        (trust.holder_dir(name) / POLICY_FILE).write_text(json.dumps(policy.to_json(), indent=2) + "\n")
    return dataclasses.replace(trust, pinned=pinned, approved=approved)


def _provision_device(directory: Path, vendor: Authority, options: TrustOptions, now: datetime | None,
                      index: int) -> GpuIssuer:
    foreign = options.gpu_vendor == "foreign"
    if foreign:  # a vendor root that is in nobody's trust store
        vendor = _fresh_roots(directory / "foreign-roots", now).gpu
    serial = f"GPU-{'FOREIGN' if foreign else 'EMU'}-{index}"
    return issue_gpu_ca(vendor, serial=serial, now=now, cc_mode=options.gpu_cc_mode)


def _private_dir(path: Path, roots: Path) -> None:
    path.mkdir(parents=True, mode=0o700)
    for name in (GPU_ROOT_CERT, TEE_ROOT_CERT, REFERENCE_FILE):
        shutil.copy2(roots / name, path / name)

