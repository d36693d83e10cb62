"""Issue 28 in `gputravel cohort init`: the key broker's config and identity, the job manifest in
the orchestrator's config, which holders approve it and which decline to sign, and each mistake
refused naming the flag, holder or key at fault, with nothing left behind."""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path

import pytest
import tomli_w
from typer.testing import CliRunner

from gputravel.broker.state import IDENTITY_FILE, SECRET_FILE, broker_public_key
from gputravel.cli.app import app
from gputravel.errors import BadInput
from gputravel.manifest import JobManifest, Outputs, write_manifest
from gputravel.orchestrator.job import job_digest
from gputravel.service.config import BrokerService, OrchestratorService, load_service, orchestrator_engine_config
from gputravel.service.init import carry_state, init_cohort


@pytest.fixture(autouse=True)
def _reachable(searchable_tmp, tmp_path):
    os.chmod(tmp_path, 0o711)  # init refuses, as root, a directory the parties' accounts could not reach


def _holders(tmp: Path) -> list[tuple[str, str]]:
    out = []
    for name in ("north", "south", "west"):
        (tmp / f"{name}.txt").write_text(f"the {name} holder's text\n" * 50)
        out.append((name, str(tmp / f"{name}.txt")))
    return out


def _manifest(tmp: Path, holders, **changes) -> JobManifest:
    """The manifest of the job cohort init writes for these holders."""
    plain = init_cohort(tmp / "plain", holders)[0].parent
    job = load_service(plain / "orchestrator.toml", "orchestrator").job.train_config()
    return JobManifest.for_job(job.replace(**changes), holders=[n for n, _ in holders], quorum=2,
                               outputs=Outputs(model="sealed"))


def test_init_writes_the_broker_and_the_manifest_and_approves_only_when_told(tmp_path: Path) -> None:
    holders = _holders(tmp_path)
    m = _manifest(tmp_path, holders)
    d = init_cohort(tmp_path / "D", holders, manifest=m, decline=["west"])[0].parent
    orch = load_service(d / "orchestrator.toml", "orchestrator")
    broker = load_service(d / "broker.toml", "broker")
    assert isinstance(orch, OrchestratorService) and isinstance(broker, BrokerService)
    assert orch.manifest_json == m.to_json() and orch.broker_socket == broker.socket
    assert orch.broker_key == broker_public_key(Path(broker.state_dir))
    assert job_digest(orchestrator_engine_config(orch, pki_dir="", trust_dir="")) == m.digest()
    for name in ("north", "south", "west"):
        cfg = load_service(d / f"holder-{name}.toml", "holder")
        assert cfg.policy.approved_jobs == []  # each holder approves on its own: gputravel job approve
        assert cfg.policy.orchestrator_measurements == broker.accepted_measurements
        assert cfg.sign_release is (name != "west") and cfg.eval_share == m.evaluation.share
    state = Path(broker.state_dir)
    assert sorted(p.name for p in state.iterdir()) == sorted([IDENTITY_FILE, SECRET_FILE])
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in state.iterdir())
    told = init_cohort(tmp_path / "E", holders, manifest=m, approve=["north"])[0].parent
    approved = {n: load_service(told / f"holder-{n}.toml").policy.approved_jobs for n in ("north", "south")}
    assert approved == {"north": [m.digest_hex()], "south": []}


def test_without_a_manifest_every_holder_approves_the_job_alone(tmp_path: Path) -> None:
    d = init_cohort(tmp_path / "D", _holders(tmp_path))[0].parent
    orch = load_service(d / "orchestrator.toml", "orchestrator")
    digest = job_digest(orchestrator_engine_config(orch, pki_dir="", trust_dir="")).hex()
    assert orch.manifest_json == "" and load_service(d / "holder-north.toml").policy.approved_jobs == [digest]


def test_carried_keys_keep_the_broker_key_and_holder_anchors_and_so_the_measurement(tmp_path: Path) -> None:
    holders = _holders(tmp_path)
    m = _manifest(tmp_path, holders)
    first = init_cohort(tmp_path / "D", holders, manifest=m)[0].parent
    carry_state(first / "state", tmp_path / "kept", [n for n, _ in holders])
    assert stat.S_IMODE((tmp_path / "kept").stat().st_mode) == 0o700
    again = init_cohort(tmp_path / "E", holders, manifest=m, carry=tmp_path / "kept")[0].parent
    other = init_cohort(tmp_path / "F", holders, manifest=m)[0].parent
    anchored = [load_service(d / "orchestrator.toml").anchors_sha384 for d in (first, again, other)]
    assert anchored[0] == anchored[1] != anchored[2] and len(anchored[0]) == 96
    keys = [load_service(d / "orchestrator.toml").broker_key for d in (first, again, other)]
    assert keys[0] == keys[1] != keys[2]
    secrets = [(d / "state" / "broker" / SECRET_FILE).read_bytes() for d in (first, again)]
    assert secrets[0] == secrets[1]
    measured = [load_service(d / "broker.toml").accepted_measurements for d in (first, again, other)]
    assert measured[0] == measured[1] != measured[2]  # the broker's key is measured


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"decline": ["east"]}, r"--decline east: not a holder of this cohort \(north, south, west\)"),
    ({"approve": ["east"]}, r"--approve east: not a holder of this cohort"),
    ({"gpus": 2, "manifest": True}, r"--gpus: a job with a manifest trains on one GPU"),
])
def test_init_refuses_options_that_name_no_holder_and_leaves_nothing(tmp_path: Path, kwargs, message) -> None:
    holders = _holders(tmp_path)
    if kwargs.get("manifest"):
        kwargs = {**kwargs, "manifest": _manifest(tmp_path, holders)}
    with pytest.raises(BadInput, match=message):
        init_cohort(tmp_path / "D", holders, **kwargs)
    assert not (tmp_path / "D").exists()


def test_init_refuses_a_manifest_of_another_job_or_other_holders(tmp_path: Path) -> None:
    holders = _holders(tmp_path)
    with pytest.raises(BadInput, match=r"job: expected the manifest's job; it differs in job\.lr, job\.steps"):
        init_cohort(tmp_path / "D", holders, manifest=_manifest(tmp_path, holders, lr=0.5, steps=7))
    strangers = JobManifest.for_job(load_service(tmp_path / "plain" / "orchestrator.toml").job.train_config(),
                                    holders=["north", "east"], quorum=1, outputs=Outputs(model="sealed"))
    with pytest.raises(BadInput, match=r"release\.holders names 'east', not a holder of this cohort"):
        init_cohort(tmp_path / "E", holders, manifest=strangers)
    assert not (tmp_path / "D").exists() and not (tmp_path / "E").exists()


def _rewrite(src: Path, dst: Path, change) -> Path:
    data = tomllib.loads(src.read_text())
    change(data)
    dst.write_text(tomli_w.dumps(data))
    return dst


@pytest.mark.parametrize(("party", "change", "expected"), [
    ("broker", lambda d: d.update(accepted_measurements=[]), "accepted_measurements: expected a list with at least 1"),
    ("broker", lambda d: d.update(accepted_measurements=["ab"]), "accepted_measurements.0: expected a string matching"),
    ("broker", lambda d: d.update(secret="x"), "secret: unknown key"),
    ("broker", lambda d: d.update(socket="run/broker.sock"), "socket: expected an absolute path"),
    ("orchestrator", lambda d: d.update(broker_key=""), "broker_socket: expected it with broker_key, or neither"),
    ("orchestrator", lambda d: d.update(broker_key="xyz"), "broker_key: expected a string matching"),
    ("orchestrator", lambda d: d.update(manifest_json="{}"), "manifest_json: expected a job manifest's JSON"),
    ("holder-north", lambda d: d.update(sign_release="no"), "sign_release: expected a valid boolean"),
])
def test_a_wrong_issue_28_key_is_refused_naming_file_and_key(tmp_path: Path, party, change, expected) -> None:
    d = init_cohort(tmp_path / "D", _holders(tmp_path))[0].parent
    bad = _rewrite(d / f"{party}.toml", tmp_path / f"{party}.toml", change)
    with pytest.raises(BadInput) as caught:
        load_service(bad)
    assert f"{bad}: {expected}" in str(caught.value)


def test_cohort_init_takes_a_manifest_and_tells_each_holder_to_approve_it(tmp_path: Path) -> None:
    holders = _holders(tmp_path)
    m = _manifest(tmp_path, holders)
    write_manifest(tmp_path / "job.toml", m)
    args = ["cohort", "init", str(tmp_path / "D"), "--manifest", str(tmp_path / "job.toml"),
            *(a for n, p in holders for a in ("--holder", f"{n}={p}"))]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert f"job {m.digest_hex()}" in result.output and "gputravel job approve" in result.output
    assert load_service(tmp_path / "D" / "orchestrator.toml").manifest_json == m.to_json()
    refused = CliRunner().invoke(app, [*args[:2], str(tmp_path / "E"), *args[3:], "--steps", "3"])
    assert refused.exit_code != 0 and "--steps" in refused.output


def test_the_broker_serves_as_its_own_account_and_stops_on_sigterm(processes, tmp_path: Path) -> None:
    import json
    import signal
    import subprocess
    import sys
    import time

    from gputravel.service.status import cohort_status

    d = init_cohort(tmp_path / "D", _holders(tmp_path))[0].parent
    cfg = load_service(d / "broker.toml", "broker")
    proc = subprocess.Popen([sys.executable, "-m", "gputravel.cli.app", "serve", "broker", "--config",
                             str(d / "broker.toml")], stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        deadline = time.monotonic() + 60 * processes
        while '"party": "broker", "event": "up"' not in line and time.monotonic() < deadline and line:
            line = proc.stderr.readline()
        assert json.loads(line)["party"] == "broker", line
        assert cohort_status(cfg)["services"] == {"broker": "up"}
        if cfg.uid >= 0:  # as root: its state is its own account's, 0700
            st = os.stat(cfg.state_dir)
            assert st.st_uid == cfg.uid and stat.S_IMODE(st.st_mode) == 0o700
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert cohort_status(cfg)["services"] == {"broker": "down"}
