"""Issue 28 on the deployed services: init makes no party's key; each holder and the key broker
make their own identity (`cohort identity`), the manifest names them (`job init --cohort`),
`cohort job` sets it with which holders approve and decline, and each mistake is refused naming
the holder or key at fault."""

from __future__ import annotations

import os
from dataclasses import replace
import stat
import tomllib
from pathlib import Path

import pytest
import tomli_w
from typer.testing import CliRunner

from gputravel.broker.state import IDENTITY_FILE, SECRET_FILE, broker_public_key
from gputravel.cli.app import app
from gputravel.errors import BadInput
from gputravel.manifest import JobManifest, Outputs, key_fingerprint, load_manifest, write_manifest
from gputravel.orchestrator.job import job_digest
from gputravel.service.config import load_service, orchestrator_engine_config
from gputravel.service.init import carry_state, init_cohort
from gputravel.service.job import BROKER_PUBLIC, certificate_sha384, make_identity, published_parties, set_job


@pytest.fixture(autouse=True)
def _reachable(searchable_tmp, tmp_path):
    os.chmod(tmp_path, 0o711)  # init refuses, as root, a directory the parties' accounts could not reach


def _holders(tmp: Path) -> list[tuple[str, str]]:
    out = []
    for name in ("north", "south", "west"):
        (tmp / f"{name}.txt").write_text(f"the {name} holder's text\n" * 50)
        out.append((name, str(tmp / f"{name}.txt")))
    return out


def _manifest(tmp: Path, holders, d: Path | None = None, **changes) -> JobManifest:
    """The manifest of the job cohort init writes for these holders; with `d`, naming the identities
    its parties published."""
    plain = init_cohort(tmp / "plain", holders)[0].parent if not (tmp / "plain").exists() else tmp / "plain"
    job = load_service(plain / "orchestrator.toml", "orchestrator").job.train_config()
    names = [n for n, _ in holders]
    certificates, key = published_parties(d, names) if d is not None else ({}, "")
    return JobManifest.for_job(job.replace(**changes), holders=names, quorum=2, outputs=Outputs(model="sealed"),
                               certificates=certificates, broker_key=key)


def _identities(d: Path, holders) -> None:
    for party in [*(f"holder-{n}" for n, _ in holders), "broker"]:
        make_identity(d / f"{party}.toml")


def test_init_makes_no_partys_key_and_binds_no_broker_nor_anchors(tmp_path: Path) -> None:
    """The first issue-28 stop had init make the holders' signing keys and the broker's secret, so
    whoever ran it could sign a release for any holder and open the sealed model."""
    d = init_cohort(tmp_path / "D", _holders(tmp_path))[0].parent
    orch = load_service(d / "orchestrator.toml", "orchestrator")
    assert orch.broker_socket and not hasattr(orch, "broker_key") and not hasattr(orch, "anchors_sha384")
    for party in ("broker", "holder-north", "holder-south"):
        assert list((d / "state" / party).iterdir()) == [], party


def test_each_party_makes_its_own_identity_once_and_publishes_its_public_half(tmp_path: Path) -> None:
    holders = _holders(tmp_path)
    d = init_cohort(tmp_path / "D", holders)[0].parent
    north = make_identity(d / "holder-north.toml")
    broker = make_identity(d / "broker.toml")
    assert north.what == "certificate" and north.published == d / "public" / "holder-north.pem"
    assert certificate_sha384(north.published.read_bytes()) == north.value
    state = d / "state" / "broker"
    assert broker.value == broker_public_key(state) and (d / "public" / BROKER_PUBLIC).read_text().strip() == broker.value
    assert sorted(p.name for p in state.iterdir() if p.name != "home") == sorted([IDENTITY_FILE, SECRET_FILE])
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in state.iterdir() if p.is_file())
    again = make_identity(d / "holder-north.toml"), make_identity(d / "broker.toml")
    assert (north.kept, broker.kept) == (False, False) and again == (replace(north, kept=True),
                                                                     replace(broker, kept=True))
    assert broker.fingerprint.startswith("sha256:") and north.fingerprint == north.value
    with pytest.raises(BadInput, match="only a holder and the key broker"):
        make_identity(d / "host.toml")


def test_set_job_writes_the_manifest_and_approves_only_when_told(tmp_path: Path) -> None:
    holders = _holders(tmp_path)
    d = init_cohort(tmp_path / "D", holders)[0].parent
    with pytest.raises(BadInput, match=r"holder .north. has published no certificate .* `gputravel cohort identity"):
        _manifest(tmp_path, holders, d)
    _identities(d, holders)
    m = _manifest(tmp_path, holders, d)
    set_job(d, m, decline=["west"])
    orch = load_service(d / "orchestrator.toml", "orchestrator")
    broker = load_service(d / "broker.toml", "broker")
    assert orch.manifest_json == m.to_json() and orch.broker_socket == broker.socket
    assert m.broker.identity == broker_public_key(Path(broker.state_dir))
    assert job_digest(orchestrator_engine_config(orch, pki_dir="", trust_dir="")) == m.digest()
    for name in ("north", "south", "west"):
        cfg = load_service(d / f"holder-{name}.toml", "holder")
        assert m.digest_hex() not in cfg.policy.approved_jobs  # each holder approves on its own
        assert cfg.policy.orchestrator_measurements == broker.accepted_measurements
        assert cfg.sign_release is (name != "west")
    # A holder's own choices stay its own (the review had `cohort job` undo a holder's sign_release = false).
    _rewrite(d / "holder-south.toml", d / "holder-south.toml",
             lambda raw: raw.update(sign_release=False, eval_share=0.25))
    set_job(d, m)
    south = load_service(d / "holder-south.toml", "holder")
    assert south.sign_release is False and south.eval_share == 0.25
    set_job(d, m, approve=["north"])
    approved = {n: m.digest_hex() in load_service(d / f"holder-{n}.toml").policy.approved_jobs
                for n in ("north", "south")}
    assert approved == {"north": True, "south": False}


def test_carried_identities_keep_the_manifest_and_so_the_sealing_key(tmp_path: Path) -> None:
    holders = _holders(tmp_path)
    first = init_cohort(tmp_path / "D", holders)[0].parent
    _identities(first, holders)
    carry_state(first / "state", tmp_path / "kept", [n for n, _ in holders])
    assert stat.S_IMODE((tmp_path / "kept").stat().st_mode) == 0o700
    again = init_cohort(tmp_path / "E", holders, carry=tmp_path / "kept")[0].parent
    other = init_cohort(tmp_path / "F", holders)[0].parent
    for d in (again, other):
        _identities(d, holders)
    named = [_manifest(tmp_path, holders, d).digest() for d in (first, again, other)]
    assert named[0] == named[1] != named[2]
    secrets = [(d / "state" / "broker" / SECRET_FILE).read_bytes() for d in (first, again)]
    assert secrets[0] == secrets[1]


def test_set_job_refuses_a_job_that_moves_the_measurement_the_holders_pinned(tmp_path: Path) -> None:
    """The review's set_job took a manifest of another buffer: the MRTD moved, the pins did not."""
    holders = _holders(tmp_path)
    d = init_cohort(tmp_path / "D", holders)[0].parent
    _identities(d, holders)
    bigger = _manifest(tmp_path, holders, d, buffer_bytes=load_service(d / "orchestrator.toml").job.buffer_bytes * 2)
    with pytest.raises(BadInput, match=r"job\.buffer_bytes moves the orchestrator's measurement"):
        set_job(d, bigger)
    assert load_service(d / "orchestrator.toml").manifest_json == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: without it every party is one account, nothing to tell")
def test_a_key_planted_in_a_partys_state_before_it_makes_its_identity_is_refused(tmp_path: Path) -> None:
    """The review planted a broker secret and a holder key (root's) before `cohort identity`: adopted."""
    d = init_cohort(tmp_path / "D", _holders(tmp_path))[0].parent
    if load_service(d / "broker.toml").uid < 0:
        pytest.skip("init gave the parties no accounts of their own here")
    (d / "state" / "broker" / SECRET_FILE).write_bytes(os.urandom(32))
    with pytest.raises(BadInput, match=r"broker\.secret was not made by this party's account"):
        make_identity(d / "broker.toml")
    pki = d / "state" / "holder-north" / "pki"
    pki.mkdir()
    (pki / "north.key").write_bytes(b"planted")
    with pytest.raises(BadInput, match=r"pki was not made by this party's account"):
        make_identity(d / "holder-north.toml")
    assert make_identity(d / "holder-south.toml").kept is False


def test_set_job_refuses_what_the_cohort_did_not_publish_or_cannot_run(tmp_path: Path) -> None:
    holders = _holders(tmp_path)
    d = init_cohort(tmp_path / "D", holders)[0].parent
    _identities(d, holders)
    good = _manifest(tmp_path, holders, d)
    unnamed = _manifest(tmp_path, holders)
    with pytest.raises(BadInput, match=r"release\.certificates\.north, .*broker\.identity is not what the cohort"):
        set_job(d, unnamed)
    forged = good.with_parties({**good.release.certificates, "south": "ab" * 48}, good.broker.identity)
    with pytest.raises(BadInput, match=r"the manifest's release\.certificates\.south is not what"):
        set_job(d, forged)
    with pytest.raises(BadInput, match=r"'east' is not a holder of the cohort"):
        set_job(d, good, approve=["east"])
    with pytest.raises(BadInput, match=r"'east' is not a holder of the cohort"):
        set_job(d, good, decline=["east"])
    fewer = _manifest(tmp_path, holders[:2], d)  # west would join under no certificate the manifest names
    with pytest.raises(BadInput, match=r"release\.holders: expected every holder of the cohort"):
        set_job(d, fewer)
    two = init_cohort(tmp_path / "G", holders, gpus=2)[0].parent
    with pytest.raises(BadInput, match="a job with a manifest trains on one GPU"):
        set_job(two, good)
    assert load_service(d / "orchestrator.toml").manifest_json == ""  # nothing written on a refusal


def test_without_a_manifest_every_holder_approves_the_job_alone(tmp_path: Path) -> None:
    d = init_cohort(tmp_path / "D", _holders(tmp_path))[0].parent
    orch = load_service(d / "orchestrator.toml", "orchestrator")
    digest = job_digest(orchestrator_engine_config(orch, pki_dir="", trust_dir="")).hex()
    assert orch.manifest_json == "" and load_service(d / "holder-north.toml").policy.approved_jobs == [digest]


def test_set_job_takes_the_manifests_settings_and_refuses_a_workload_the_data_cannot_feed(tmp_path: Path) -> None:
    holders = _holders(tmp_path)
    d = init_cohort(tmp_path / "D", holders)[0].parent
    _identities(d, holders)
    changed = _manifest(tmp_path, holders, d, lr=0.5, steps=7)
    set_job(d, changed)
    job = load_service(d / "orchestrator.toml").job
    assert (job.lr, job.steps) == (0.5, 7)
    records = changed.model_copy(update={"data": changed.data.model_copy(update={"schema_digest": "ab" * 32}),
                                         "workload": changed.workload.model_copy(update={"name": "tabular"})})
    with pytest.raises(BadInput, match=r"data\.schema"):
        set_job(d, records)


def _said(result) -> str:
    """A CLI's output as one line of words, its error box and wrapping undone."""
    return " ".join(result.output.replace("│", " ").split())


def _other_broker_key() -> str:
    from cryptography.hazmat.primitives.asymmetric import ec

    from gputravel.broker.state import public_key_hex

    return public_key_hex(ec.generate_private_key(ec.SECP384R1()))


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
    # The review of per-party identities had the operator bind its own broker and anchors here.
    ("orchestrator", lambda d: d.update(broker_key="00"), "broker_key: unknown key"),
    ("orchestrator", lambda d: d.update(anchors_sha384="ab" * 48), "anchors_sha384: unknown key"),
    ("orchestrator", lambda d: d.update(manifest_json="{}"), "manifest_json: expected a job manifest's JSON"),
    ("holder-north", lambda d: d.update(sign_release="no"), "sign_release: expected a valid boolean"),
])
def test_a_wrong_issue_28_key_is_refused_naming_file_and_key(tmp_path: Path, party, change, expected) -> None:
    d = init_cohort(tmp_path / "D", _holders(tmp_path))[0].parent
    bad = _rewrite(d / f"{party}.toml", tmp_path / f"{party}.toml", change)
    with pytest.raises(BadInput) as caught:
        load_service(bad)
    assert f"{bad}: {expected}" in str(caught.value)


def test_the_cli_makes_identities_names_them_sets_the_job_and_a_holder_checks_its_own(tmp_path: Path) -> None:
    holders = _holders(tmp_path)
    run = CliRunner().invoke
    d = tmp_path / "D"
    made = run(app, ["cohort", "init", str(d), *(a for n, p in holders for a in ("--holder", f"{n}={p}"))])
    assert made.exit_code == 0, made.output
    refused = run(app, ["job", "init", "--out", str(tmp_path / "job.toml"), "--cohort", str(d), "--model", "sealed"])
    assert refused.exit_code != 0 and "gputravel cohort identity" in _said(refused)
    for party in ("holder-north", "holder-south", "holder-west", "broker"):
        said = run(app, ["cohort", "identity", "--config", str(d / f"{party}.toml")])
        assert said.exit_code == 0 and "published at" in _said(said), said.output
    written = run(app, ["job", "init", "--out", str(tmp_path / "job.toml"), "--cohort", str(d), "--model", "sealed",
                        "--steps", str(load_service(d / "orchestrator.toml").job.steps)])
    assert written.exit_code == 0, written.output
    m = load_manifest(tmp_path / "job.toml")
    assert sorted(m.release.certificates) == ["north", "south", "west"] and m.broker.identity
    shown = run(app, ["job", "show", str(tmp_path / "job.toml")])
    assert f"signer north certificate SHA-384 {m.release.certificates['north']}" in _said(shown)
    assert "key broker key sha256:" in _said(shown)
    job = run(app, ["cohort", "job", str(d), "--manifest", str(tmp_path / "job.toml")])
    assert job.exit_code == 0 and f"job {m.digest_hex()}" in _said(job), job.output
    assert load_service(d / "orchestrator.toml").manifest_json == m.to_json()
    approve = ["job", "approve", str(tmp_path / "job.toml"), "--holder-config", str(d / "holder-north.toml"), "-y"]
    unsure = run(app, approve)
    assert unsure.exit_code != 0 and "confirm the key broker with --broker FINGERPRINT" in _said(unsure)
    fingerprint = key_fingerprint(bytes.fromhex(m.broker.identity))
    unsure = run(app, [*approve, "--broker", fingerprint])
    assert unsure.exit_code != 0 and "confirm south's certificate with --signer south=SHA384" in _said(unsure)
    signers = [a for h in ("south", "west") for a in ("--signer", f"{h}={m.release.certificates[h][:32]}")]
    other_broker = key_fingerprint(bytes.fromhex(_other_broker_key()))
    wrong = run(app, [*approve, "--broker", other_broker, *signers])
    assert wrong.exit_code != 0 and "not the key broker you confirmed" in _said(wrong)
    wrong = run(app, [*approve, "--broker", fingerprint, "--signer", f"south={'0' * 32}", *signers[2:]])
    assert wrong.exit_code != 0 and "release.certificates.south is" in _said(wrong)
    ok = run(app, [*approve, "--broker", fingerprint, *signers])
    assert ok.exit_code == 0, ok.output
    policy = load_service(d / "holder-north.toml").policy
    assert policy.known_broker == fingerprint and sorted(policy.known_signers) == ["south", "west"]
    other = m.with_parties({**m.release.certificates, "south": m.release.certificates["north"][::-1]},
                           m.broker.identity)
    write_manifest(tmp_path / "other.toml", other)
    no = run(app, ["job", "approve", str(tmp_path / "other.toml"), "--holder-config", str(d / "holder-south.toml"),
                   "-y", "--broker", fingerprint])
    assert no.exit_code != 0 and "release.certificates.south" in _said(no) and "not this holder's own" in _said(no)


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
