"""The holder <-> orchestrator attestation exchange (paper section 4.5), sans-IO:

    holder                                         orchestrator
    AttestChallenge{nonce}          ------------>
                                    <------------  AttestEvidence{quote, gpu_evidence, job_digest}
    AttestAccepted{reattest_after_s} ----------->  (or the holder hangs up)

The holder verifies both itself: the quote (from the orchestrator's TDX module) against its
pinned measurements, bound to the TLS peer certificate and its nonce, its RTMR[3] replayed from
the job digest the orchestrator names and that job approved; the GPU's own signed evidence for
the same nonce, relayed as the device signed it. Nothing the orchestrator could sign alone
stands for the GPU. `AttestDue` asks a holder to challenge again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from gputravel.attest.gpu import NONCE_BYTES, ReferenceValues
from gputravel.attest.policy import Policy
from gputravel.attest.quote import QuoteClaims
from gputravel.attest.ratls import report_data_for_tls, spki_der, verify_bound_quote
from gputravel.attest.roots import TrustStore
from gputravel.attest.verifier import EmulatedGpuVerifier, GpuClaims
from gputravel.errors import BadInput
from gputravel.protocol.codec import Message


class AttestChallenge(Message, tag="attest.challenge"):
    nonce: bytes


class AttestEvidence(Message, tag="attest.evidence"):
    quote: bytes
    gpu_evidence: bytes  # encoded GpuEvidence, signed by the GPU for the holder's nonce
    # The event log of RTMR[3]: the one job digest extended into it. Untrusted; replayed against the quote.
    job_digest: bytes


class AttestAccepted(Message, tag="attest.accepted"):
    """Holder -> orchestrator: verified; ask again (`AttestDue`) after this many seconds."""

    reattest_after_s: float


class AttestDue(Message, tag="attest.due"):
    pass


# ----------------------------------------------------------------------------- orchestrator
def answer_challenge(challenge: AttestChallenge, *, quote: Callable[[bytes], bytes], tls_cert_der: bytes,
                     gpu_evidence: bytes, job_digest: bytes) -> AttestEvidence:
    """The orchestrator's answer: a quote (from `quote(report_data)`, its TDX module) binding
    its TLS key and the nonce, the GPU's evidence for that same nonce, and the job in RTMR[3]."""
    if not isinstance(challenge.nonce, bytes) or len(challenge.nonce) != NONCE_BYTES:
        raise BadInput(f"holder nonce must be {NONCE_BYTES} bytes")
    return AttestEvidence(quote(report_data_for_tls(spki_der(tls_cert_der), challenge.nonce)), gpu_evidence,
                          job_digest)


# ----------------------------------------------------------------------------- holder
@dataclass(frozen=True)
class OrchestratorAttestation:
    """What a holder learnt: the orchestrator CVM's claims, the claims of the GPU whose
    evidence it verified itself, and the (approved) job its RTMR[3] holds."""

    cvm: QuoteClaims
    gpu: GpuClaims
    job_digest: bytes

    def eat(self) -> dict[str, object]:
        return {"cvm": self.cvm.eat(), "gpu": self.gpu.eat(), "job": self.job_digest.hex()}


def attest_orchestrator(evidence: AttestEvidence, *, peer_cert_der: bytes, nonce: bytes, policy: Policy,
                        trust: TrustStore, reference: ReferenceValues, now: datetime) -> OrchestratorAttestation:
    """Holder side: verify the quote (pinned measurement, bound to the TLS peer certificate and our
    nonce, RTMR[3] holding an approved job), then the GPU's own evidence for our nonce (chain to the
    GPU-vendor root, signature, FWID, CC mode, measurements against `reference`), each against `policy`."""
    cvm = verify_bound_quote(evidence.quote, peer_cert_der, nonce, policy, trust, now,  # checks `now` too
                             job_digest=evidence.job_digest)
    gpu = EmulatedGpuVerifier(trust, reference).verify(evidence.gpu_evidence, nonce, now)
    policy.check_gpu(gpu, now)
    return OrchestratorAttestation(cvm, gpu, evidence.job_digest)
