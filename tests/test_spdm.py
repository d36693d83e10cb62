"""SPDM-style session establishment between the driver and the device."""

from __future__ import annotations

import hashlib

import pytest
from msgspec import structs

from gputravel.crypto.device_identity import make_device_identity
from gputravel.crypto.spdm import (
    Certificate,
    Finish,
    FinishResponse,
    GetCertificate,
    KeyExchange,
    KeyExchangeResponse,
    SpdmRequester,
    SpdmResponder,
)
from gputravel.errors import BadInput, IllegalTransition, IntegrityError, ProtocolError


_DEVICES: dict[str, object] = {}


def device(serial: str = "GPU-EMU-0"):
    # Cached per serial: key generation is the slow part of these tests.
    if serial not in _DEVICES:
        _DEVICES[serial] = make_device_identity(serial=serial)
    return _DEVICES[serial]


def responder(serial: str = "GPU-EMU-0", rng=None) -> SpdmResponder:
    ident = device(serial)
    if rng is None:
        return SpdmResponder(ident.private_key, ident.chain_der)
    return SpdmResponder(ident.private_key, ident.chain_der, rng)


def counter_rng(seed: bytes):
    """Deterministic rng: SHA-256 in counter mode over a seed."""
    state = {"i": 0}

    def rng(n: int) -> bytes:
        out = b""
        while len(out) < n:
            out += hashlib.sha256(seed + state["i"].to_bytes(8, "big")).digest()
            state["i"] += 1
        return out[:n]

    return rng


def handshake(req: SpdmRequester, rsp: SpdmResponder):
    """Run a full session; returns every message exchanged."""
    msgs = []
    cert = rsp.handle(req.get_certificate())
    req.handle_certificate(cert)
    kex = req.key_exchange()
    kex_rsp = rsp.handle(kex)
    finish = req.handle_key_exchange_response(kex_rsp)
    done = rsp.handle(finish)
    req.handle_finish_response(done)
    msgs += [cert, kex, kex_rsp, finish, done]
    return msgs


def up_to_kex_response(req: SpdmRequester, rsp: SpdmResponder) -> KeyExchangeResponse:
    req.handle_certificate(rsp.handle(req.get_certificate()))
    return rsp.handle(req.key_exchange())


def flip(data: bytes, index: int = 0) -> bytes:
    return data[:index] + bytes([data[index] ^ 1]) + data[index + 1 :]


def test_happy_path_same_secret():
    req, rsp = SpdmRequester(), responder()
    msgs = handshake(req, rsp)
    assert len(req.session_secret) == 48
    assert req.session_secret == rsp.session_secret
    assert req.transcript == rsp.transcript
    assert req.state == rsp.state == "established"
    assert req.device_chain == device().chain_der
    kex_rsp = msgs[2]
    assert len(kex_rsp.signature) == 96 and len(kex_rsp.responder_verify) == 48
    assert len(msgs[1].requester_public) == 97 and msgs[1].requester_public[0] == 4
    assert isinstance(msgs[4], FinishResponse)


def test_two_sessions_differ():
    a_req, a_rsp = SpdmRequester(), responder()
    b_req, b_rsp = SpdmRequester(), responder()
    handshake(a_req, a_rsp)
    handshake(b_req, b_rsp)
    assert a_req.session_secret != b_req.session_secret


def test_deterministic_rng_reproduces_session():
    runs = []
    for _ in range(2):
        req = SpdmRequester(counter_rng(b"req"))
        rsp = responder(rng=counter_rng(b"rsp"))
        msgs = handshake(req, rsp)
        runs.append((msgs, req.transcript, req.session_secret))
    assert runs[0] == runs[1]
    other = SpdmRequester(counter_rng(b"other"))
    handshake(other, responder(rng=counter_rng(b"rsp")))
    assert other.session_secret != runs[0][2]


def test_tampered_signature_rejected():
    req, rsp = SpdmRequester(), responder()
    msg = up_to_kex_response(req, rsp)
    bad = structs.replace(msg, signature=flip(msg.signature, 10))
    with pytest.raises(IntegrityError):
        req.handle_key_exchange_response(bad)
    assert req.state == "failed"
    with pytest.raises(IllegalTransition):
        req.handle_key_exchange_response(msg)  # no retry after a failure


def test_malformed_signature_rejected():
    req, rsp = SpdmRequester(), responder()
    msg = up_to_kex_response(req, rsp)
    with pytest.raises(IntegrityError):
        req.handle_key_exchange_response(structs.replace(msg, signature=msg.signature[:95]))


def test_wrong_device_key_rejected():
    # The requester is shown device B's certificate but talks to device A.
    req, rsp_a, rsp_b = SpdmRequester(), responder("GPU-EMU-A"), responder("GPU-EMU-B")
    get = req.get_certificate()
    rsp_a.handle(get)
    req.handle_certificate(rsp_b.handle(GetCertificate()))
    with pytest.raises(IntegrityError):
        req.handle_key_exchange_response(rsp_a.handle(req.key_exchange()))


def test_verify_chain_hook_decides_the_device_key():
    other = device("GPU-EMU-B").private_key.public_key()
    seen = []

    def verifier(chain):
        seen.append(chain)
        return other

    req, rsp = SpdmRequester(verify_chain=verifier), responder()
    msg = up_to_kex_response(req, rsp)
    assert seen == [device().chain_der]
    with pytest.raises(IntegrityError):
        req.handle_key_exchange_response(msg)


def test_tampered_responder_verify_rejected():
    req, rsp = SpdmRequester(), responder()
    msg = up_to_kex_response(req, rsp)
    with pytest.raises(IntegrityError):
        req.handle_key_exchange_response(structs.replace(msg, responder_verify=flip(msg.responder_verify)))


def test_tampered_public_key_rejected():
    req, rsp = SpdmRequester(), responder()
    msg = up_to_kex_response(req, rsp)
    # Swap in a different valid point: the signature covers it.
    other = SpdmRequester()
    other.handle_certificate(responder().handle(other.get_certificate()))
    with pytest.raises(IntegrityError):
        req.handle_key_exchange_response(
            structs.replace(msg, responder_public=other.key_exchange().requester_public)
        )


def test_tampered_requester_verify_rejected():
    req, rsp = SpdmRequester(), responder()
    finish = req.handle_key_exchange_response(up_to_kex_response(req, rsp))
    with pytest.raises(IntegrityError):
        rsp.handle(Finish(requester_verify=flip(finish.requester_verify, 5)))
    assert rsp.state == "failed"
    with pytest.raises(IllegalTransition):
        _ = rsp.session_secret
    with pytest.raises(IllegalTransition):
        rsp.handle(finish)


def test_out_of_order_requester():
    req = SpdmRequester()
    with pytest.raises(IllegalTransition):
        req.key_exchange()
    with pytest.raises(IllegalTransition):
        _ = req.session_secret
    with pytest.raises(IllegalTransition):
        req.handle_finish_response(FinishResponse())
    req.get_certificate()
    with pytest.raises(IllegalTransition):
        req.get_certificate()
    with pytest.raises(IllegalTransition):
        req.handle_key_exchange_response(KeyExchangeResponse(b"", b"", b"", b""))


def test_out_of_order_responder():
    rsp = responder()
    with pytest.raises(IllegalTransition):
        rsp.handle(KeyExchange(bytes(32), bytes(97)))
    with pytest.raises(IllegalTransition):
        rsp.handle(Finish(bytes(48)))
    with pytest.raises(IllegalTransition):
        _ = rsp.session_secret
    rsp.handle(GetCertificate())
    with pytest.raises(IllegalTransition):
        rsp.handle(GetCertificate())
    with pytest.raises(IllegalTransition):
        rsp.handle(FinishResponse())
    with pytest.raises(ProtocolError):
        rsp.handle("not a message")


def test_malformed_inputs():
    rsp = responder()
    rsp.handle(GetCertificate())
    with pytest.raises(ProtocolError):
        rsp.handle(KeyExchange(bytes(31), bytes(97)))
    with pytest.raises(ProtocolError):
        rsp.handle(KeyExchange(bytes(32), b"\x04" + bytes(96)))  # not on the curve
    req = SpdmRequester()
    req.get_certificate()
    with pytest.raises(ProtocolError):
        req.handle_certificate(Certificate(chain_der=()))
    with pytest.raises(ProtocolError):
        req.handle_certificate(Certificate(chain_der=(b"not der",)))


def test_certificate_accepts_list_from_codec():
    chain = device().chain_der
    assert Certificate(chain_der=list(chain)) == Certificate(chain_der=chain)


def test_responder_checks_its_identity():
    a, b = device("GPU-EMU-A"), device("GPU-EMU-B")
    with pytest.raises(BadInput):
        SpdmResponder(a.private_key, b.chain_der)


def test_rng_must_return_requested_length():
    req = SpdmRequester(lambda n: b"\x01" * (n - 1))
    req.handle_certificate(responder().handle(req.get_certificate()))
    with pytest.raises(BadInput):
        req.key_exchange()


def test_repr_has_no_secret():
    req, rsp = SpdmRequester(), responder()
    handshake(req, rsp)
    for obj in (req, rsp, device()):
        assert req.session_secret.hex() not in repr(obj)
        assert repr(req.session_secret) not in repr(obj)


def test_signatures_are_low_s_and_a_high_s_twin_is_refused():
    """(r, n-s) verifies under plain ECDSA: one signature must have one encoding, or a relay could change
    signed evidence, and with it every digest taken of it, without the key."""
    from cryptography.hazmat.primitives.asymmetric import ec

    from gputravel.crypto.spdm import p384

    key = ec.generate_private_key(ec.SECP384R1())
    for i in range(32):
        digest = hashlib.sha384(bytes([i])).digest()
        sig = p384.sign(key, digest)
        s = int.from_bytes(sig[48:], "big")
        assert 0 < s <= p384._P384_ORDER // 2
        p384.verify(key.public_key(), sig, digest)
        twin = sig[:48] + (p384._P384_ORDER - s).to_bytes(48, "big")
        with pytest.raises(IntegrityError, match="low-s"):
            p384.verify(key.public_key(), twin, digest)
