"""SPDM-style session establishment between the driver (requester) and the device (responder).

Sans-IO state machines; randomness comes from an injectable `rng(n) -> bytes` and the
responder signs with deterministic ECDSA (RFC 6979), so a fixed rng replays a session byte
for byte. A cut-down SPDM 1.2 with H100's cryptography (ECDHE secp384r1, SHA-384, ECDSA P-384):

    requester                               responder
    GetCertificate          ------------->
                            <-------------  Certificate(chain, leaf first)
    KeyExchange(nonce, eph pub) --------->
                            <-------------  KeyExchangeResponse(nonce, eph pub, sig, verify)
    Finish(requester_verify) ------------>
                            <-------------  FinishResponse()

Both sides then hold the 48-byte export master secret (`session_secret`), from which
`channel.derive_epoch_keys` derives every channel key.
"""

from gputravel.crypto.spdm.messages import (
    Certificate,
    Finish,
    FinishResponse,
    GetCertificate,
    KeyExchange,
    KeyExchangeResponse,
)
from gputravel.crypto.spdm.requester import SpdmRequester
from gputravel.crypto.spdm.responder import SpdmResponder

__all__ = [
    "Certificate",
    "Finish",
    "FinishResponse",
    "GetCertificate",
    "KeyExchange",
    "KeyExchangeResponse",
    "SpdmRequester",
    "SpdmResponder",
]
