"""`gputravel pki init` and `gputravel attest gpu|verify|measure` through typer's runner."""

from __future__ import annotations

import json
import stat

import pytest
import typer
from typer.testing import CliRunner

from gputravel.attest.quote import orchestrator_measurement
from gputravel.cli.attest import attest_app, pki_app

runner = CliRunner()
app = typer.Typer()
app.add_typer(pki_app, name="pki")
app.add_typer(attest_app, name="attest")


@pytest.fixture(scope="module")
def attested(tmp_path_factory):
    """Roots, an emulated GPU and one saved attestation, made through the CLI."""
    base = tmp_path_factory.mktemp("cli")
    result = runner.invoke(app, ["pki", "init", "--dir", str(base / "roots")])
    assert result.exit_code == 0, result.output
    out = base / "evidence.json"
    result = runner.invoke(app, ["attest", "gpu", "--state", str(base / "gpu"), "--roots", str(base / "roots"),
                                 "--json", str(out)])
    assert result.exit_code == 0, result.output
    policy = base / "policy.json"
    policy.write_text(json.dumps({
        "format": "gputravel-holder-policy-v1", "orchestrator_measurements": [],
        "gpu": {"driver_versions": ["550.54.15-emulated"]},
        "gpu_reference_values": "gpu/reference-values.json"}))
    return base, out, policy, result.output


def test_pki_init_writes_emulated_roots_with_private_keys(processes, attested):
    base = attested[0]
    for key in ("gpu-vendor-root.key", "tee-quoting-root.key"):
        assert stat.S_IMODE((base / "roots" / key).stat().st_mode) == 0o600
    again = runner.invoke(app, ["pki", "init", "--dir", str(base / "roots")])
    assert again.exit_code == 1 and "already holds" in again.output


def test_attest_gpu_prints_claims_and_writes_evidence(processes, attested):
    _, out, _, output = attested
    assert "x-nvidia-overall-att-result" in output and "measres" in output
    saved = json.loads(out.read_text())
    assert saved["emulated"] is True and len(bytes.fromhex(saved["nonce"])) == 32
    assert saved["claims"]["x-nvidia-overall-att-result"] is True
    assert saved["claims"]["eat_nonce"] == saved["nonce"] and saved["evidence"]


def test_attest_verify_accepts_saved_evidence_for_its_nonce(processes, attested):
    base, out, policy, _ = attested
    nonce = json.loads(out.read_text())["nonce"]
    result = runner.invoke(app, ["attest", "verify", "--evidence", str(out), "--nonce", nonce,
                                 "--policy", str(policy), "--roots", str(base / "roots")])
    assert result.exit_code == 0, result.output
    assert "verified" in result.output


def test_attest_verify_refuses_another_nonce_naming_the_claim(processes, attested):
    base, out, policy, _ = attested
    result = runner.invoke(app, ["attest", "verify", "--evidence", str(out), "--nonce", "00" * 32,
                                 "--policy", str(policy), "--roots", str(base / "roots")])
    assert result.exit_code == 2
    assert "refused: claim nonce" in result.output


def test_attest_verify_refuses_a_driver_the_policy_does_not_accept(processes, attested):
    base, out, _, _ = attested
    strict = base / "strict.json"
    strict.write_text(json.dumps({"format": "gputravel-holder-policy-v1", "orchestrator_measurements": [],
                                  "gpu": {"driver_versions": ["999.9"]}}))
    nonce = json.loads(out.read_text())["nonce"]
    result = runner.invoke(app, ["attest", "verify", "--evidence", str(out), "--nonce", nonce, "--policy",
                                 str(strict), "--roots", str(base / "roots"),
                                 "--reference", str(base / "gpu" / "reference-values.json")])
    assert result.exit_code == 2 and "refused: claim policy" in result.output


def test_attest_verify_bad_input_exits_1(processes, attested):
    base, out, policy, _ = attested
    result = runner.invoke(app, ["attest", "verify", "--evidence", str(out), "--nonce", "abc",
                                 "--policy", str(policy), "--roots", str(base / "roots")])
    assert result.exit_code == 1 and "--nonce" in result.output


def test_attest_measure_prints_the_pinnable_measurement(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"holders": 2}))
    result = runner.invoke(app, ["attest", "measure", "--config", str(config)])
    assert result.exit_code == 0
    assert orchestrator_measurement({"holders": 2}).hex() in result.output


def test_the_firmware_runs_in_a_process_of_its_own_and_answers_fresh_nonces(processes, tmp_path):
    import os

    from gputravel.firmware.gpu import FirmwareProcess
    from gputravel.attest.gpu import ReferenceValues
    from gputravel.attest.provision import REFERENCE_FILE, GpuDevice, provision_gpu
    from gputravel.attest.roots import TrustStore, init_roots, load_authority
    from gputravel.attest.verifier import EmulatedGpuVerifier
    from datetime import datetime, timezone

    init_roots(tmp_path)
    provision_gpu(load_authority(tmp_path, "gpu")).save(tmp_path / "gpu")
    assert GpuDevice.exists(tmp_path / "gpu")
    verifier = EmulatedGpuVerifier(TrustStore.load(tmp_path), ReferenceValues.load(tmp_path / "gpu" / REFERENCE_FILE))
    with FirmwareProcess(tmp_path / "gpu") as gpu:
        assert gpu.proc.pid != os.getpid() and gpu.proc.poll() is None
        for _ in range(2):
            nonce = os.urandom(32)
            claims = verifier.verify(gpu.evidence(nonce), nonce, datetime.now(timezone.utc))
            assert claims.eat()["x-nvidia-gpu-attestation-report-nonce-match"] is True
    assert gpu.proc.returncode == 0  # it stopped when we hung up


def test_attest_measure_leaves_the_job_and_placement_out_and_prints_the_job_digest(tmp_path):
    from gputravel.orchestrator.job import job_json_digest

    config = tmp_path / "orchestrator.json"
    config.write_text(json.dumps({"holders": 2, "job_json": '{"steps":3}', "listen_port": 9999}))
    result = runner.invoke(app, ["attest", "measure", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert orchestrator_measurement({"holders": 2}).hex() in result.output  # the MRTD holders pin
    assert job_json_digest('{"steps":3}').hex() in result.output  # the RTMR[3] job they approve
