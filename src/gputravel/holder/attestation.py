"""A data holder attests the orchestrator (paper 4.5, CPU phase) on every join and when told it
is due: a fresh nonce; the GPU's own evidence for it and a TDX quote binding the TLS key and the
nonce come back (orchestrator/attester.py), verified here before anything else is sent."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import datetime

from gputravel.attest import (AttestAccepted, AttestChallenge, AttestEvidence, OrchestratorAttestation,
                              attest_orchestrator)
from gputravel.attest.gpu import NONCE_BYTES
from gputravel.attest.material import HolderMaterial, utcnow
from gputravel.errors import GputravelError
from gputravel.transport.base import Transport

__all__ = ["challenge_orchestrator"]


def challenge_orchestrator(conn: Transport, material: HolderMaterial, *, timeout: float,
                           now: Callable[[], datetime] = utcnow,
                           rng: Callable[[int], bytes] = os.urandom) -> OrchestratorAttestation:
    """Attest the orchestrator (and the GPU, from its own evidence, relayed); on success tell it to
    ask again after half the policy's age limit. Any failure closes the connection and is raised."""
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
