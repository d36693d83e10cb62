"""SPDM-style session establishment between the driver (requester) and the device (responder).

Sans-IO: both sides are plain state machines that take a message and return the next one.
No sockets, threads or clocks; randomness comes from an injectable `rng(n) -> bytes`, so a
deterministic rng reproduces a whole session byte for byte (the responder signs with
deterministic ECDSA, RFC 6979, for the same reason).

Flow (a cut-down SPDM 1.2 with the cryptography H100 uses: ECDHE secp384r1, SHA-384, ECDSA
P-384):

    requester                               responder
    GetCertificate          ------------->
                            <-------------  Certificate(chain, leaf first)
    KeyExchange(nonce, eph pub) --------->
                            <-------------  KeyExchangeResponse(nonce, eph pub, sig, verify)
    Finish(requester_verify) ------------>
                            <-------------  FinishResponse()

Both sides then hold the 48-byte export master secret (`session_secret`), from which
`channel.derive_epoch_keys` derives every channel key.

* :mod:`.messages`   - the six messages;
* :mod:`.transcript` - the canonical transcript both sides hash, sign and MAC;
* :mod:`.schedule`   - the key schedule from the ECDH secret to the export master secret;
* :mod:`.p384`       - ECDH/ECDSA P-384 and the device's leaf key;
* :mod:`.responder`, :mod:`.requester` - the two state machines (:mod:`.machine`: shared part).
"""

from gputravel.crypto.spdm.messages import (
    NONCE_BYTES,
    Certificate,
    Finish,
    FinishResponse,
    GetCertificate,
    KeyExchange,
    KeyExchangeResponse,
)
from gputravel.crypto.spdm.p384 import SIGNATURE_BYTES, load_leaf_key
from gputravel.crypto.spdm.requester import SpdmRequester
from gputravel.crypto.spdm.responder import SpdmResponder
from gputravel.crypto.spdm.schedule import SECRET_BYTES

__all__ = [
    "NONCE_BYTES",
    "SECRET_BYTES",
    "SIGNATURE_BYTES",
    "Certificate",
    "Finish",
    "FinishResponse",
    "GetCertificate",
    "KeyExchange",
    "KeyExchangeResponse",
    "SpdmRequester",
    "SpdmResponder",
    "load_leaf_key",
]
