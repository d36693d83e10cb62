"""CVM quotes, RA-TLS binding, holder policies, and the holder's own check of the GPU's evidence."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID
from msgspec import structs

import gputravel
from gputravel.attest import (
    AttestationError,
    AttestChallenge,
    Authority,
    EmulatedGpuVerifier,
    EmulatedQuoteVerifier,
    EmulatedQuotingEnclave,
    Policy,
    TrustStore,
    answer_challenge,
    attest_orchestrator,
    extract_quote,
    make_ra_tls_certificate,
    measure_code,
    orchestrator_measurement,
    provision_gpu,
    report_data_for_tls,
    verify_bound_quote,
    verify_ra_tls,
)
from gputravel.attest.chain import sign_p384
from gputravel.crypto.spdm.p384 import _P384_ORDER as P384_ORDER
from gputravel.attest.quote import ZERO_RTMRS, Quote, canonical_json, rtmr_after
from gputravel.attest.ratls import quote_extension, spki_der
from gputravel.attest.roots import GPU_VENDOR_ROOT_CN, TEE_QUOTING_ROOT_CN
from gputravel.crypto.certs import issue_certificate as _issue, new_key as _new_key, subject_name as _name
from gputravel.errors import BadInput, TransportClosed
from gputravel.protocol.codec import decode, encode

NOW = datetime(2025, 6, 1, 12, 0, tzinfo=timezone.utc)
CONFIG = {"holders": 3, "buffer_mib": 8, "model": "gpt2-tiny"}
JOB = bytes(range(48))  # the job digest the orchestrator extends RTMR[3] with and holders approve
RTMR = (*ZERO_RTMRS[:3], rtmr_after([JOB]))


@pytest.fixture(scope="module")
def roots():
    return (Authority.self_signed(GPU_VENDOR_ROOT_CN, now=NOW),
            Authority.self_signed(TEE_QUOTING_ROOT_CN, now=NOW))


@pytest.fixture(scope="module")
def trust(roots):
    return TrustStore((roots[0].cert_der,), (roots[1].cert_der,))


@pytest.fixture(scope="module")
def enclave(roots):
    return EmulatedQuotingEnclave.provision(roots[1], now=NOW)


@pytest.fixture(scope="module")
def measurement():
    return orchestrator_measurement(CONFIG)


@pytest.fixture(scope="module")
def policy(measurement):
    return Policy((measurement,), approved_jobs=(JOB,))


@pytest.fixture(scope="module")
def gpu(roots):
    return provision_gpu(roots[0], now=NOW)


@pytest.fixture(scope="module")
def orchestrator_tls(roots):
    """The orchestrator's ordinary TLS certificate and key (as in the cohort PKI)."""
    key = _new_key()
    cert = _issue(subject=_name("orchestrator"), public_key=key.public_key(), issuer=_name("orchestrator"),
                  issuer_key=key, not_before=NOW, days=30, is_ca=False)
    return cert.public_bytes(serialization.Encoding.DER), key


def refused(call, *args, **kwargs) -> AttestationError:
    with pytest.raises(AttestationError) as info:
        call(*args, **kwargs)
    return info.value


# ----------------------------------------------------------------------------- measurement
def test_measurement_covers_code_and_config(tmp_path, measurement):
    assert len(measurement) == 48
    assert orchestrator_measurement(dict(reversed(list(CONFIG.items())))) == measurement  # canonical JSON
    assert orchestrator_measurement({**CONFIG, "holders": 4}) != measurement
    assert canonical_json({"b": 1, "a": [1, "é"]}) == '{"a":[1,"é"],"b":1}'.encode()
    with pytest.raises(BadInput):
        canonical_json({"x": float("nan")})
    package = Path(gputravel.__file__).parent
    assert measure_code() == measure_code(package)


def test_orchestrator_code_changed_after_pinning_is_refused(tmp_path, trust, enclave):
    tree = tmp_path / "gputravel"
    shutil.copytree(Path(gputravel.__file__).parent, tree, ignore=shutil.ignore_patterns("__pycache__"))
    pinned = orchestrator_measurement(CONFIG, package_dir=tree)
    assert pinned == orchestrator_measurement(CONFIG)  # a faithful copy measures the same
    target = tree / "attest" / "policy.py"
    data = bytearray(target.read_bytes())
    data[-2] ^= 0x20  # one byte
    target.write_bytes(bytes(data))
    changed = orchestrator_measurement(CONFIG, package_dir=tree)
    assert changed != pinned
    holder_policy = Policy((pinned,))
    report_data = os.urandom(64)
    err = refused(EmulatedQuoteVerifier(trust, holder_policy.orchestrator_measurements).verify,
                  enclave.quote(changed, report_data), report_data, NOW)
    assert err.claim == "measurement"


# ----------------------------------------------------------------------------- quotes
def test_quote_verifies_with_claims(trust, enclave, measurement):
    report_data = os.urandom(64)
    claims = EmulatedQuoteVerifier(trust, [measurement]).verify(enclave.quote(measurement, report_data),
                                                               report_data, NOW)
    assert claims.measurement == measurement and claims.report_data == report_data
    eat = claims.eat()
    assert eat["x-gputravel-cvm-overall-att-result"] is True and eat["x-gputravel-cvm-tee"] == "emulated-tdx"


def test_policy_not_listing_the_orchestrator_measurement_is_refused(trust, enclave, measurement):
    other_policy = Policy((orchestrator_measurement({"something": "else"}),))
    tls_cert, _ = make_ra_tls_certificate(enclave, measurement, nonce := os.urandom(32), now=NOW, rtmr=RTMR)
    err = refused(verify_ra_tls, tls_cert, nonce, other_policy, trust, NOW, job_digest=JOB)
    assert err.claim == "measurement" and err.claims["x-gputravel-cvm-measurement-accepted"] is False


def test_tampered_foreign_and_expired_quotes_are_refused(roots, trust, enclave, measurement):
    verifier = EmulatedQuoteVerifier(trust, [measurement])
    report_data = os.urandom(64)
    quote = decode(enclave.quote(measurement, report_data), expect=Quote)
    body = bytearray(quote.body)
    body[-1] ^= 1
    tampered = encode(structs.replace(quote, body=bytes(body)))
    assert refused(verifier.verify, tampered, report_data, NOW).claim == "signature"
    foreign = EmulatedQuotingEnclave.provision(Authority.self_signed(TEE_QUOTING_ROOT_CN, now=NOW), now=NOW)
    assert refused(verifier.verify, foreign.quote(measurement, report_data), report_data, NOW).claim == "chain"
    short = EmulatedQuotingEnclave.provision(roots[1], now=NOW, days=1)
    assert refused(verifier.verify, short.quote(measurement, report_data), report_data,
                   NOW + timedelta(days=3)).claim == "expired"
    assert refused(verifier.verify, b"junk", report_data, NOW).claim == "format"


# ----------------------------------------------------------------------------- RA-TLS
def test_report_data_binds_key_and_nonce():
    spki, nonce = b"spki-der", os.urandom(32)
    rd = report_data_for_tls(spki, nonce)
    assert len(rd) == 64 and rd == report_data_for_tls(spki, nonce)
    assert rd != report_data_for_tls(b"spki-dex", nonce) and rd != report_data_for_tls(spki, os.urandom(32))
    with pytest.raises(BadInput):
        report_data_for_tls(spki, b"short")


def test_ra_tls_certificate_verifies(trust, enclave, measurement, policy):
    nonce = os.urandom(32)
    cert, _ = make_ra_tls_certificate(enclave, measurement, nonce, now=NOW, rtmr=RTMR)
    claims = verify_ra_tls(cert, nonce, policy, trust, NOW, job_digest=JOB)
    assert claims.measurement == measurement
    assert claims.report_data == report_data_for_tls(spki_der(cert), nonce)
    parsed = x509.load_der_x509_certificate(cert)
    eku = parsed.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku
    assert refused(verify_ra_tls, cert, os.urandom(32), policy, trust, NOW, job_digest=JOB).claim == "binding"


def test_man_in_the_middle_reusing_a_genuine_quote_is_refused(trust, enclave, measurement, policy):
    nonce = os.urandom(32)
    genuine, _ = make_ra_tls_certificate(enclave, measurement, nonce, now=NOW, rtmr=RTMR)
    mitm_key = _new_key()
    mitm = _issue(subject=_name("orchestrator"), public_key=mitm_key.public_key(), issuer=_name("orchestrator"),
                  issuer_key=mitm_key, not_before=NOW, days=1, is_ca=False,
                  extensions=[(quote_extension(extract_quote(genuine)), False)])
    mitm_der = mitm.public_bytes(serialization.Encoding.DER)
    err = refused(verify_ra_tls, mitm_der, nonce, policy, trust, NOW, job_digest=JOB)
    assert err.claim == "binding" and err.claims["x-gputravel-cvm-measurement-accepted"] is True


def test_certificate_without_a_quote_is_refused(trust, policy, orchestrator_tls):
    assert refused(verify_ra_tls, orchestrator_tls[0], os.urandom(32), policy, trust, NOW,
                   job_digest=JOB).claim == "format"


# ----------------------------------------------------------------------------- the exchange
def _answer(enclave, measurement, cert, nonce, gpu_evidence):
    """What an orchestrator-side party that holds the TLS key and can get quotes sends."""
    return answer_challenge(AttestChallenge(nonce), quote=lambda rd: enclave.quote(measurement, rd, RTMR),
                            tls_cert_der=cert, gpu_evidence=gpu_evidence, job_digest=JOB)


def test_holder_attests_orchestrator_and_its_gpu(trust, enclave, measurement, policy, gpu, orchestrator_tls):
    cert, _ = orchestrator_tls
    nonce = os.urandom(32)
    answer = _answer(enclave, measurement, cert, nonce, encode(gpu.firmware().get_evidence(nonce)))
    result = attest_orchestrator(answer, peer_cert_der=cert, nonce=nonce, policy=policy, trust=trust,
                                 reference=gpu.reference_values(), now=NOW + timedelta(minutes=1))
    assert result.cvm.measurement == measurement and result.gpu.nonce == nonce and result.gpu.ueid == gpu.serial
    assert result.eat()["gpu"]["x-nvidia-overall-att-result"] is True
    # the quote alone verifies as a message bound to the handshake certificate
    assert verify_bound_quote(answer.quote, cert, nonce, policy, trust, NOW, job_digest=JOB).measurement == measurement
    assert result.job_digest == JOB and result.eat()["job"] == JOB.hex()
    with pytest.raises(BadInput):
        answer_challenge(AttestChallenge(b"short"), quote=lambda rd: b"", tls_cert_der=cert, gpu_evidence=b"",
                         job_digest=JOB)


def _forgeries(gpu, nonce: bytes, now: datetime, trust) -> dict[str, tuple[bytes, str]]:
    """GPU evidence an orchestrator-side party could present, and the claim that refuses each."""
    genuine = gpu.firmware().get_evidence(nonce)
    claims = EmulatedGpuVerifier(trust, gpu.reference_values()).verify(encode(genuine), nonce, now)
    phantom = structs.replace(claims, ueid="GPU-THAT-DOES-NOT-EXIST")
    foreign = provision_gpu(Authority.self_signed(GPU_VENDOR_ROOT_CN, now=NOW), serial=gpu.serial, now=NOW)
    body = bytearray(genuine.response)
    body[-1] ^= 1
    return {
        "claims, no evidence (what the orchestrator used to sign)": (encode(phantom), "format"),
        "a device not under the vendor root": (encode(foreign.firmware().get_evidence(nonce)), "chain"),
        "a real GPU's evidence for another nonce": (encode(gpu.firmware().get_evidence(os.urandom(32))), "nonce"),
        "a real GPU's evidence, edited": (encode(structs.replace(genuine, response=bytes(body))), "signature"),
        "the real evidence, its signature's high-s twin (r, n-s)": (encode(structs.replace(genuine, signature=(
            genuine.signature[:48] + (P384_ORDER - int.from_bytes(genuine.signature[48:], "big")).to_bytes(48, "big")
        ))), "signature"),
        "the real chain, signed by another key": (encode(structs.replace(genuine, signature=sign_p384(
            _new_key(), genuine.request + genuine.response))), "signature"),
        "a real GPU outside CC mode": (encode(gpu.firmware(cc_mode=False).get_evidence(nonce)), "cc_mode"),
        "a real GPU with other firmware": (encode(gpu.firmware(measurements={
            **dict(gpu.measurements), 1: b"\x01" * 48}).get_evidence(nonce)), "measurement"),
    }


def test_forged_gpu_claims_are_refused_by_the_holder(trust, enclave, measurement, policy, gpu, orchestrator_tls):
    """red team: forged-gpu-claims. The review: anyone holding the orchestrator's TLS key and
    the quoting key got a holder to accept claims for a GPU that does not exist. Here the
    forging party has both (a genuine quote binding the TLS key and the holder's nonce, with
    the pinned measurement); the holder verifies the GPU's own evidence for its nonce against
    the vendor root and the reference values, and refuses every forgery."""
    cert, _ = orchestrator_tls
    nonce = os.urandom(32)
    for what, (gpu_evidence, claim) in _forgeries(gpu, nonce, NOW, trust).items():
        answer = _answer(enclave, measurement, cert, nonce, gpu_evidence)
        err = refused(attest_orchestrator, answer, peer_cert_der=cert, nonce=nonce, policy=policy, trust=trust,
                      reference=gpu.reference_values(), now=NOW)
        assert err.claim == claim, what
    # control: the same party relaying the real GPU's evidence for this nonce is accepted
    answer = _answer(enclave, measurement, cert, nonce, encode(gpu.firmware().get_evidence(nonce)))
    assert attest_orchestrator(answer, peer_cert_der=cert, nonce=nonce, policy=policy, trust=trust,
                               reference=gpu.reference_values(), now=NOW).gpu.nonce == nonce


def test_forged_gpu_claims_make_the_holder_runtime_hang_up(tmp_path, trust, enclave, measurement, policy, gpu,
                                                           orchestrator_tls):
    """red team: forged-gpu-claims, through the holder's runtime (challenge_orchestrator): it
    sends its nonce, gets a genuine quote with evidence for another nonce, refuses, hangs up."""
    import threading

    from gputravel.attest.material import HolderMaterial
    from gputravel.holder.attestation import challenge_orchestrator
    from gputravel.transport.unix import socketpair_transports

    cert, _ = orchestrator_tls
    holder_end, orchestrator_end = socketpair_transports("orchestrator", "holder")
    holder_end.peer_certificate = lambda: cert  # what the TLS handshake would have shown

    def forging_orchestrator() -> None:
        challenge = orchestrator_end.recv(timeout=10, expect=AttestChallenge).message
        stale = encode(gpu.firmware().get_evidence(os.urandom(32)))
        orchestrator_end.send(_answer(enclave, measurement, cert, challenge.nonce, stale))

    thread = threading.Thread(target=forging_orchestrator)
    thread.start()
    material = HolderMaterial(trust, policy, gpu.reference_values())
    with pytest.raises(AttestationError) as err:
        challenge_orchestrator(holder_end, material, timeout=10, now=lambda: NOW)
    thread.join()
    assert err.value.claim == "nonce"
    with pytest.raises(TransportClosed):  # it hung up: no AttestAccepted, no hello, no data
        orchestrator_end.recv(timeout=10)


# ----------------------------------------------------------------------------- policy file
def test_policy_file_loads(tmp_path, measurement):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({
        "format": "gputravel-holder-policy-v1", "orchestrator_measurements": [measurement.hex()],
        "gpu": {"cc_mode": "on", "measurement_result": "success", "driver_versions": ["550.1"]},
        "max_evidence_age_s": 60, "gpu_reference_values": "ref.json"}))
    policy = Policy.load(path)
    assert policy.orchestrator_measurements == (measurement,) and policy.max_evidence_age_s == 60
    assert policy.gpu.driver_versions == ("550.1",) and policy.gpu_reference_values == tmp_path / "ref.json"
    assert Policy.from_json(policy.to_json(), base_dir=Path("/")) == dataclasses.replace(
        policy, gpu_reference_values=tmp_path / "ref.json")


@pytest.mark.parametrize("raw, needle", [
    ("{not json", "invalid JSON"),
    ('{"format": "gputravel-holder-policy-v1", "orchestrator_measurements": [], "extra": 1}', "unknown keys"),
    ('{"format": "gputravel-holder-policy-v1", "orchestrator_measurements": ["abcd"]}', "96 hex"),
    ('{"format": "gputravel-holder-policy-v1", "orchestrator_measurements": [], "gpu": {"cc_mode": "off"}}',
     "cc_mode"),
    ('{"format": "gputravel-holder-policy-v1", "orchestrator_measurements": [], "max_evidence_age_s": 0}',
     "max_evidence_age_s"),
    ('{"orchestrator_measurements": []}', "missing keys"),
])
def test_bad_policy_files_are_bad_input(tmp_path, raw, needle):
    path = tmp_path / "policy.json"
    path.write_text(raw)
    with pytest.raises(BadInput, match=needle):
        Policy.load(path)
    with pytest.raises(BadInput, match="cannot read"):
        Policy.load(tmp_path / "absent.json")
