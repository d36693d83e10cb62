"""Attestation, pure: evidence, a trust store and `now` in; claims or an AttestationError naming
the failed claim out. The roots are emulated and say so in their names (docs/attestation.md)."""

from gputravel.attest.chain import CVM_QUOTE_OID, FWID_OID, verify_chain
from gputravel.attest.errors import CLAIMS, AttestationError
from gputravel.attest.exchange import (
    AttestAccepted,
    AttestChallenge,
    AttestDue,
    AttestEvidence,
    OrchestratorAttestation,
    answer_challenge,
    attest_orchestrator,
    verify_gpu_evidence,
)
from gputravel.attest.gpu import EmulatedGpuFirmware, GpuEvidence, ReferenceValues
from gputravel.attest.policy import GpuRequirements, Policy
from gputravel.attest.provision import GpuDevice, GpuIssuer, enroll_gpu, issue_gpu_ca, provision_gpu
from gputravel.attest.quote import (
    EmulatedQuoteVerifier,
    EmulatedQuotingEnclave,
    Quote,
    QuoteClaims,
    measure_code,
    orchestrator_measurement,
)
from gputravel.attest.ratls import (
    extract_quote,
    make_ra_tls_certificate,
    report_data_for_tls,
    verify_bound_quote,
    verify_ra_tls,
)
from gputravel.attest.roots import Authority, TrustStore, init_roots, load_authority
from gputravel.attest.verifier import EmulatedGpuVerifier, GpuClaims, Verifier, spdm_chain_verifier

__all__ = [
    "CLAIMS",
    "CVM_QUOTE_OID",
    "FWID_OID",
    "AttestAccepted",
    "AttestChallenge",
    "AttestDue",
    "AttestEvidence",
    "AttestationError",
    "Authority",
    "EmulatedGpuFirmware",
    "EmulatedGpuVerifier",
    "EmulatedQuoteVerifier",
    "EmulatedQuotingEnclave",
    "GpuClaims",
    "GpuDevice",
    "GpuEvidence",
    "GpuIssuer",
    "GpuRequirements",
    "OrchestratorAttestation",
    "Policy",
    "Quote",
    "QuoteClaims",
    "ReferenceValues",
    "TrustStore",
    "Verifier",
    "answer_challenge",
    "attest_orchestrator",
    "enroll_gpu",
    "extract_quote",
    "init_roots",
    "issue_gpu_ca",
    "load_authority",
    "make_ra_tls_certificate",
    "measure_code",
    "orchestrator_measurement",
    "provision_gpu",
    "report_data_for_tls",
    "spdm_chain_verifier",
    "verify_bound_quote",
    "verify_chain",
    "verify_ra_tls",
    "verify_gpu_evidence",
]
