"""GPU attestation: emulated H100 evidence, its 5-certificate chain, and the verifier."""

from __future__ import annotations

import os
import stat
from datetime import datetime, timedelta, timezone

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID, SignatureAlgorithmOID
from msgspec import structs

from gputravel.attest import (
    FWID_OID,
    AttestationError,
    Authority,
    EmulatedGpuVerifier,
    GpuClaims,
    ReferenceValues,
    TrustStore,
    Verifier,
    init_roots,
    load_authority,
    provision_gpu,
)
from gputravel.attest.gpu import GpuEvidence
from gputravel.attest.provision import GpuDevice
from gputravel.attest.roots import GPU_VENDOR_ROOT_CN, TEE_QUOTING_ROOT_CN
from gputravel.attest.verifier import EAT, spdm_chain_verifier
from gputravel.crypto.spdm import SpdmRequester, SpdmResponder
from gputravel.errors import BadInput, RemoteError
from gputravel.protocol.codec import decode, encode

NOW = datetime(2025, 6, 1, 12, 0, tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def vendor():
    return Authority.self_signed(GPU_VENDOR_ROOT_CN, now=NOW)


@pytest.fixture(scope="module")
def trust(vendor):
    tee = Authority.self_signed(TEE_QUOTING_ROOT_CN, now=NOW)
    return TrustStore((vendor.cert_der,), (tee.cert_der,))


@pytest.fixture(scope="module")
def device(vendor):
    return provision_gpu(vendor, serial="GPU-TEST-1", now=NOW)


@pytest.fixture(scope="module")
def verifier(trust, device):
    return EmulatedGpuVerifier(trust, device.reference_values())


def evidence_for(device_or_fw, nonce: bytes) -> bytes:
    fw = device_or_fw.firmware() if isinstance(device_or_fw, GpuDevice) else device_or_fw
    return encode(fw.get_evidence(nonce))


def refused(verifier, evidence: bytes, nonce: bytes, now=NOW) -> AttestationError:
    with pytest.raises(AttestationError) as info:
        verifier.verify(evidence, nonce, now)
    assert isinstance(info.value, RemoteError)
    return info.value


# ----------------------------------------------------------------------------- happy path
def test_fresh_evidence_verifies_and_claims_look_like_nvidias(verifier, device):
    nonce = os.urandom(32)
    claims = verifier.verify(evidence_for(device, nonce), nonce, NOW)
    assert isinstance(claims, GpuClaims) and claims.nonce == nonce
    assert claims.cc_mode and claims.measurement_result == "success" and claims.ueid == "GPU-TEST-1"
    eat = claims.eat()
    assert eat[EAT.OVERALL] is True and eat["eat_nonce"] == nonce.hex()
    for key in (EAT.NONCE_MATCH, EAT.SIGNATURE, EAT.CHAIN, EAT.FWID_MATCH, EAT.PARSED):
        assert key.startswith("x-nvidia-gpu-attestation-report-") and eat[key] is True
    assert eat["measres"] == "success" and eat[EAT.CC_MODE] == "on" and eat[EAT.EMULATED] is True
    assert eat["x-nvidia-gpu-driver-version"] == device.driver_version
    # Claims travel through the wire codec unchanged.
    assert decode(encode(claims), expect=GpuClaims) == claims


def test_the_verifier_is_an_implementation_of_the_interface(verifier):
    assert isinstance(verifier, Verifier)
    with pytest.raises(TypeError):
        Verifier()  # abstract


def test_chain_has_five_p384_certificates_and_the_leaf_carries_the_fwid(device):
    certs = [x509.load_der_x509_certificate(d) for d in device.chain_der]
    assert len(certs) == 5
    for cert in certs:
        assert isinstance(cert.public_key().curve, ec.SECP384R1)
        assert cert.signature_algorithm_oid == SignatureAlgorithmOID.ECDSA_WITH_SHA384
        cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
        assert cn.startswith("EMULATED") and cn.endswith("(not NVIDIA)")
    assert certs[-1].issuer == certs[-1].subject  # self-signed vendor root
    fwid = certs[0].extensions.get_extension_for_oid(FWID_OID).value.value
    assert len(fwid) == 48 and device.firmware().get_evidence(os.urandom(32)).response.find(fwid) > 0


def test_device_state_round_trips_through_files(tmp_path, verifier, device):
    device.save(tmp_path)
    assert stat.S_IMODE((tmp_path / "device-firmware.key").stat().st_mode) == 0o600
    loaded = GpuDevice.load(tmp_path)
    assert loaded.chain_der == device.chain_der and loaded.measurements == device.measurements
    assert ReferenceValues.load(tmp_path / "reference-values.json") == device.reference_values()
    nonce = os.urandom(32)
    assert verifier.verify(evidence_for(loaded, nonce), nonce, NOW).ueid == "GPU-TEST-1"
    assert "PRIVATE" not in repr(loaded) and "leaf_key" not in repr(loaded)


def test_roots_say_they_are_emulated_and_keys_are_private(tmp_path):
    trust = init_roots(tmp_path / "roots", now=NOW)
    for name in ("gpu-vendor-root.key", "tee-quoting-root.key"):
        assert stat.S_IMODE((tmp_path / "roots" / name).stat().st_mode) == 0o600
    gpu = x509.load_der_x509_certificate(trust.gpu_roots[0]).subject.rfc4514_string()
    tee = x509.load_der_x509_certificate(trust.tee_roots[0]).subject.rfc4514_string()
    assert "EMULATED" in gpu and "(not NVIDIA)" in gpu and "EMULATED" in tee and "(not Intel)" in tee
    assert load_authority(tmp_path / "roots", "gpu").cert_der == trust.gpu_roots[0]
    with pytest.raises(BadInput):
        init_roots(tmp_path / "roots")  # never overwrites


def test_spdm_requester_accepts_only_a_device_chaining_to_the_vendor_root(trust, device, vendor):
    req = SpdmRequester(verify_chain=spdm_chain_verifier(trust, NOW))
    rsp = SpdmResponder(device.leaf_key, device.chain_der)
    req.handle_certificate(rsp.handle(req.get_certificate()))
    req.handle_finish_response(rsp.handle(req.handle_key_exchange_response(rsp.handle(req.key_exchange()))))
    assert req.session_secret == rsp.session_secret
    impostor = provision_gpu(Authority.self_signed(GPU_VENDOR_ROOT_CN, now=NOW), now=NOW)
    req = SpdmRequester(verify_chain=spdm_chain_verifier(trust, NOW))
    rsp = SpdmResponder(impostor.leaf_key, impostor.chain_der)
    with pytest.raises(AttestationError) as info:
        req.handle_certificate(rsp.handle(req.get_certificate()))
    assert info.value.claim == "chain"


# ----------------------------------------------------------------------------- refusals
def test_tampered_report_byte_is_refused(verifier, device):
    nonce = os.urandom(32)
    ev = device.firmware().get_evidence(nonce)
    response = bytearray(ev.response)
    response[len(response) // 2] ^= 0x01
    err = refused(verifier, encode(structs.replace(ev, response=bytes(response))), nonce)
    assert err.claim == "signature" and err.claims[EAT.SIGNATURE] is False


def test_evidence_replayed_under_a_new_nonce_is_refused(verifier, device):
    old = evidence_for(device, os.urandom(32))
    err = refused(verifier, old, os.urandom(32))
    assert err.claim == "nonce" and err.claims[EAT.NONCE_MATCH] is False
    assert err.claims[EAT.SIGNATURE] is True  # genuine, just not for this nonce


def test_unknown_measurement_is_refused_naming_the_index(verifier, device):
    changed = dict(device.measurements)
    changed[3] = bytes(48)
    nonce = os.urandom(32)
    err = refused(verifier, evidence_for(device.firmware(measurements=changed), nonce), nonce)
    assert err.claim == "measurement" and "index 3" in err.reason
    assert err.claims["measres"] == "fail" and err.claims[EAT.MISMATCHED] == [3]


def test_broken_chain_is_refused(vendor, verifier, device):
    other = provision_gpu(vendor, serial="GPU-TEST-2", now=NOW)
    chain = list(device.chain_der)
    chain[2] = other.chain_der[2]  # another provisioner ICA: the device cert's signature fails
    nonce = os.urandom(32)
    err = refused(verifier, evidence_for(device.firmware(cert_chain=tuple(chain)), nonce), nonce)
    assert err.claim == "chain" and "not signed by" in err.reason
    short = device.firmware(cert_chain=device.chain_der[:1] + device.chain_der[2:])
    assert refused(verifier, evidence_for(short, nonce), nonce).claim == "chain"


def test_certificate_from_another_root_is_refused(verifier):
    impostor_root = Authority.self_signed(GPU_VENDOR_ROOT_CN, now=NOW)  # same name, other key
    impostor = provision_gpu(impostor_root, serial="GPU-TEST-1", now=NOW)
    nonce = os.urandom(32)
    err = refused(verifier, evidence_for(impostor, nonce), nonce)
    assert err.claim == "chain" and "trusted root" in err.reason


def test_expired_certificate_is_refused_at_the_time_passed_in(vendor, trust):
    short_lived = provision_gpu(vendor, serial="GPU-TEST-3", now=NOW, days=1)
    verifier = EmulatedGpuVerifier(trust, short_lived.reference_values())
    nonce = os.urandom(32)
    evidence = evidence_for(short_lived, nonce)
    assert verifier.verify(evidence, nonce, NOW + timedelta(hours=12)).ueid == "GPU-TEST-3"
    err = refused(verifier, evidence, nonce, now=NOW + timedelta(days=2))
    assert err.claim == "expired" and "expired" in err.reason
    assert refused(verifier, evidence, nonce, now=NOW - timedelta(days=1)).claim == "expired"


def test_fwid_mismatch_is_refused(verifier, device):
    nonce = os.urandom(32)
    err = refused(verifier, evidence_for(device.firmware(fwid=os.urandom(48)), nonce), nonce)
    assert err.claim == "fwid" and err.claims[EAT.FWID_MATCH] is False


def test_cc_mode_off_is_refused(verifier, device):
    nonce = os.urandom(32)
    err = refused(verifier, evidence_for(device.firmware(cc_mode=False), nonce), nonce)
    assert err.claim == "cc_mode" and err.claims[EAT.CC_MODE] == "off"


def test_driver_version_other_than_the_reference_is_refused(verifier, device):
    nonce = os.urandom(32)
    err = refused(verifier, evidence_for(device.firmware(driver_version="999.0"), nonce), nonce)
    assert err.claim == "measurement"


def test_garbage_evidence_is_refused_as_format(verifier, device):
    nonce = os.urandom(32)
    assert refused(verifier, b"\x00not msgpack", nonce).claim == "format"
    ev = device.firmware().get_evidence(nonce)
    assert refused(verifier, encode(GpuEvidence(ev.request, ev.response, ev.signature[:10], ev.cert_chain)),
                   nonce).claim == "signature"


def test_bad_arguments_are_local_errors(verifier, device):
    with pytest.raises(BadInput):
        verifier.verify(b"", b"short", NOW)
    with pytest.raises(BadInput):
        verifier.verify(b"", os.urandom(32), datetime(2025, 1, 1))  # naive time
    with pytest.raises(BadInput):
        device.firmware().get_evidence(b"short")
