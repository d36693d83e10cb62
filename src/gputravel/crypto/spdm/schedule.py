"""The SPDM key schedule (after SPDM 1.2, labels shortened), identical on both sides:

    handshake = HKDF-Extract(salt=0^48, ECDH shared secret)
    th1       = SHA-384(transcript through KeyExchangeResponse incl. signature, excl. verify)
    rsp_hs    = Expand(handshake, "spdm1.2 rsp hs data" || th1); req_hs likewise with "req"
    finished  = Expand(rsp_hs / req_hs, "spdm1.2 finished")
    responder_verify = HMAC(rsp finished, th1)
    requester_verify = HMAC(req finished, SHA-384(transcript ... || Finish excl. verify))
    master    = HKDF-Extract(salt=Expand(handshake, "spdm1.2 derived"), 0^48)
    export    = Expand(master, "spdm1.2 exp master" || SHA-384(transcript through Finish))
"""

from __future__ import annotations

from cryptography.hazmat.primitives import hashes, hmac

from gputravel.crypto.channel import _hkdf_expand

SECRET_BYTES = 48  # SHA-384 output size


def _extract(salt: bytes, ikm: bytes) -> bytes:
    """HKDF-Extract (RFC 5869 section 2.2) over SHA-384: an HMAC keyed with the salt."""
    return _mac(salt, ikm)


def _expand(secret: bytes, info: bytes) -> bytes:
    return _hkdf_expand(hashes.SHA384(), secret, info, SECRET_BYTES)


def _mac(key: bytes, data: bytes) -> bytes:
    mac = hmac.HMAC(key, hashes.SHA384())
    mac.update(data)
    return mac.finalize()


class KeySchedule:
    """Secrets derived from the ECDH shared secret; identical on both sides."""

    def __init__(self, shared: bytes, th1: bytes) -> None:
        self._handshake = _extract(bytes(SECRET_BYTES), shared)
        self._th1 = th1
        self._rsp_finished = _expand(_expand(self._handshake, b"spdm1.2 rsp hs data" + th1), b"spdm1.2 finished")
        self._req_finished = _expand(_expand(self._handshake, b"spdm1.2 req hs data" + th1), b"spdm1.2 finished")

    def __repr__(self) -> str:
        return "KeySchedule(<secret>)"

    def responder_verify(self) -> bytes:
        return _mac(self._rsp_finished, self._th1)

    def requester_verify(self, th_finish: bytes) -> bytes:
        return _mac(self._req_finished, th_finish)

    def export_master(self, th2: bytes) -> bytes:
        master = _extract(_expand(self._handshake, b"spdm1.2 derived"), bytes(SECRET_BYTES))
        return _expand(master, b"spdm1.2 exp master" + th2)
