"""The chain of trust in the running cohort (paper 4.5): nobody gets keys, data or the GPU
without it. In-process checks of the orchestrator's GPU attester first, then real cohorts
in which one link of the chain is broken on purpose and the right party refuses."""

from __future__ import annotations

import os
import shutil
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from gputravel.attest import (
    AttestationError,
    AttestChallenge,
    EmulatedQuotingEnclave,
    GpuRequirements,
    Policy,
    attest_orchestrator,
    init_roots,
    load_authority,
    provision_gpu,
)
from gputravel.crypto.pki import CohortPki
from gputravel.driver.orchestrator import OrchestratorDriver
from gputravel.errors import IllegalTransition, PeerTimeout, RemoteError
from gputravel.protocol.layout import Layout
from gputravel.protocol.rpc import GetEvidence
from gputravel.protocol.manifest import chunk_digest
from gputravel.orchestrator.attester import GpuAttester, TlsIdentity
from gputravel.orchestrator.cvm import OrchestratorConfig
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.local import Cohort
from gputravel.attest.material import OrchestratorMaterial
from gputravel.attest.quote import ZERO_RTMRS, rtmr_after
from gputravel.cohort.trust import (
    CohortTrust,
    TrustOptions,
    measure_orchestrator,
    pin_orchestrator,
    provision_cohort_trust,
)
from gputravel.testing import InProcessGpu

MIB = 1 << 20
T0 = datetime(2030, 1, 1, tzinfo=timezone.utc)
MEASURED = b"\x07" * 48  # what the launcher registered with the TDX module
JOB = b"\x09" * 48  # the job digest the orchestrator extended RTMR[3] with
RTMR = (*ZERO_RTMRS[:3], rtmr_after([JOB]))


# ----------------------------------------------------------------------------- in process
@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    """Emulated roots, two GPUs under the same vendor root, a quoting enclave, a TLS member."""
    d = tmp_path_factory.mktemp("world")
    store = init_roots(d / "roots", now=T0 - timedelta(days=1))
    vendor = load_authority(d / "roots", "gpu")
    gpus = [provision_gpu(vendor, serial=f"GPU-T-{i}", now=T0 - timedelta(days=1)) for i in range(2)]
    enclave = EmulatedQuotingEnclave.provision(load_authority(d / "roots", "tee"), now=T0 - timedelta(days=1))
    member = CohortPki.create(d / "pki", ("orchestrator",), now=T0 - timedelta(days=1)).member("orchestrator")
    return store, gpus, enclave, TlsIdentity.of_member(member)


def booted(world, *, max_age: int = 100, firmware_of: int = 0):
    """An orchestrator driver with an attester, on an in-process GPU (device 0's identity)."""
    store, gpus, enclave, tls = world
    gpu = InProcessGpu(device=gpus[0])
    if firmware_of != 0:  # emulate a device whose evidence comes from another device's key
        gpu.core._firmware = gpus[firmware_of].firmware()
    link = gpu.add_cvm("orchestrator")
    gpu.switch("orchestrator")
    driver = OrchestratorDriver(link, clock=gpu.clock)
    material = OrchestratorMaterial(store, gpus[0].reference_values(), max_age)
    # The quoting enclave stands in for the TDX module process (tests/test_tdx_module.py).
    return gpu, driver, GpuAttester(material, lambda report_data: enclave.quote(MEASURED, report_data, RTMR), tls,
                                    job_digest=JOB)


def test_attester_keeps_claims_fresh_with_the_clock_passed_in(world) -> None:
    _, driver, attester = booted(world, max_age=100)
    first = attester.open_session(driver, T0, timeout=5)
    assert first.verified_at == int(T0.timestamp()) and first.ueid == "GPU-T-0"
    assert not attester.refresh(driver, T0 + timedelta(seconds=49), timeout=5)  # still fresh: no RPC
    assert attester.claims is first
    assert attester.refresh(driver, T0 + timedelta(seconds=50), timeout=5)  # half the holders' limit
    second = attester.claims
    assert second is not None and second.verified_at == int(T0.timestamp()) + 50
    assert second.nonce != first.nonce  # a fresh nonce, fresh evidence


def test_holders_verify_the_gpu_evidence_relayed_for_their_own_nonce(world) -> None:
    store, gpus, _, tls = world
    _, driver, attester = booted(world, max_age=100)
    attester.open_session(driver, T0, timeout=5)
    nonce = os.urandom(32)
    evidence = attester.answer(AttestChallenge(nonce), driver, T0, timeout=5)
    policy = Policy((MEASURED,), GpuRequirements(), max_evidence_age_s=100, approved_jobs=(JOB,))
    reference = gpus[0].reference_values()
    got = attest_orchestrator(evidence, peer_cert_der=tls.cert_der, nonce=nonce, policy=policy, trust=store,
                              reference=reference, now=T0)
    assert got.cvm.measurement == MEASURED and got.gpu.ueid == "GPU-T-0" and got.gpu.nonce == nonce
    assert attester.claims is not None and attester.claims.nonce == nonce  # checked by the orchestrator too
    with pytest.raises(AttestationError) as err:  # the same answer, replayed to a later challenge
        attest_orchestrator(evidence, peer_cert_der=tls.cert_der, nonce=os.urandom(32), policy=policy, trust=store,
                            reference=reference, now=T0)
    assert err.value.claim == "binding"


def test_a_gpu_failing_re_attestation_is_no_longer_vouched_for(world) -> None:
    _, gpus, _, _ = world
    gpu, driver, attester = booted(world, max_age=100)
    attester.open_session(driver, T0, timeout=5)
    gpu.core._firmware = gpus[0].firmware(cc_mode=False)  # the GPU left CC mode after boot
    with pytest.raises(AttestationError) as err:
        attester.refresh(driver, T0 + timedelta(seconds=60), timeout=5)
    assert err.value.claim == "cc_mode"
    assert attester.claims is None
    with pytest.raises(IllegalTransition, match="gpu-unattested"):
        attester.answer(AttestChallenge(os.urandom(32)), driver, T0 + timedelta(seconds=60), timeout=5)


def test_evidence_is_only_relayed_while_the_gpu_is_home(world) -> None:
    _, driver, attester = booted(world)
    attester.open_session(driver, T0, timeout=5)
    driver.export_for_travel()  # the context is away: the GPU is on its way to a holder
    with pytest.raises(IllegalTransition, match="context-away"):
        attester.answer(AttestChallenge(os.urandom(32)), driver, T0, timeout=5)


def test_evidence_signed_by_another_device_than_the_session_is_refused(world) -> None:
    _, driver, attester = booted(world, firmware_of=1)  # same vendor root, another device
    with pytest.raises(AttestationError) as err:
        attester.open_session(driver, T0, timeout=5)
    assert err.value.claim == "chain" and "SPDM session" in err.value.reason


def test_evidence_is_only_given_inside_a_session(world) -> None:
    gpu = InProcessGpu(device=world[1][0])
    driver = gpu.holder("mallory")  # a CVM that probed the GPU but has no session
    gpu.switch("mallory")
    with pytest.raises(PeerTimeout):
        driver.rpc(GetEvidence(nonce=os.urandom(32)), encrypted=False, timeout=3)


def test_each_process_gets_only_its_share_of_the_trust_material(tmp_path: Path) -> None:
    config = OrchestratorConfig("host.sock", "pki", Layout(), MIB)
    trust = provision_cohort_trust(tmp_path / "trust", options=TrustOptions())
    trust = pin_orchestrator(trust, orchestrator=config, holders=("h1", "h2"), options=TrustOptions())
    files = {p.relative_to(trust.root).as_posix() for p in trust.root.rglob("*") if p.is_file()}
    # red team: orchestrator-self-quote. No quoting key on disk: the TDX module makes its own;
    # the CPU-TEE root key is in the launcher's memory only, until it certifies that key.
    # No firmware key either: the device makes its own at boot; the vendor's CA that certifies
    # it is in the launcher's memory only.
    assert {f for f in files if f.endswith(".key")} == set()
    assert not any(b"PRIVATE KEY" in p.read_bytes() for p in trust.root.rglob("*") if p.is_file())
    assert trust.tee_root is not None and trust.gpu_vendor is not None
    assert {f for f in files if f.startswith("device/")} == {"device/device.json", "device/reference-values.json"}
    assert {f for f in files if f.startswith("holders/h1/")} == {
        "holders/h1/gpu-vendor-root.pem", "holders/h1/tee-quoting-root.pem", "holders/h1/policy.json",
        "holders/h1/reference-values.json"}  # holders verify the GPU's evidence themselves
    assert Policy.load(trust.holder_dir("h2") / "policy.json").orchestrator_measurements == \
        (measure_orchestrator(config),) == trust.pinned
    # Placement (paths, addresses) is not measured; behaviour is.
    moved = OrchestratorConfig("elsewhere.sock", "other-pki", Layout(), MIB, listen_host="10.0.0.1")
    assert measure_orchestrator(moved) == trust.pinned[0]
    assert measure_orchestrator(OrchestratorConfig("host.sock", "pki", Layout(), MIB, verify=False)) != trust.pinned[0]


# ----------------------------------------------------------------------------- real cohorts
@pytest.fixture
def datasets(tmp_path: Path) -> dict[str, tuple[str, bytes]]:
    out = {}
    for name, size in (("h1", 2 * MIB + 4321), ("h2", MIB)):
        data = os.urandom(size)
        (tmp_path / f"{name}.bin").write_bytes(data)
        out[name] = (str(tmp_path / f"{name}.bin"), data)
    return out


def config(datasets, names=("h1", "h2"), **kw) -> CohortConfig:
    return CohortConfig(holders=tuple(HolderSpec(n, datasets[n][0]) for n in names), buffer_bytes=MIB, **kw)


def check_travel(cohort: Cohort, datasets, holder: str, offset: int = 0) -> None:
    report = cohort.travel(holder, offset)
    assert report.refused is None and report.chunk is not None
    assert report.chunk.digest == chunk_digest(datasets[holder][1][offset : offset + MIB])


def refusal(cfg: CohortConfig) -> AttestationError:
    cohort = Cohort(cfg)
    with pytest.raises(AttestationError) as err, cohort:
        pass
    assert cohort.children == {}  # and everything was torn down
    return err.value


@pytest.mark.integration
def test_holders_attest_the_orchestrator_before_any_travel(processes, datasets) -> None:
    with Cohort(config(datasets)) as cohort:
        assert isinstance(cohort.trust, CohortTrust)
        assert set(cohort.attestations) == {"h1", "h2"}
        for joined in cohort.attestations.values():
            assert joined.measurement == cohort.trust.pinned[0]
            assert joined.gpu_serial == cohort.trust.gpu_serial == "GPU-EMU-0"
        check_travel(cohort, datasets, "h1", MIB)
        check_travel(cohort, datasets, "h2")


@pytest.mark.integration
def test_orchestrator_self_quote_the_live_tdx_module_quotes_only_the_launched_orchestrator(processes, datasets) -> None:
    """red team: orchestrator-self-quote, in a running cohort. The holders got quotes with the
    measurement the launcher registered; a probe (this process, another pid and, isolated,
    another uid) asking the same TDX module gets none, and the orchestrator's trust material
    holds no private key at all."""
    import json

    from gputravel.firmware.tdx_module import QuotingRefused, request_quote

    with Cohort(config(datasets, ("h1",))) as cohort:
        assert cohort.attestations["h1"].measurement == cohort.trust.pinned[0]
        assert "tdx-module" in cohort.children and cohort.trust.tee_root is None  # root key gone
        orchestrator_dir = cohort.trust.orchestrator_dir
        assert not any(b"PRIVATE KEY" in p.read_bytes() for p in orchestrator_dir.rglob("*") if p.is_file())
        socket_path = json.loads((orchestrator_dir / "attestation.json").read_text())["quoting_socket"]
        with pytest.raises(QuotingRefused, match="not the CVM this module launched"):
            request_quote(socket_path, os.urandom(64), timeout=10)
        check_travel(cohort, datasets, "h1")  # and the orchestrator is still quoted


@pytest.mark.integration
def test_the_device_makes_its_firmware_key_and_the_vendor_ca_is_dropped_once_it_is_certified(processes,
        datasets, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device process makes its firmware key itself at boot; the launcher (the GPU
    vendor) sees only its request and sends back the chain, then drops the CA that signed it.
    Its evidence is signed with that key. (Isolated, the key file is the device uid's:
    tests/test_isolation.py.)"""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from gputravel.attest.provision import GpuDevice
    from gputravel.protocol.control import Certified, Enroll
    from gputravel.transport.stream import StreamTransport

    seen: list[object] = []
    send, recv = StreamTransport.send, StreamTransport.recv
    monkeypatch.setattr(StreamTransport, "send", lambda t, m, *a, **k: (seen.append(m), send(t, m, *a, **k))[1])
    monkeypatch.setattr(StreamTransport, "recv",
                        lambda t, *a, **k: (lambda got: (seen.append(got.message), got)[1])(recv(t, *a, **k)))
    with Cohort(config(datasets, ("h1",))) as cohort:
        assert cohort.trust.gpu_vendor is None and cohort.trust.tee_root is None
        path = cohort.trust.device_dir / "device-firmware.key"
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        device = GpuDevice.load(cohort.trust.device_dir)
        leaf = x509.load_der_x509_certificate(device.chain_der[0])
        assert leaf.public_key().public_numbers() == key.public_key().public_numbers()
        assert len(device.chain_der) == 5
        wire = repr(seen).encode()
        assert [m.name for m in seen if isinstance(m, Enroll)].count("device") == 1
        assert any(isinstance(m, Certified) and m.cert_pem.count(b"BEGIN CERTIFICATE") == 4 for m in seen)
        secret = key.private_numbers().private_value.to_bytes(48, "big")
        assert b"PRIVATE KEY" not in wire and secret not in wire
        # The evidence the holder verified at join was signed with that very key.
        assert cohort.attestations["h1"].gpu_serial == device.serial
        check_travel(cohort, datasets, "h1")


@pytest.mark.integration
def test_a_holder_whose_policy_pins_another_orchestrator_refuses_to_join(processes, datasets) -> None:
    err = refusal(config(datasets, ("h1",), trust=TrustOptions(pinned_measurements=("ab" * 48,))))
    assert err.claim == "measurement" and "h1 did not join" in str(err)


@pytest.mark.integration
def test_an_orchestrator_whose_config_changed_after_pinning_is_refused(processes, datasets) -> None:
    # The holders pinned an orchestrator that checks every chunk; this one would not.
    err = refusal(config(datasets, ("h1",), trust=TrustOptions(orchestrator_changes=(("verify", False),))))
    assert err.claim == "measurement"


@pytest.mark.integration
def test_an_orchestrator_whose_code_changed_after_pinning_is_refused(processes, datasets, request: pytest.FixtureRequest,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import gputravel

    # The children run a copy of the package with one byte more in the orchestrator's code;
    # the supervisor (this process) pinned the code as it is here.
    # Somewhere every party's uid can reach (tmp_path is closed to them: cohort/isolation.py).
    copy = Path(tempfile.mkdtemp(prefix="gputravel-changed-"))
    os.chmod(copy, 0o755)
    request.addfinalizer(lambda: shutil.rmtree(copy, ignore_errors=True))
    shutil.copytree(Path(gputravel.__file__).parent, copy / "gputravel",
                    ignore=shutil.ignore_patterns("__pycache__", "demo_data"))
    with open(copy / "gputravel" / "orchestrator" / "cvm.py", "a") as f:
        f.write("\n# changed after the holders inspected it\n")
    monkeypatch.setenv("PYTHONPATH", str(copy))
    err = refusal(config(datasets, ("h1",)))
    assert err.claim == "measurement"


@pytest.mark.integration
def test_a_gpu_from_another_vendor_root_is_refused_at_boot(processes, datasets) -> None:
    err = refusal(config(datasets, ("h1",), trust=TrustOptions(gpu_vendor="foreign")))
    assert err.claim == "chain" and "orchestrator failed to boot" in str(err)


@pytest.mark.integration
def test_a_gpu_outside_cc_mode_is_refused_at_boot(processes, datasets) -> None:
    err = refusal(config(datasets, ("h1",), trust=TrustOptions(gpu_cc_mode=False)))
    assert err.claim == "cc_mode"


@pytest.mark.integration
def test_late_join_leave_and_rejoin_with_fresh_attestation(processes, datasets) -> None:
    late = (HolderSpec("h2", datasets["h2"][0]),)
    with Cohort(config(datasets, ("h1",), late_holders=late)) as cohort:
        check_travel(cohort, datasets, "h1")
        # Late join: the orchestrator lends the GPU for h2's probe, then h2 attests and joins.
        assert cohort.add_holder("h2") == MIB
        assert cohort.attestations["h2"].measurement == cohort.trust.pinned[0]
        check_travel(cohort, datasets, "h2")
        check_travel(cohort, datasets, "h1", MIB)  # the orchestrator's session survived the lending
        # Leave: h1 says goodbye; the cohort serves h2 alone.
        cohort.leave("h1")
        with pytest.raises(RemoteError, match="offline"):  # HolderLost in the orchestrator
            cohort.travel("h1", 0)
        check_travel(cohort, datasets, "h2")
        # Rejoin re-attests: with a policy that no longer pins this orchestrator, h1 refuses...
        policy_file = cohort.trust.holder_dir("h1") / "policy.json"
        honest = policy_file.read_bytes()
        policy_file.write_text(policy_file.read_text().replace(cohort.trust.pinned[0].hex(), "cd" * 48))
        with pytest.raises(AttestationError) as err:
            cohort.rejoin("h1")
        assert err.value.claim == "measurement"
        # ... and with its policy back, it joins again and gets the GPU.
        policy_file.write_bytes(honest)
        assert cohort.rejoin("h1") == len(datasets["h1"][1])
        check_travel(cohort, datasets, "h1", 2 * MIB)


@pytest.mark.integration
def test_holders_attest_the_orchestrator_again_when_their_attestation_expires(processes, datasets) -> None:
    import time

    with Cohort(config(datasets, ("h1", "h2"), trust=TrustOptions(max_evidence_age_s=2), workdir=None)) as cohort:
        check_travel(cohort, datasets, "h1")
        time.sleep(1.2)  # past half the 2 s limit: the next travel re-attests first
        check_travel(cohort, datasets, "h1", MIB)
        assert "re-attested the orchestrator" in cohort.children["h1"].log.read_text()
        # h2's policy stops pinning this orchestrator: at its next re-attestation h2 refuses,
        # never touching the context it was sent; the orchestrator takes the GPU back.
        policy_file = cohort.trust.holder_dir("h2") / "policy.json"
        policy_file.write_text(policy_file.read_text().replace(cohort.trust.pinned[0].hex(), "cd" * 48))
        time.sleep(1.2)
        with pytest.raises(RemoteError, match="h2"):
            cohort.travel("h2", 0)
        check_travel(cohort, datasets, "h1", 2 * MIB)  # the others go on
