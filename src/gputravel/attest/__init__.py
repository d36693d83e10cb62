"""Attestation, pure: evidence, a trust store and `now` in; claims or an AttestationError naming
the failed claim out. The roots are emulated and say so in their names (docs/attestation.md)."""

from gputravel.attest.chain import FWID_OID
from gputravel.attest.errors import AttestationError
from gputravel.attest.exchange import (
    AttestAccepted,
    AttestChallenge,
    AttestDue,
    AttestEvidence,
    OrchestratorAttestation,
    answer_challenge,
    attest_orchestrator,
)
from gputravel.attest.gpu import GpuEvidence, ReferenceValues
from gputravel.attest.policy import GpuRequirements, Policy
from gputravel.attest.provision import GpuIssuer, enroll_gpu, issue_gpu_ca, provision_gpu
from gputravel.attest.quote import (
    JOB_RTMR,
    EmulatedQuoteVerifier,
    EmulatedQuotingEnclave,
    measure_code,
    orchestrator_measurement,
    rtmr_after,
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
    "FWID_OID",
    "JOB_RTMR",
    "AttestAccepted",
    "AttestChallenge",
    "AttestDue",
    "AttestEvidence",
    "AttestationError",
    "Authority",
    "EmulatedGpuVerifier",
    "EmulatedQuoteVerifier",
    "EmulatedQuotingEnclave",
    "GpuClaims",
    "GpuEvidence",
    "GpuIssuer",
    "GpuRequirements",
    "OrchestratorAttestation",
    "Policy",
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
    "rtmr_after",
    "spdm_chain_verifier",
    "verify_bound_quote",
    "verify_ra_tls",
]
