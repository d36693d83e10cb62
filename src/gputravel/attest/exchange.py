"""The holder <-> orchestrator attestation exchange (paper section 4.5), sans-IO.

    holder                                         orchestrator
    AttestChallenge{nonce}          ------------>
                                    <------------  AttestEvidence{quote, signed_claims}

`quote`: the orchestrator CVM's quote over report_data_for_tls(its TLS SPKI, nonce).
`signed_claims`: SignedClaims{payload = encode(ClaimsPayload{holder nonce, GpuClaims}),
signature = raw ECDSA P-384 over SHA-384("gputravel signed gpu claims v1\\0" || payload)},
signed with the orchestrator's TLS private key, i.e. the key the quote binds. So the chain
of trust reads: quoting root -> quote (this code + config, this TLS key, this nonce) ->
TLS key -> the GPU claims the orchestrator got from verifying the GPU it attested.

A holder calls `attest_orchestrator` on what it received, with the peer certificate from
the TLS handshake, and sends nothing else until it returns.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from datetime import datetime
from typing import cast

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.attest.chain import check_now, sign_p384, verify_p384
from gputravel.attest.errors import AttestationError
from gputravel.attest.gpu import NONCE_BYTES
from gputravel.attest.policy import Policy
from gputravel.attest.quote import EmulatedQuotingEnclave, QuoteClaims
from gputravel.attest.ratls import report_data_for_tls, spki_der, verify_bound_quote
from gputravel.attest.roots import TrustStore
from gputravel.attest.verifier import GpuClaims
from gputravel.errors import BadInput, ProtocolError
from gputravel.wire import decode, encode, message

__all__ = [
    "AttestChallenge",
    "AttestEvidence",
    "ClaimsPayload",
    "OrchestratorAttestation",
    "SignedClaims",
    "answer_challenge",
    "attest_orchestrator",
    "sign_claims",
    "verify_signed_claims",
]

SIGNED_CLAIMS_LABEL = b"gputravel signed gpu claims v1\x00"


@message("attest.challenge")
@dataclass(frozen=True)
class AttestChallenge:
    nonce: bytes


@message("attest.evidence")
@dataclass(frozen=True)
class AttestEvidence:
    quote: bytes
    signed_claims: bytes


@message("attest.claims.payload")
@dataclass(frozen=True)
class ClaimsPayload:
    holder_nonce: bytes
    gpu: GpuClaims


@message("attest.claims.signed")
@dataclass(frozen=True)
class SignedClaims:
    payload: bytes
    signature: bytes


# ----------------------------------------------------------------------------- orchestrator
def sign_claims(gpu: GpuClaims, *, holder_nonce: bytes, key: ec.EllipticCurvePrivateKey) -> bytes:
    """Encoded SignedClaims: `gpu` for the holder that sent `holder_nonce`."""
    if not isinstance(holder_nonce, bytes) or len(holder_nonce) != NONCE_BYTES:
        raise BadInput(f"holder nonce must be {NONCE_BYTES} bytes")
    payload = encode(ClaimsPayload(holder_nonce, gpu))
    return encode(SignedClaims(payload, sign_p384(key, SIGNED_CLAIMS_LABEL + payload)))


def answer_challenge(
    challenge: AttestChallenge,
    *,
    enclave: EmulatedQuotingEnclave,
    measurement: bytes,
    tls_cert_der: bytes,
    tls_key: ec.EllipticCurvePrivateKey,
    gpu: GpuClaims,
) -> AttestEvidence:
    """The orchestrator's answer: a quote binding its TLS key and the nonce, plus its GPU claims."""
    cert_key = x509.load_der_x509_certificate(tls_cert_der).public_key()
    if not isinstance(cert_key, ec.EllipticCurvePublicKey) or \
            cert_key.public_numbers() != tls_key.public_key().public_numbers():
        raise BadInput("tls_key does not match tls_cert_der")
    quote = enclave.quote(measurement, report_data_for_tls(spki_der(tls_cert_der), challenge.nonce))
    return AttestEvidence(quote, sign_claims(gpu, holder_nonce=challenge.nonce, key=tls_key))


# ----------------------------------------------------------------------------- holder
def verify_signed_claims(
    signed_claims: bytes, *, peer_cert_der: bytes, holder_nonce: bytes, policy: Policy, now: datetime
) -> GpuClaims:
    """The GPU claims signed by the peer certificate's key for this nonce, checked against
    the policy. Only meaningful once a quote has bound that key (see attest_orchestrator)."""
    check_now(now)
    try:
        signed = cast(SignedClaims, decode(signed_claims, expect=SignedClaims))
        payload = cast(ClaimsPayload, decode(signed.payload, expect=ClaimsPayload))
    except (ProtocolError, TypeError):
        raise AttestationError("format", "signed GPU claims could not be decoded") from None
    key = x509.load_der_x509_certificate(peer_cert_der).public_key()
    if not verify_p384(key, signed.signature, SIGNED_CLAIMS_LABEL + signed.payload):
        raise AttestationError("signature", "GPU claims are not signed by the attested orchestrator's key")
    if not hmac.compare_digest(payload.holder_nonce, holder_nonce):
        raise AttestationError("nonce", "GPU claims were signed for another nonce (replayed)")
    gpu = payload.gpu
    policy.check_gpu(gpu, now)
    return gpu


@dataclass(frozen=True)
class OrchestratorAttestation:
    """What a holder learnt: the orchestrator CVM's claims and the GPU claims it vouches for."""

    cvm: QuoteClaims
    gpu: GpuClaims

    def eat(self) -> dict[str, object]:
        return {"cvm": self.cvm.eat(), "gpu": self.gpu.eat()}


def attest_orchestrator(
    evidence: AttestEvidence,
    *,
    peer_cert_der: bytes,
    nonce: bytes,
    policy: Policy,
    trust: TrustStore,
    now: datetime,
) -> OrchestratorAttestation:
    """Holder side: verify the quote (pinned measurement, bound to the TLS peer certificate
    and our nonce), then the GPU claims signed with that bound key, against `policy`."""
    cvm = verify_bound_quote(evidence.quote, peer_cert_der, nonce, policy, trust, now)
    gpu = verify_signed_claims(evidence.signed_claims, peer_cert_der=peer_cert_der,
                               holder_nonce=nonce, policy=policy, now=now)
    return OrchestratorAttestation(cvm, gpu)
