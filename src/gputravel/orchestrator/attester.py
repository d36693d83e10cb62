"""The chain of trust at run time (paper 4.5): the GPU attested at boot under the vendor root, and
each holder's nonce answered with its evidence and a TDX quote binding our TLS key, and the job
digest our RTMR[3] was extended with at boot. The GPU's certified serial names it in the travel
log: a re-key must reach that same GPU."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.attest import (
    JOB_RTMR,
    AttestAccepted,
    AttestationError,
    AttestChallenge,
    AttestDue,
    AttestEvidence,
    EmulatedGpuVerifier,
    GpuClaims,
    GpuEvidence,
    answer_challenge,
    rtmr_after,
    spdm_chain_verifier,
)
from gputravel.attest.verifier import gpu_identity
from gputravel.attest.gpu import NONCE_BYTES
from gputravel.attest.material import OrchestratorMaterial, utcnow
from gputravel.firmware.tdx_module import PendingExtend, QuotingRefused, request_quote
from gputravel.crypto.pki import MemberIdentity
from gputravel.crypto.spdm import SpdmRequester
from gputravel.driver.orchestrator import OrchestratorDriver
from gputravel.errors import IllegalTransition, ProtocolError
from gputravel.transport.base import Transport
from gputravel.protocol.codec import decode

MIN_REATTEST_S = 1.0  # however often a holder asks, the orchestrator re-attests at most this often


@dataclass(frozen=True)
class TlsIdentity:
    """The orchestrator's cohort TLS certificate, which its quotes bind (the TDX module signs)."""

    cert_der: bytes

    @classmethod
    def of_member(cls, member: MemberIdentity) -> TlsIdentity:
        return cls(x509.load_pem_x509_certificate(member.cert_pem).public_bytes(serialization.Encoding.DER))


class GpuAttester:
    """Attests the GPU and relays its evidence with a TDX quote; never for a GPU whose last try failed."""

    def __init__(self, material: OrchestratorMaterial, quote: Callable[[bytes], bytes], identity: TlsIdentity, *,
                 rng: Callable[[int], bytes] = os.urandom, job_digest: bytes = b"") -> None:
        self.material = material
        self.quote = quote  # report data -> quote, from the TDX module (never a measurement of ours)
        self.identity = identity
        self.job_digest = job_digest  # what RTMR[3] was extended with (b"": none; holders refuse)
        self.claims: GpuClaims | None = None
        self._rng = rng
        self._session_chain: tuple[bytes, ...] | None = None  # leaf and per-device certificate of the session
        self.gpu: str | None = None  # gpu_identity of the first session's GPU, once it attested
        self._gpu_cert: bytes | None = None  # that GPU's per-device certificate: a re-key must reach it
        # When each holder's link is due for re-attestation, on the shell's clock (its `now`).
        self._due: weakref.WeakKeyDictionary[Transport, float] = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ GPU phase
    def open_session(self, driver: OrchestratorDriver, now: datetime, timeout: float) -> GpuClaims:
        """SPDM with a device under the vendor root (after the first, the same GPU), then attest it."""
        requester = SpdmRequester(verify_chain=self._pinned(spdm_chain_verifier(self.material.trust, now)))
        self._session_chain = self.claims = None  # whatever the session was, it is being replaced
        driver.establish_session(requester, timeout=timeout)
        self._session_chain = requester.device_chain[:2]  # the firmware leaf and the per-device certificate
        try:
            claims = self.attest(driver, now, timeout)
        except BaseException:
            self._session_chain = None  # a session whose GPU failed attestation relays nothing, pins nothing
            raise
        self.gpu, self._gpu_cert = gpu_identity(requester.device_chain), requester.device_chain[1]
        return claims

    def _pinned(self, verify: Callable[[tuple[bytes, ...]], ec.EllipticCurvePublicKey]
                ) -> Callable[[tuple[bytes, ...]], ec.EllipticCurvePublicKey]:
        """The chain hook, GPU pinned: it runs before the key exchange, so another GPU gets no keys."""
        def check(chain: tuple[bytes, ...]) -> ec.EllipticCurvePublicKey:
            key = verify(chain)  # the vendor root first: only then is chain[1] a per-device certificate
            if self._gpu_cert is not None and chain[1] != self._gpu_cert:
                # The whole certificate: another device certified with the same serial is another GPU.
                gpu = gpu_identity(chain)
                which = f"another device certified as {gpu}" if gpu == self.gpu else f"GPU {gpu}, not {self.gpu}"
                raise AttestationError("chain", f"the new SPDM session reached {which}, "
                                                "the GPU this orchestrator attested first")
            return key
        return check

    def attest(self, driver: OrchestratorDriver, now: datetime, timeout: float) -> GpuClaims:
        return self._evidence(driver, self._rng(NONCE_BYTES), now, timeout)[0]

    def _evidence(self, driver: OrchestratorDriver, nonce: bytes, now: datetime,
                  timeout: float) -> tuple[GpuClaims, bytes]:
        """The device's evidence for `nonce` inside the session, verified; the claims kept."""
        if self._session_chain is None:
            raise IllegalTransition("gpu attester", "no-session", "attest the GPU")
        self.claims = None
        blob = driver.get_evidence(nonce, timeout=timeout)
        claims = EmulatedGpuVerifier(self.material.trust, self.material.reference).verify(blob, nonce, now)
        evidence = decode(blob, expect=GpuEvidence)  # verified: decodes
        if tuple(evidence.cert_chain[:2]) != self._session_chain:
            # Holders read the GPU's name from the evidence's chain, the log from the session's.
            raise AttestationError("chain", "the evidence is signed by another device than the one "
                                            "holding the SPDM session")
        self.claims = claims
        return claims, blob

    def refresh(self, driver: OrchestratorDriver, now: datetime, timeout: float) -> bool:
        """Re-attest, if the GPU is home, claims older than half the holders' limit; whether it did."""
        refresh_after_s = max(1, self.material.max_evidence_age_s // 2)
        fresh = self.claims is not None and int(now.timestamp()) - self.claims.verified_at < refresh_after_s
        if fresh or driver.away:
            return False
        self.attest(driver, now, timeout)
        return True

    # ------------------------------------------------------------------ CPU phase
    def answer(self, challenge: AttestChallenge, driver: OrchestratorDriver, now: datetime,
               timeout: float) -> AttestEvidence:
        """GPU evidence for the holder's nonce and a TDX quote binding it and our TLS key."""
        if self.claims is None:
            raise IllegalTransition("gpu attester", "gpu-unattested", "vouch for the GPU")
        if driver.away:
            raise IllegalTransition("gpu attester", "context-away", "ask the GPU for evidence")
        if not isinstance(challenge.nonce, bytes) or len(challenge.nonce) != NONCE_BYTES:
            raise ProtocolError(f"a challenge nonce must be {NONCE_BYTES} bytes")
        _, blob = self._evidence(driver, challenge.nonce, now, timeout)
        return answer_challenge(challenge, quote=self.quote, tls_cert_der=self.identity.cert_der, gpu_evidence=blob,
                                job_digest=self.job_digest)

    def serve_challenge(self, conn: Transport, driver: OrchestratorDriver, timeout: float, now: float) -> None:
        """Answer a holder's challenge and learn when it wants to attest us again (from ``now``)."""
        challenge = conn.recv(timeout=timeout, expect=AttestChallenge).message
        self.refresh(driver, utcnow(), timeout)  # a GPU that failed before gets one more try
        conn.send(self.answer(challenge, driver, utcnow(), timeout))
        accepted = conn.recv(timeout=timeout, expect=AttestAccepted).message
        self._due[conn] = now + max(MIN_REATTEST_S, float(accepted.reattest_after_s))

    def reattest_if_due(self, conn: Transport, driver: OrchestratorDriver, timeout: float, now: float) -> bool:
        """Before a travel, with the GPU home (fresh evidence needs it): re-attest if due at ``now``."""
        due = self._due.get(conn)
        if due is None or now < due:
            return False
        conn.send(AttestDue())
        self.serve_challenge(conn, driver, timeout, now)
        return True


class JobFirst:
    """Quotes only once RTMR[3] holds the job: the extend is sent at boot, its reply awaited before the
    first quote (the launcher may register us only once we are up); a refused extend refuses every quote."""

    def __init__(self, socket_path: str, job: bytes) -> None:
        self.socket_path = socket_path
        self._extend = PendingExtend(socket_path, JOB_RTMR, job)  # cannot reach the module: the boot fails
        self._expected = rtmr_after([job])

    def __call__(self, report_data: bytes) -> bytes:
        if self._extend.result() != self._expected:  # waited once; a refusal raises QuotingRefused each time
            raise QuotingRefused(f"RTMR[{JOB_RTMR}] holds more than this job: this CVM quotes nothing")
        return request_quote(self.socket_path, report_data)


def orchestrator_attester(trust_dir: str, identity: TlsIdentity, job: bytes) -> GpuAttester:
    """The orchestrator's attester, at boot: RTMR[3] extended with `job` (orchestrator/job.py), once;
    its TDX module quotes the measurement the launcher registered and the RTMRs it keeps."""
    material = OrchestratorMaterial.load(trust_dir)
    return GpuAttester(material, JobFirst(material.quoting_socket, job), identity, job_digest=job)
