"""The driver side of the handshake, in the orchestrator's CVM."""

from __future__ import annotations

import os

from cryptography.hazmat.primitives import constant_time
from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.crypto.spdm.machine import Machine
from gputravel.crypto.spdm.messages import (
    NONCE_BYTES,
    Certificate,
    Finish,
    FinishResponse,
    GetCertificate,
    KeyExchange,
    KeyExchangeResponse,
    check_nonce,
    expect_type,
)
from gputravel.crypto.spdm.p384 import (
    ChainVerifier,
    Rng,
    draw,
    ephemeral_key,
    is_p384,
    load_leaf_key,
    load_point,
    public_bytes,
    verify,
)
from gputravel.crypto.spdm.schedule import KeySchedule
from gputravel.crypto.spdm.transcript import REQ_VERIFY, RSP_VERIFY, SIG_FIELDS
from gputravel.errors import IllegalTransition, IntegrityError, ProtocolError


class SpdmRequester(Machine):
    """Authenticates the device and derives the session secret. `verify_chain` maps the device's
    chain to the key that must sign the exchange: attestation's seam (the default checks nothing)."""

    _role = "spdm requester"

    def __init__(self, rng: Rng = os.urandom, *, verify_chain: ChainVerifier | None = None) -> None:
        super().__init__(rng)
        self._verify_chain = verify_chain if verify_chain is not None else load_leaf_key
        self._chain: tuple[bytes, ...] | None = None
        self._device_key: ec.EllipticCurvePublicKey | None = None
        self._ephemeral: ec.EllipticCurvePrivateKey | None = None
        self._schedule: KeySchedule | None = None

    @property
    def device_chain(self) -> tuple[bytes, ...]:
        if self._chain is None:
            raise IllegalTransition(self._role, self._state, "read the device chain")
        return self._chain

    def get_certificate(self) -> GetCertificate:
        self._expect("idle", "send GetCertificate")
        msg = GetCertificate()
        self._transcript.append(msg)
        self._state = "awaiting_certificate"
        return msg

    def handle_certificate(self, msg: object) -> None:
        self._expect("awaiting_certificate", "handle Certificate")
        msg = expect_type(msg, Certificate)  # from the device: checked, not trusted
        chain = msg.chain_der
        if not isinstance(chain, tuple) or not chain or not all(isinstance(c, bytes) for c in chain):
            raise ProtocolError("Certificate.chain_der must be a non-empty tuple of bytes")
        key = self._verify_chain(chain)
        if not is_p384(key):
            raise ProtocolError("device key is not a P-384 public key")
        self._transcript.append(msg)
        self._chain, self._device_key = chain, key
        self._state = "have_certificate"

    def key_exchange(self) -> KeyExchange:
        self._expect("have_certificate", "send KeyExchange")
        self._ephemeral = ephemeral_key(self._rng)
        msg = KeyExchange(
            requester_nonce=draw(self._rng, NONCE_BYTES),
            requester_public=public_bytes(self._ephemeral),
        )
        self._transcript.append(msg)
        self._state = "awaiting_key_exchange_response"
        return msg

    def handle_key_exchange_response(self, msg: object) -> Finish:
        self._expect("awaiting_key_exchange_response", "handle KeyExchangeResponse")
        msg = expect_type(msg, KeyExchangeResponse)  # from the device: checked, not trusted
        check_nonce(msg.responder_nonce)
        peer = load_point(msg.responder_public)
        assert self._device_key is not None and self._ephemeral is not None
        try:
            verify(self._device_key, msg.signature, self._transcript.digest_with(msg, SIG_FIELDS))
        except IntegrityError as exc:
            raise self._fail(exc) from None
        th1 = self._transcript.digest_with(msg, RSP_VERIFY)
        schedule = KeySchedule(self._ephemeral.exchange(ec.ECDH(), peer), th1)
        self._ephemeral = None  # forward secrecy hygiene: the shared secret is consumed
        given = msg.responder_verify
        if not isinstance(given, bytes) or not constant_time.bytes_eq(given, schedule.responder_verify()):
            raise self._fail(IntegrityError("responder verify data does not match"))
        self._transcript.append(msg)
        unverified = Finish(requester_verify=b"")
        finish = Finish(schedule.requester_verify(self._transcript.digest_with(unverified, REQ_VERIFY)))
        self._transcript.append(finish)
        self._schedule = schedule
        self._state = "awaiting_finish_response"
        return finish

    def handle_finish_response(self, msg: object) -> None:
        self._expect("awaiting_finish_response", "handle FinishResponse")
        msg = expect_type(msg, FinishResponse)  # from the device: checked, not trusted
        assert self._schedule is not None
        self._secret = self._schedule.export_master(self._transcript.digest_with())
        self._schedule = None
        self._state = "established"
