"""The SPDM messages: sans-IO structs (protocol.rpc registers them for the RPC queue)."""

from __future__ import annotations

from typing import TypeVar, dataclass_transform

import msgspec
from msgspec.structs import force_setattr

from gputravel.errors import ProtocolError

NONCE_BYTES = 32


# For type checkers: a subclass inherits frozen=True (msgspec's own transform has it default off).
@dataclass_transform(frozen_default=True, field_specifiers=(msgspec.field,))
class SpdmMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="t",
                  tag=lambda name: f"spdm.{name}"):
    """Base of the six messages, configured as protocol.codec.Message (which crypto/ may not import)."""


class GetCertificate(SpdmMessage):
    pass


class Certificate(SpdmMessage):
    chain_der: tuple[bytes, ...]  # leaf first

    def __post_init__(self) -> None:
        # A list from a caller would break hashing and the transcript's encoding.
        if isinstance(self.chain_der, list):
            force_setattr(self, "chain_der", tuple(self.chain_der))


class KeyExchange(SpdmMessage):
    requester_nonce: bytes
    requester_public: bytes  # SEC1 uncompressed P-384 point


class KeyExchangeResponse(SpdmMessage):
    responder_nonce: bytes
    responder_public: bytes
    signature: bytes  # raw r || s over SHA-384(transcript without signature and verify)
    responder_verify: bytes  # HMAC-SHA384


class Finish(SpdmMessage):
    requester_verify: bytes


class FinishResponse(SpdmMessage):
    pass


MESSAGE_TYPES = (GetCertificate, Certificate, KeyExchange, KeyExchangeResponse, Finish, FinishResponse)


def check_nonce(nonce: object) -> None:
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise ProtocolError(f"nonce must be {NONCE_BYTES} bytes")


_T = TypeVar("_T")


def expect_type(msg: object, cls: type[_T]) -> _T:
    """``msg``, if it is a ``cls`` (exactly: not a subclass); else ProtocolError."""
    if type(msg) is not cls:
        raise ProtocolError(f"expected {cls.__name__}, got {type(msg).__name__}")
    return msg
