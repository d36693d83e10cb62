"""A data holder attests the orchestrator (paper 4.5, CPU phase), on every join and whenever
the orchestrator says its attestation is due.

Right after the TLS handshake the holder sends a fresh nonce; the orchestrator answers with
the GPU's own evidence for that nonce, as the device signed it, and a quote from its TDX
module binding its TLS key and the nonce (its side: orchestrator/attester.py). The holder
verifies both itself against its roots, reference values and policy before it sends anything
else, then tells the orchestrator when to ask it again (`AttestAccepted`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import datetime

from gputravel.attest import (
    AttestAccepted,
    AttestChallenge,
    AttestEvidence,
    OrchestratorAttestation,
    attest_orchestrator,
)
from gputravel.attest.gpu import NONCE_BYTES
from gputravel.attest.material import HolderMaterial, utcnow
from gputravel.errors import GputravelError
from gputravel.transport.base import Transport

__all__ = ["challenge_orchestrator"]


def challenge_orchestrator(conn: Transport, material: HolderMaterial, *, timeout: float,
                           now: Callable[[], datetime] = utcnow,
                           rng: Callable[[int], bytes] = os.urandom) -> OrchestratorAttestation:
    """Attest the orchestrator on a fresh TLS connection before anything else is sent.

    The GPU is verified here, from its own evidence for our nonce: the orchestrator only
    relays it. On success the orchestrator is told to ask again after half the policy's age
    limit. On any failure the connection is closed (nothing of ours went out but the nonce)
    and the error, an AttestationError naming the claim when the evidence was refused, is raised."""
    try:
        nonce = rng(NONCE_BYTES)
        conn.send(AttestChallenge(nonce))
        evidence = conn.recv(timeout=timeout, expect=AttestEvidence).message
        assert isinstance(evidence, AttestEvidence)
        verified = attest_orchestrator(evidence, peer_cert_der=conn.peer_certificate(), nonce=nonce,
                                       policy=material.policy, trust=material.trust,
                                       reference=material.reference, now=now())
        conn.send(AttestAccepted(reattest_after_s=material.policy.max_evidence_age_s / 2))
        return verified
    except GputravelError:
        conn.close()
        raise
