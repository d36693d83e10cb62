"""The chain of trust at run time (paper 4.5), around the pure checks of `gputravel.attest`.

GPU phase, in the orchestrator at boot (:class:`GpuAttester`): the SPDM handshake accepts
only a device whose 5-certificate chain reaches the trusted GPU-vendor root; then, inside
that session, the device's evidence for a fresh nonce is verified against the reference
values, and must be signed by the very device that holds the session.

CPU phase, when a holder joins (:func:`challenge_orchestrator` / :meth:`GpuAttester.answer`):
right after the TLS handshake the holder sends a fresh nonce; the orchestrator answers with a
quote binding its TLS key and that nonce, plus the GPU claims signed with that key; the
holder checks both against its policy before it sends anything else.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, cast

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ..attest import (
    AttestationError,
    AttestChallenge,
    AttestEvidence,
    EmulatedGpuVerifier,
    GpuClaims,
    GpuEvidence,
    OrchestratorAttestation,
    answer_challenge,
    attest_orchestrator,
    spdm_chain_verifier,
)
from ..crypto.pki import CohortPki, MemberIdentity
from ..crypto.spdm import SpdmRequester
from ..driver.orchestrator import OrchestratorDriver
from ..errors import BadInput, GputravelError, IllegalTransition
from ..transport.stream import StreamTransport
from ..wire import decode
from .trust import HolderMaterial, OrchestratorMaterial, measure_orchestrator, utcnow

if TYPE_CHECKING:
    from .orchestrator import OrchestratorConfig

__all__ = ["GpuAttester", "TlsIdentity", "challenge_orchestrator", "orchestrator_attester"]

NONCE_BYTES = 32


@dataclass(frozen=True)
class TlsIdentity:
    """The orchestrator's cohort TLS certificate and key: what its quotes bind."""

    cert_der: bytes
    key: ec.EllipticCurvePrivateKey = field(repr=False)

    @classmethod
    def of_member(cls, member: MemberIdentity) -> TlsIdentity:
        key = serialization.load_pem_private_key(member.key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise BadInput(f"the TLS key of {member.name} is not an EC key")
        cert = x509.load_pem_x509_certificate(member.cert_pem).public_bytes(serialization.Encoding.DER)
        return cls(cert, key)


class GpuAttester:
    """The orchestrator's side of the chain: attests the GPU and vouches for it to holders.

    Keeps the claims of the last successful attestation. They are dropped before every new
    attempt, so a GPU that fails re-attestation is never vouched for with older claims.
    """

    def __init__(self, material: OrchestratorMaterial, measurement: bytes, identity: TlsIdentity, *,
                 rng: Callable[[int], bytes] = os.urandom) -> None:
        self.material = material
        self.measurement = measurement
        self.identity = identity
        self.claims: GpuClaims | None = None
        self._rng = rng
        self._session_leaf: bytes | None = None

    @property
    def refresh_after_s(self) -> int:
        # Half the holders' limit: what a joining holder receives is never close to expiring.
        return max(1, self.material.max_evidence_age_s // 2)

    # ------------------------------------------------------------------ GPU phase
    def open_session(self, driver: OrchestratorDriver, now: datetime, timeout: float) -> GpuClaims:
        """SPDM only with a device chaining to the trusted vendor root; then attest it."""
        requester = SpdmRequester(verify_chain=spdm_chain_verifier(self.material.trust, now))
        driver.establish_session(requester, timeout=timeout)
        self._session_leaf = requester.device_chain[0]
        return self.attest(driver, now, timeout)

    def attest(self, driver: OrchestratorDriver, now: datetime, timeout: float) -> GpuClaims:
        """Ask the device for evidence on a fresh nonce inside the session and verify it."""
        if self._session_leaf is None:
            raise IllegalTransition("gpu attester", "no-session", "attest the GPU")
        self.claims = None
        nonce = self._rng(NONCE_BYTES)
        blob = driver.get_evidence(nonce, timeout=timeout)
        claims = EmulatedGpuVerifier(self.material.trust, self.material.reference).verify(blob, nonce, now)
        evidence = cast(GpuEvidence, decode(blob, expect=GpuEvidence))  # verified: decodes
        if evidence.cert_chain[0] != self._session_leaf:
            raise AttestationError("chain", "the evidence is signed by another device than the one "
                                            "holding the SPDM session")
        self.claims = claims
        return claims

    def stale(self, now: datetime) -> bool:
        claims = self.claims
        return claims is None or int(now.timestamp()) - claims.verified_at >= self.refresh_after_s

    def refresh(self, driver: OrchestratorDriver, now: datetime, timeout: float) -> bool:
        """Re-attest if the claims are stale and the GPU is home (context not away).
        Returns whether it re-attested; raises AttestationError if the GPU now fails."""
        if not self.stale(now) or driver.away:
            return False
        self.attest(driver, now, timeout)
        return True

    # ------------------------------------------------------------------ CPU phase
    def answer(self, challenge: AttestChallenge) -> AttestEvidence:
        if self.claims is None:
            raise IllegalTransition("gpu attester", "gpu-unattested", "vouch for the GPU")
        return answer_challenge(challenge, enclave=self.material.enclave, measurement=self.measurement,
                                tls_cert_der=self.identity.cert_der, tls_key=self.identity.key, gpu=self.claims)

    def serve_challenge(self, conn: StreamTransport, driver: OrchestratorDriver, timeout: float) -> None:
        """A holder just connected: its first message is a challenge; answer it with fresh claims."""
        challenge = conn.recv(timeout=timeout, expect=AttestChallenge).message
        assert isinstance(challenge, AttestChallenge)
        self.refresh(driver, utcnow(), timeout)
        conn.send(self.answer(challenge))


# ----------------------------------------------------------------------------- holder
def challenge_orchestrator(conn: StreamTransport, material: HolderMaterial, *, timeout: float,
                           now: Callable[[], datetime] = utcnow,
                           rng: Callable[[int], bytes] = os.urandom) -> OrchestratorAttestation:
    """Attest the orchestrator on a fresh TLS connection before anything else is sent.

    On any failure the connection is closed (nothing of ours went out but the nonce) and the
    error, an AttestationError naming the claim when the evidence was refused, is raised."""
    try:
        nonce = rng(NONCE_BYTES)
        conn.send(AttestChallenge(nonce))
        evidence = conn.recv(timeout=timeout, expect=AttestEvidence).message
        assert isinstance(evidence, AttestEvidence)
        return attest_orchestrator(evidence, peer_cert_der=conn.peer_certificate(), nonce=nonce,
                                   policy=material.policy, trust=material.trust, now=now())
    except GputravelError:
        conn.close()
        raise


def orchestrator_attester(config: OrchestratorConfig) -> GpuAttester:
    """The orchestrator's attester: its trust material, its own measurement, its TLS identity."""
    return GpuAttester(OrchestratorMaterial.load(config.trust_dir), measure_orchestrator(config),
                       TlsIdentity.of_member(CohortPki.load(Path(config.pki_dir)).member("orchestrator")))
