"""The device side of the handshake."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from cryptography.hazmat.primitives import constant_time
from cryptography.hazmat.primitives.asymmetric import ec
from msgspec.structs import replace

from gputravel.crypto.spdm.machine import Machine
from gputravel.crypto.spdm.messages import (
    MESSAGE_TYPES,
    NONCE_BYTES,
    Certificate,
    Finish,
    FinishResponse,
    GetCertificate,
    KeyExchange,
    KeyExchangeResponse,
    check_nonce,
)
from gputravel.crypto.spdm.p384 import (
    Rng,
    draw,
    ephemeral_key,
    is_p384,
    load_leaf_key,
    load_point,
    public_bytes,
    sign,
)
from gputravel.crypto.spdm.schedule import KeySchedule
from gputravel.crypto.spdm.transcript import REQ_VERIFY, RSP_VERIFY, SIG_FIELDS
from gputravel.errors import BadInput, IllegalTransition, IntegrityError, ProtocolError


class SpdmResponder(Machine):
    """The device side: holds the identity key and answers requests in order."""

    _role = "spdm responder"

    def __init__(self, identity_key: ec.EllipticCurvePrivateKey, chain_der: tuple[bytes, ...],
                 rng: Rng = os.urandom) -> None:
        super().__init__(rng)
        if not isinstance(identity_key, ec.EllipticCurvePrivateKey) or not is_p384(identity_key.public_key()):
            raise BadInput("identity_key must be a P-384 private key")
        chain = tuple(chain_der)
        if not chain or not all(isinstance(c, bytes) for c in chain):
            raise BadInput("chain_der must be a non-empty tuple of DER certificates")
        try:
            leaf_key = load_leaf_key(chain)
        except ProtocolError:
            raise BadInput("the leaf of chain_der is not a DER certificate") from None
        if not is_p384(leaf_key) or leaf_key.public_numbers() != identity_key.public_key().public_numbers():
            raise BadInput("identity_key does not match the leaf certificate of chain_der")
        self._key = identity_key
        self._chain = chain
        self._schedule: KeySchedule | None = None

    def handle(self, msg: object) -> object:
        # Each handler takes the message of its key's type.
        handlers: dict[type, tuple[str, Callable[[Any], object]]] = {
            GetCertificate: ("idle", self._on_get_certificate),
            KeyExchange: ("certificate_sent", self._on_key_exchange),
            Finish: ("awaiting_finish", self._on_finish),
        }
        if type(msg) not in handlers:
            if isinstance(msg, MESSAGE_TYPES):
                raise IllegalTransition(self._role, self._state, f"handle {type(msg).__name__}")
            raise ProtocolError(f"not an SPDM request: {type(msg).__name__}")
        state, handler = handlers[type(msg)]
        self._expect(state, f"handle {type(msg).__name__}")
        return handler(msg)

    def _on_get_certificate(self, msg: GetCertificate) -> Certificate:
        response = Certificate(chain_der=self._chain)
        self._transcript.append(msg)
        self._transcript.append(response)
        self._state = "certificate_sent"
        return response

    def _on_key_exchange(self, msg: KeyExchange) -> KeyExchangeResponse:
        check_nonce(msg.requester_nonce)
        peer = load_point(msg.requester_public)
        self._transcript.append(msg)
        ephemeral = ephemeral_key(self._rng)
        unsigned = KeyExchangeResponse(
            responder_nonce=draw(self._rng, NONCE_BYTES),
            responder_public=public_bytes(ephemeral),
            signature=b"",
            responder_verify=b"",
        )
        signed = replace(unsigned, signature=sign(self._key, self._transcript.digest_with(unsigned, SIG_FIELDS)))
        th1 = self._transcript.digest_with(signed, RSP_VERIFY)
        self._schedule = KeySchedule(ephemeral.exchange(ec.ECDH(), peer), th1)
        response = replace(signed, responder_verify=self._schedule.responder_verify())
        self._transcript.append(response)
        self._state = "awaiting_finish"
        return response

    def _on_finish(self, msg: Finish) -> FinishResponse:
        assert self._schedule is not None
        expected = self._schedule.requester_verify(self._transcript.digest_with(msg, REQ_VERIFY))
        given = msg.requester_verify
        if not isinstance(given, bytes) or not constant_time.bytes_eq(given, expected):
            raise self._fail(IntegrityError("requester verify data does not match"))
        self._transcript.append(msg)
        self._secret = self._schedule.export_master(self._transcript.digest_with())
        self._schedule = None  # the handshake secrets are no longer needed
        self._state = "established"
        return FinishResponse()
