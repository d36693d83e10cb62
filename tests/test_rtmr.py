"""RTMR[3] carries the job; holders approve jobs by digest (issue 28).

The orchestrator's MRTD measures its code and config less the job; at boot it asks its TDX
module to extend RTMR[3] with the job digest, names that digest in every AttestEvidence (an
event log: untrusted), and a holder accepts only if the quoted RTMR[3] replays to it and its
policy approves it. Red-team rows: changed-job, replayed-approval."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import msgpack
import pytest
from cryptography.hazmat.primitives import serialization

from gputravel.attest import (AttestationError, Authority, EmulatedQuoteVerifier, EmulatedQuotingEnclave, Policy,
                              TrustStore, verify_bound_quote)
from gputravel.attest.quote import (JOB_RTMR, ZERO_RTMRS, Quote, orchestrator_measurement, rtmr_after,
                                    rtmr_extend)
from gputravel.attest.ratls import report_data_for_tls, spki_der
from gputravel.attest.rank import QuotingRankTee
from gputravel.attest.roots import TEE_QUOTING_ROOT_CN
from gputravel.attest.chain import sign_p384
from gputravel.cohort.trust import TrustOptions, measure_orchestrator, measured_config
from gputravel.crypto.certs import issue_certificate, new_key, subject_name
from gputravel.errors import BadInput
from gputravel.firmware.tdx_module import GUEST_RTMRS, Launch, Peer, QuotingRefused, TdxModule, extend_rtmr
from gputravel.orchestrator.cvm import OrchestratorConfig
from gputravel.orchestrator.job import job_digest, job_json_digest
from gputravel.protocol.codec import encode
from gputravel.protocol.layout import Layout

NOW = datetime(2030, 1, 1, tzinfo=timezone.utc)
MIB = 1 << 20
MEASURED = bytes(range(48))
ROOT = Authority.self_signed(TEE_QUOTING_ROOT_CN, now=NOW.replace(year=2029))
TRUST = TrustStore((), (ROOT.cert_der,))
JOB_A, JOB_B = job_json_digest('{"steps":10}'), job_json_digest('{"steps":11}')


def rtmrs(*jobs: bytes) -> tuple[bytes, bytes, bytes, bytes]:
    return (*ZERO_RTMRS[:3], rtmr_after(jobs))  # type: ignore[return-value]


def refused(call, *args, **kwargs) -> AttestationError:
    with pytest.raises(AttestationError) as info:
        call(*args, **kwargs)
    return info.value


# ----------------------------------------------------------------------------- the register
def test_rtmr_after_replays_tdx_extend_from_48_zero_bytes() -> None:
    assert rtmr_after([]) == bytes(48)
    assert rtmr_after([JOB_A]) == hashlib.sha384(bytes(48) + JOB_A).digest()
    assert rtmr_after([JOB_A, JOB_B]) == hashlib.sha384(rtmr_after([JOB_A]) + JOB_B).digest()
    assert rtmr_after([JOB_A, JOB_B]) != rtmr_after([JOB_B, JOB_A])  # order is measured
    with pytest.raises(BadInput):
        rtmr_extend(bytes(48), b"short")


def test_the_core_extends_only_the_guest_rtmrs_of_the_launched_cvm_and_quotes_all_four() -> None:
    core = TdxModule()
    me = Peer(10, 0, 500)
    assert core.extend(me, JOB_RTMR, JOB_A) is None  # not ready: held, as a quote is
    core.certified((ROOT.issue("q", core.key.public_key(), is_ca=False, now=NOW.replace(year=2029)), ROOT.cert_der))
    core.register(Launch(10, 0, MEASURED, 500))
    for other in (Peer(11, 0, 500), Peer(10, 1, 500), Peer(10, 0, 499)):  # another pid, uid, or process
        with pytest.raises(QuotingRefused):
            core.extend(other, JOB_RTMR, JOB_A)
    for index in (0, 1, 4, -1):  # 0 and 1 are the boot's; there are four
        with pytest.raises(QuotingRefused, match=f"RTMR {index} cannot be extended"):
            core.extend(me, index, JOB_A)
    with pytest.raises(QuotingRefused, match="48-byte digest"):
        core.extend(me, JOB_RTMR, JOB_A[:47])
    assert GUEST_RTMRS == {2, 3} and core.rtmr == list(ZERO_RTMRS)  # nothing refused changed a register
    assert core.extend(me, JOB_RTMR, JOB_A) == rtmr_after([JOB_A])
    report_data = os.urandom(64)
    quote = core.decide(me, report_data)
    assert quote is not None
    claims = EmulatedQuoteVerifier(TRUST, [MEASURED]).verify(quote, report_data, NOW)
    assert claims.rtmr == rtmrs(JOB_A) and claims.measurement == MEASURED
    assert claims.eat()["x-gputravel-cvm-rtmr"][JOB_RTMR] == rtmr_after([JOB_A]).hex()


def test_a_quote_with_misshapen_rtmrs_is_neither_made_nor_accepted() -> None:
    enclave = EmulatedQuotingEnclave.provision(ROOT, now=NOW.replace(year=2029))
    with pytest.raises(BadInput, match="4 RTMRs"):
        enclave.quote(MEASURED, bytes(64), (bytes(48),) * 3)  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="4 RTMRs"):
        enclave.quote(MEASURED, bytes(64), (bytes(47),) * 4)  # type: ignore[arg-type]
    # The quoting key itself signing a body of three registers, or a short one: the verifier refuses it.
    for bad in ([bytes(48)] * 3, [bytes(48)] * 3 + [bytes(47)]):
        body = msgpack.packb({"t": "attest.cvm.quote_body", "f": {"tee": "emulated-tdx", "mr_td": MEASURED,
                                                                 "report_data": bytes(64), "rtmr": bad}})
        forged = encode(Quote(body, sign_p384(enclave.key, body), enclave.cert_chain))
        assert refused(EmulatedQuoteVerifier(TRUST, [MEASURED]).verify, forged, bytes(64), NOW).claim == "format"


# ----------------------------------------------------------------------------- the holder's check
@pytest.fixture(scope="module")
def orchestrator() -> tuple[bytes, EmulatedQuotingEnclave]:
    key = new_key()
    cert = issue_certificate(subject=subject_name("orchestrator"), public_key=key.public_key(),
                             issuer=subject_name("orchestrator"), issuer_key=key, not_before=NOW.replace(year=2029),
                             days=800, is_ca=False)
    return cert.public_bytes(serialization.Encoding.DER), EmulatedQuotingEnclave.provision(ROOT, now=NOW.replace(
        year=2029))


def holder_check(orchestrator, policy: Policy, *, extended: tuple[bytes, ...], named: bytes):
    """What a holder concludes of an orchestrator whose RTMR[3] was extended with `extended`, naming `named`."""
    cert, enclave = orchestrator
    nonce = os.urandom(32)
    quote = enclave.quote(MEASURED, report_data_for_tls(spki_der(cert), nonce), rtmrs(*extended))
    return verify_bound_quote(quote, cert, nonce, policy, TRUST, NOW, job_digest=named)


def test_a_holder_accepts_only_the_job_it_approved_and_names_the_digest_it_saw(orchestrator) -> None:
    approves_a = Policy((MEASURED,), approved_jobs=(JOB_A,))
    assert holder_check(orchestrator, approves_a, extended=(JOB_A,), named=JOB_A).rtmr[JOB_RTMR] == rtmr_after([JOB_A])
    err = refused(holder_check, orchestrator, approves_a, extended=(JOB_B,), named=JOB_B)
    assert err.claim == "job"
    assert str(err).endswith(f"the orchestrator runs job {JOB_B.hex()}; this holder approved no such job")


def test_replayed_approval_an_old_approval_does_not_admit_a_new_job(orchestrator) -> None:
    """red team: replayed-approval. The holder approved job A; the orchestrator runs job B. Naming
    A (the old approval's digest) does not replay to its RTMR[3]; naming B, B is not approved; an
    RTMR[3] extended with A and then B (A "approved first") replays to neither."""
    approves_a = Policy((MEASURED,), approved_jobs=(JOB_A,))
    err = refused(holder_check, orchestrator, approves_a, extended=(JOB_B,), named=JOB_A)
    assert err.claim == "job" and "RTMR[3] does not match the job the orchestrator names" in str(err)
    assert "approved no such job" in str(refused(holder_check, orchestrator, approves_a, extended=(JOB_B,),
                                                 named=JOB_B))
    for named in (JOB_A, JOB_B):
        assert refused(holder_check, orchestrator, approves_a, extended=(JOB_A, JOB_B), named=named).claim == "job"
    # An unextended RTMR[3] (a CVM that skipped the extend) matches no job, not even the any-job digest.
    assert refused(holder_check, orchestrator, Policy((MEASURED,), approved_jobs=(job_json_digest(""),)),
                   extended=(), named=job_json_digest("")).claim == "job"


def test_a_holder_that_approved_no_job_refuses_every_job(orchestrator) -> None:
    err = refused(holder_check, orchestrator, Policy((MEASURED,)), extended=(JOB_A,), named=JOB_A)
    assert err.claim == "job" and JOB_A.hex()[:16] in str(err) and "gputravel job approve" in str(err)
    with pytest.raises(AttestationError, match="does not match"):  # a digest that is no digest
        holder_check(orchestrator, Policy((MEASURED,), approved_jobs=(JOB_A,)), extended=(JOB_A,), named=b"")


def test_the_policy_file_lists_approved_jobs_as_hex(tmp_path: Path) -> None:
    policy = Policy((MEASURED,), approved_jobs=(JOB_A, JOB_B))
    assert Policy.from_json(policy.to_json()).approved_jobs == (JOB_A, JOB_B)
    raw = {"format": "gputravel-holder-policy-v1", "orchestrator_measurements": [MEASURED.hex()]}
    assert Policy.from_json(raw).approved_jobs == ()  # absent: none approved, every job refused
    with pytest.raises(BadInput, match=r"approved_jobs\[0\] must be 96 hex"):
        Policy.from_json({**raw, "approved_jobs": ["ab" * 10]})
    with pytest.raises(BadInput, match="approved_jobs must be a list"):
        Policy.from_json({**raw, "approved_jobs": JOB_A.hex()})


# ----------------------------------------------------------------------------- what is measured where
def test_the_measurement_leaves_the_job_out_and_the_job_digest_takes_it_in() -> None:
    base = OrchestratorConfig("host.sock", "pki", Layout(), MIB, job_json='{"steps":10}')
    other_job = OrchestratorConfig("host.sock", "pki", Layout(), MIB, job_json='{"steps":11}')
    assert measure_orchestrator(base) == measure_orchestrator(other_job)
    assert "job_json" not in measured_config(base) and "manifest_json" not in measured_config(base)
    assert job_digest(base) == JOB_A and job_digest(other_job) == JOB_B and JOB_A != JOB_B
    assert job_digest(OrchestratorConfig("h", "p", Layout(), MIB)) == job_json_digest("")  # the any-job digest
    assert measure_orchestrator(OrchestratorConfig("host.sock", "pki", Layout(), MIB, verify=False)) != \
        measure_orchestrator(base)  # behaviour is still measured
    assert orchestrator_measurement({"a": 1}) != orchestrator_measurement({"a": 2})


def test_a_manifest_job_is_digested_as_its_manifest_and_must_be_its_job() -> None:
    manifest = pytest.importorskip("gputravel.manifest")
    from gputravel.train.job import TrainConfig

    cfg = TrainConfig(steps=3)
    m = manifest.JobManifest.for_job(cfg, holders=("h1", "h2"), quorum=1, outputs=manifest.Outputs(model="sealed"))
    config = OrchestratorConfig("h", "p", Layout(), MIB, job_json=cfg.canonical_json(), manifest_json=m.to_json())
    assert job_digest(config) == m.digest()
    with pytest.raises(BadInput, match=r"job\.steps"):
        job_digest(OrchestratorConfig("h", "p", Layout(), MIB, job_json=TrainConfig(steps=4).canonical_json(),
                                      manifest_json=m.to_json()))
    with pytest.raises(BadInput, match="manifest's job"):
        job_digest(OrchestratorConfig("h", "p", Layout(), MIB, manifest_json=m.to_json()))


def test_trust_options_check_approved_jobs() -> None:
    assert TrustOptions(approved_jobs=(JOB_A.hex(),)).approved_jobs == (JOB_A.hex(),)
    with pytest.raises(BadInput, match="approved jobs"):
        TrustOptions(approved_jobs=("XY" * 48,))


# ----------------------------------------------------------------------------- ranks
def test_ranks_of_one_job_quote_equal_rtmr3_and_a_rank_of_another_job_is_refused() -> None:
    enclave = EmulatedQuotingEnclave.provision(ROOT, now=NOW.replace(year=2029))

    def rank(*jobs: bytes) -> QuotingRankTee:
        return QuotingRankTee(lambda rd: enclave.quote(MEASURED, rd, rtmrs(*jobs)), TRUST, clock=lambda: NOW)

    me, same, other = rank(JOB_A), rank(JOB_A), rank(JOB_B)
    me.attest(b"mine")
    data = os.urandom(48)
    me.verify(1, same.attest(data), data)
    err = refused(me.verify, 2, other.attest(data), data)
    assert err.claim == "job" and "rank 2" in str(err)


# ----------------------------------------------------------------------------- the module process
CVM = ("import sys\nfrom gputravel.firmware.tdx_module import extend_rtmr, request_quote, QuotingRefused\n"
       "try:\n    v = extend_rtmr(sys.argv[1], 3, bytes.fromhex(sys.argv[2]), 30)\n"
       "    print(v.hex(), request_quote(sys.argv[1], bytes(64), 30).hex(), flush=True)\n    sys.stdin.read()\n"
       "except QuotingRefused as e:\n    print('refused:', e)\n")


def test_the_launched_cvm_extends_rtmr3_and_its_quote_carries_it_and_nobody_else_extends(processes,
                                                                                        tmp_path: Path) -> None:
    from test_tdx_module import MEASURED as REGISTERED
    from test_tdx_module import Module

    module = Module(tmp_path)
    try:
        cvm = subprocess.Popen([sys.executable, "-c", CVM, module.socket, JOB_A.hex()], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
        module.register(cvm.pid)  # it asked at once: held until the launcher names it
        assert cvm.stdout is not None and cvm.stdin is not None
        value, quote = cvm.stdout.readline().split()
        assert bytes.fromhex(value) == rtmr_after([JOB_A])
        claims = module.verifier.verify(bytes.fromhex(quote), bytes(64), datetime.now(timezone.utc))
        assert claims.measurement == REGISTERED and claims.rtmr == rtmrs(JOB_A)
        with pytest.raises(QuotingRefused, match="not the CVM this module launched"):  # this test's process
            extend_rtmr(module.socket, JOB_RTMR, JOB_B, timeout=10)
        cvm.communicate(input="", timeout=60 * processes)  # the CVM exits
    finally:
        module.close()


# ----------------------------------------------------------------------------- real cohorts
def _cohort_refusal(tmp_path: Path, **trust) -> AttestationError:
    from gputravel.cohort.config import CohortConfig, HolderSpec
    from gputravel.cohort.local import Cohort

    (tmp_path / "h1.bin").write_bytes(os.urandom(MIB))
    cfg = CohortConfig(holders=(HolderSpec("h1", str(tmp_path / "h1.bin")),), buffer_bytes=MIB,
                       job_json='{"steps":10}', trust=TrustOptions(**trust))
    with pytest.raises(AttestationError) as err, Cohort(cfg):
        pass
    return err.value


@pytest.mark.integration
def test_a_holder_that_approved_another_job_refuses_before_its_first_byte(processes, tmp_path: Path) -> None:
    err = _cohort_refusal(tmp_path, approved_jobs=(JOB_B.hex(),))
    assert err.claim == "job" and f"runs job {JOB_A.hex()}" in str(err) and "h1 did not join" in str(err)


@pytest.mark.integration
def test_changed_job_an_orchestrator_launched_with_another_job_than_approved_is_refused(processes,
                                                                                        tmp_path: Path) -> None:
    """red team: changed-job. The holders approved the job they were shown ({"steps":10}); the
    orchestrator is launched with another ({"steps":11}): same code and settings, so the same
    MRTD, but its RTMR[3] names job B, which no holder approved."""
    err = _cohort_refusal(tmp_path, orchestrator_changes=(("job_json", '{"steps":11}'),))
    assert err.claim == "job" and f"runs job {JOB_B.hex()}; this holder approved no such job" in str(err)


def test_the_orchestrator_quotes_nothing_unless_rtmr3_holds_exactly_its_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extend is sent at boot and awaited before the first quote: refused, or a register
    extended with more than the job, and every quote is refused (fail closed)."""
    from gputravel.orchestrator import attester

    quoted: list[bytes] = []
    monkeypatch.setattr(attester, "request_quote", lambda path, rd: quoted.append(rd) or b"quote")

    class Extend:
        def __init__(self, outcome: bytes | None) -> None:
            self.outcome = outcome

        def result(self) -> bytes:
            if self.outcome is None:
                raise QuotingRefused("the TDX module refused to extend RTMR[3]")
            return self.outcome

    for outcome, says in ((None, "refused to extend"), (rtmr_after([JOB_B, JOB_A]), "holds more than this job")):
        monkeypatch.setattr(attester, "PendingExtend", lambda path, index, job, o=outcome: Extend(o))
        first = attester.JobFirst("tdx.sock", JOB_A)
        for _ in range(2):
            with pytest.raises(QuotingRefused, match=says):
                first(bytes(64))
    monkeypatch.setattr(attester, "PendingExtend", lambda path, index, job: Extend(rtmr_after([job])))
    assert attester.JobFirst("tdx.sock", JOB_A)(bytes(64)) == b"quote" and quoted == [bytes(64)]
