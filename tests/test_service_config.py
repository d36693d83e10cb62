"""Issue 16: `gputravel cohort init` and the per-party TOML files: what init writes, that each
file reads back, and that every mistake in a file is refused naming the file, the key and what
was expected, before anything starts."""

from __future__ import annotations

import json
import os
import socket
import stat
import tomllib
from pathlib import Path

import pytest
import tomli_w
from typer.testing import CliRunner

from gputravel.attest import load_authority
from gputravel.attest.provision import GpuIssuer, REFERENCE_FILE
from gputravel.attest.roots import GPU_ROOT_CERT, GPU_ROOT_KEY, TEE_ROOT_CERT, TEE_ROOT_KEY
from gputravel.cohort.trust import measure_orchestrator
from gputravel.errors import BadInput
from gputravel.protocol.hardware import PROFILES
from gputravel.service.config import (
    BrokerService,
    GpuService,
    HolderService,
    HostService,
    OrchestratorService,
    check_before_start,
    load_service,
    orchestrator_engine_config,
    quoting_socket,
)
from gputravel.service.init import init_cohort
from gputravel.service.status import cohort_status

PARTIES = {"host.toml": HostService, "gpu-0.toml": GpuService, "orchestrator.toml": OrchestratorService,
           "holder-north.toml": HolderService, "holder-south.toml": HolderService, "broker.toml": BrokerService}


@pytest.fixture(autouse=True)
def _reachable(searchable_tmp, tmp_path):
    """init refuses, as root, a directory the parties' accounts could not reach."""
    os.chmod(tmp_path, 0o711)


@pytest.fixture(scope="module")
def cohort(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("cohort")
    os.chmod(base, 0o711)  # reachable by the parties' accounts (see _reachable)
    for name in ("north", "south"):
        (base / f"{name}.txt").write_text(f"the {name} holder's text\n" * 50)
    init_cohort(base / "D", [("north", str(base / "north.txt")), ("south", str(base / "south.txt"))])
    return base / "D"


def _rewrite(src: Path, dst: Path, change) -> Path:
    """A copy of the config `src` at `dst`, changed by `change(dict)`."""
    data = tomllib.loads(src.read_text())
    change(data)
    dst.write_text(tomli_w.dumps(data))
    return dst


def _keys(table: dict, prefix: str = "") -> list[str]:
    return [k for key, value in table.items()
            for k in ([f"{prefix}{key}"] + (_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else []))]


# ----------------------------------------------------------------------------- init
def test_init_writes_one_file_per_party_and_each_reads_back(cohort: Path) -> None:
    assert sorted(p.name for p in cohort.glob("*.toml")) == sorted(PARTIES)
    for name, model in PARTIES.items():
        cfg = load_service(cohort / name)
        assert isinstance(cfg, model) and cfg.source == str(cohort / name)
        assert cfg.state_dir == str(cohort / "state" / name.removesuffix(".toml"))
        assert stat.S_IMODE(os.stat(cfg.state_dir).st_mode) == 0o700
    orch = load_service(cohort / "orchestrator.toml", "orchestrator")
    north = load_service(cohort / "holder-north.toml", "holder")
    assert orch.holders == ["north", "south"] and north.orchestrator_port == orch.listen_port
    assert north.data.endswith("north.txt") and os.path.isabs(north.data)
    assert {p.name for p in (cohort / "trust").iterdir()} == {GPU_ROOT_CERT, TEE_ROOT_CERT, REFERENCE_FILE}
    assert not any((cohort / "public").iterdir()) and not any((cohort / "run").iterdir())


def test_holders_pin_the_orchestrator_init_configured(cohort: Path) -> None:
    orch = load_service(cohort / "orchestrator.toml")
    # Placement is not measured: the running service's own paths give the same measurement.
    running = orchestrator_engine_config(orch, pki_dir="/anywhere/pki", trust_dir=orch.trust_dir)
    for name in ("north", "south"):
        policy = load_service(cohort / f"holder-{name}.toml").policy
        assert policy.orchestrator_measurements == [measure_orchestrator(running).hex()]
        assert policy.gpu_driver_versions and policy.to_policy(orch.trust_dir).gpu_reference_values.exists()


def test_the_measurement_the_holders_pin_covers_the_job(cohort: Path, tmp_path: Path) -> None:
    """[job] is measured into RTMR[3] and approved by digest (not in MRTD): an orchestrator.toml
    whose job was edited after init (more steps, another seed) keeps its MRTD but names another
    job digest, which the holders' policies do not approve."""
    from gputravel.orchestrator.job import job_digest

    orch = load_service(cohort / "orchestrator.toml")
    policy = load_service(cohort / "holder-north.toml").policy
    running = orchestrator_engine_config(orch, pki_dir="", trust_dir=orch.trust_dir)
    assert policy.approved_jobs == [job_digest(running).hex()]
    for change in ({"steps": orch.job.steps + 1}, {"seed": orch.job.seed + 1}):
        edited = orchestrator_engine_config(orch.model_copy(update={"job": orch.job.model_copy(update=change)}),
                                            pki_dir="", trust_dir=orch.trust_dir)
        assert measure_orchestrator(edited).hex() in policy.orchestrator_measurements
        assert job_digest(edited).hex() not in policy.approved_jobs


def test_only_the_hardware_stand_ins_hold_a_private_key(cohort: Path) -> None:
    allowed = (cohort / "vendor" / "gpu-0", cohort / "platform")  # root's alone, in no party's tree
    # ... and the key broker's identity, in its own state: init writes its public half into the
    # orchestrators' configs, whose measurement the holders pin.
    keyed = [p for p in cohort.rglob("*") if p.is_file() and b"PRIVATE KEY" in p.read_bytes()]
    assert keyed and all(p.parent in allowed or p == cohort / "state" / "broker" / "broker.key" for p in keyed), keyed
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in keyed)
    for config in cohort.glob("*.toml"):  # no key, and no key's name, in any config
        text = config.read_text()
        public = {"broker_key"}  # the broker's public key (SubjectPublicKeyInfo, hex)
        assert "BEGIN" not in text and not any("key" in k and k not in public for k in _keys(tomllib.loads(text)))
    # What the emulated hardware needs from them: the GPU's CA and the CPU-TEE root.
    issuer = GpuIssuer.load(allowed[0])
    assert issuer.serial == "GPU-EMU-0"
    assert load_authority(allowed[1], "tee").cert_der
    assert not (cohort / "trust" / GPU_ROOT_KEY).exists() and not (cohort / "trust" / TEE_ROOT_KEY).exists()


def test_init_refuses_a_used_directory_bad_holders_and_leaves_nothing(tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    data.write_text("text\n")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    with pytest.raises(BadInput, match="not an empty directory"):
        init_cohort(tmp_path / "used", [("north", str(data))])
    for holders, match in (([], "at least one holder"), ([("North", str(data))], "a name is"),
                           *(([(name, str(data))], "none of ca, device, host, orchestrator, tdx-module or orch")
                             for name in ("orchestrator", "device", "host", "tdx-module", "ca", "orchestrator-1")),
                           ([("a", str(data)), ("a", str(data))], "given twice"),
                           ([("a", str(tmp_path / "missing"))], "no such file")):
        with pytest.raises(BadInput, match=match):
            init_cohort(tmp_path / "new", holders)
        assert not (tmp_path / "new").exists()


def _dir_of_length(base: Path, size: int) -> Path:
    """A path under `base` of `size` bytes (not made)."""
    return base / ("d" * (size - len(str(base)) - 1))


def test_init_refuses_a_directory_too_deep_for_its_sockets_and_leaves_nothing(tmp_path: Path) -> None:
    """A Unix socket's path has at most 107 bytes: a cohort whose sockets could never be bound
    is refused at init, naming the key, not when a party's process fails to bind (the demo's
    host once did, in a deep $TMPDIR, and exited 1). The TDX module's socket, the longest
    (state/orchestrator-tdx/quote.sock), is checked too though no file names it."""
    data = tmp_path / "data.txt"
    data.write_text("text\n" * 10)
    assert len(str(tmp_path)) < 72, "pytest's temporary directory leaves no room for the cases below"
    for size, key in ((100, "socket"), (85, "state_dir: its TDX module's socket beside it needs")):
        deep = _dir_of_length(tmp_path, size)
        with pytest.raises(BadInput, match=f"{deep}: {key}.* a path of at most 107 bytes, a Unix socket's limit"):
            init_cohort(deep, [("north", str(data))])
        assert not deep.exists()
    fits = _dir_of_length(tmp_path, 107 - len("/state/orchestrator-tdx/quote.sock"))
    init_cohort(fits, [("north", str(data))])
    assert len(quoting_socket(load_service(fits / "orchestrator.toml").state_dir)) == 107


@pytest.mark.parametrize("name, key", [("host.toml", "socket"), ("gpu-0.toml", "link_socket"),
                                       ("orchestrator.toml", "gpu_link_socket"), ("holder-north.toml", "host_socket")])
def test_a_socket_path_longer_than_a_unix_socket_takes_is_refused_by_key(cohort: Path, tmp_path: Path, name: str,
                                                                       key: str) -> None:
    long = "/" + "s" * 107
    bad = _rewrite(cohort / name, tmp_path / name, lambda d: d.update({key: long}))
    with pytest.raises(BadInput, match=f"{key}: expected a path of at most 107 bytes, a Unix socket's limit, "
                                       f"got 108 bytes"):
        load_service(bad)


def test_a_holders_boot_lock_is_refused_when_the_gpu_socket_beside_it_would_not_fit(cohort: Path,
                                                                                     tmp_path: Path) -> None:
    """A holder reaches the GPU at the socket beside its boot lock (service/config.gpu_socket):
    that path is the one checked, not the lock's own (the review of session 24: a 103-byte
    lock with no suffix passed, its socket 108 bytes)."""
    lock = "/" + "s" * 102
    bad = _rewrite(cohort / "holder-north.toml", tmp_path / "h.toml", lambda d: d.update(boot_lock=lock))
    with pytest.raises(BadInput, match="boot_lock: the GPU's socket beside it needs a path of at most 107 bytes, "
                                       "a Unix socket's limit, got 108 bytes"):
        load_service(bad)
    fits = _rewrite(cohort / "holder-north.toml", tmp_path / "f.toml", lambda d: d.update(boot_lock=lock[:-1]))
    assert load_service(fits).boot_lock == lock[:-1]


def test_a_service_that_fails_says_why_in_its_log(cohort: Path, tmp_path: Path, capsys) -> None:
    """A service never exits non-zero without a line in its log saying why."""
    from gputravel.service.serve import serve

    bad = _rewrite(cohort / "host.toml", tmp_path / "host.toml", lambda d: d.update(socket="/" + "s" * 107))
    with pytest.raises(BadInput):
        serve("host", bad)
    said = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert said[-1]["party"] == "host" and said[-1]["event"] == "failed" and said[-1]["kind"] == "BadInput"
    assert "at most 107 bytes" in said[-1]["why"]


def test_gpus_get_a_file_each_with_its_own_serial_and_sockets(tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    data.write_text("text\n" * 10)
    written = init_cohort(tmp_path / "D", [("north", str(data)), ("south", str(data))], gpus=2, steps=3,
                          buffer_bytes=64 << 10)
    gpus = [load_service(p) for p in written if p.name.startswith("gpu-")]
    assert [g.serial for g in gpus] == ["GPU-EMU-0", "GPU-EMU-1"]
    assert len({g.link_socket for g in gpus}) == 2 and gpus[1].vram_bytes > 64 << 10
    assert GpuIssuer.load(tmp_path / "D" / "vendor" / "gpu-1").serial == "GPU-EMU-1"
    for name in ("orchestrator.toml", "orchestrator-1.toml"):  # one rank per GPU, the same job
        job = load_service(tmp_path / "D" / name).job
        assert (job.steps, job.buffer_bytes) == (3, 64 << 10)


# ----------------------------------------------------------------------------- refused files
@pytest.mark.parametrize("change, expected", [
    (lambda d: d["job"].update(steps="ten"), "job.steps: expected a valid integer, got 'ten'"),
    (lambda d: d["job"].update(lr=2.0), "job.lr: expected less than 1, got 2.0"),
    (lambda d: d.update(holders=[]), "holders: expected a list with at least 1 item"),
    (lambda d: d["job"].update(stpes=10), "job.stpes: unknown key"),
    (lambda d: d.update(listen_port=70000), "listen_port: expected less than or equal to 65535, got 70000"),
    (lambda d: d.update(state_dir="state"), "state_dir: expected an absolute path, got 'state'"),
    (lambda d: d.update(hardware="a100"), "hardware: expected 'emulated' or 'paper-h100', got 'a100'"),
    (lambda d: d["layout"].update(record_bytes=5000), "layout.record_bytes: expected a power of two"),
    (lambda d: d["job"].update(buffer_bytes=4096), "job.buffer_bytes: expected a multiple of layout.record_bytes"),
    (lambda d: d["job"].update(n_head=3), "job.n_embd: expected a multiple of n_head (3), got 256"),
    (lambda d: d["job"].update(schedule="random"), "job.schedule: expected 'round_robin' or 'proportional', got 'random'"),
    (lambda d: d.update(holders=["north", "north"]), "holders: expected unique member names"),
    *((lambda d, n=name: d.update(holders=["north", n]), "holders.1: expected a holder's name: none of ca, device")
      for name in ("orchestrator", "orchestrator-1", "device", "tdx-module")),
    (lambda d: d.pop("listen_port"), "listen_port: missing (required)"),
    (lambda d: d.update(party="gpus"), "party: expected one of 'host', 'gpu', 'orchestrator', 'holder', 'broker', got 'gpus'"),
])
def test_a_wrong_key_is_refused_naming_file_key_and_expectation(cohort: Path, tmp_path: Path, change,
                                                                 expected: str) -> None:
    bad = _rewrite(cohort / "orchestrator.toml", tmp_path / "orchestrator.toml", change)
    with pytest.raises(BadInput) as caught:
        load_service(bad)
    assert f"{bad}: {expected}" in str(caught.value)


def test_a_missing_file_bad_toml_and_the_wrong_party_are_refused(cohort: Path, tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=f"{tmp_path / 'none.toml'}: not found"):
        load_service(tmp_path / "none.toml")
    (tmp_path / "bad.toml").write_text('party = "host"\nstate_dir = \n')
    with pytest.raises(BadInput, match=r"bad.toml: not valid TOML: .*line 2"):
        load_service(tmp_path / "bad.toml")
    with pytest.raises(BadInput, match=r"host.toml: party: expected 'gpu' \(the role being started\), got 'host'"):
        load_service(cohort / "host.toml", "gpu")


def test_a_holder_policy_must_pin_a_measurement(cohort: Path, tmp_path: Path) -> None:
    bad = _rewrite(cohort / "holder-north.toml", tmp_path / "h.toml",
                   lambda d: d["policy"].update(orchestrator_measurements=["ab" * 10]))
    with pytest.raises(BadInput, match=r"h.toml: policy.orchestrator_measurements.0: expected a string matching"):
        load_service(bad)


def test_before_start_a_missing_data_path_and_a_port_in_use_are_refused(cohort: Path, tmp_path: Path) -> None:
    for name in PARTIES:
        check_before_start(load_service(cohort / name))  # a fresh cohort is ready to start
    gone = _rewrite(cohort / "holder-north.toml", tmp_path / "holder.toml",
                    lambda d: d.update(data=str(tmp_path / "gone")))
    with pytest.raises(BadInput, match=f"{gone}: data: expected an existing path '{tmp_path / 'gone'}'"):
        check_before_start(load_service(gone))
    orch = load_service(cohort / "orchestrator.toml")
    with socket.socket() as busy:
        busy.bind((orch.listen_host, orch.listen_port))
        busy.listen()
        with pytest.raises(BadInput, match=f"orchestrator.toml: listen_port: expected a free port: "
                                           f"127.0.0.1:{orch.listen_port} is not free"):
            check_before_start(orch)


def test_the_job_becomes_the_training_configuration(cohort: Path) -> None:
    job = load_service(cohort / "orchestrator.toml").job
    train = job.train_config()
    assert (train.steps, train.buffer_bytes, train.tokenizer, train.loader) == \
        (job.steps, job.buffer_bytes, "bytes", "travelling")


def test_the_hardware_choices_are_the_profiles() -> None:
    assert set(HostService.model_fields["hardware"].annotation.__args__) == set(PROFILES)


# ----------------------------------------------------------------------------- status and the command line
def test_status_of_a_fresh_cohort_says_nothing_is_running(cohort: Path) -> None:
    for name in PARTIES:
        found = cohort_status(load_service(cohort / name))
        assert not found["running"] and set(found["services"].values()) == {"down"}
    north = cohort_status(load_service(cohort / "holder-north.toml"))
    assert north["published"] == [] and north["log"] == "not published"
    assert set(north["services"]) == {"host", "gpu-0", "orchestrator"}


def test_cohort_init_and_status_on_the_command_line(tmp_path: Path) -> None:
    from gputravel.cli.app import app

    data = tmp_path / "data.txt"
    data.write_text("text\n" * 10)
    runner = CliRunner()
    done = runner.invoke(app, ["cohort", "init", str(tmp_path / "D"), "--holder", f"north={data}",
                               "--steps", "4"])
    assert done.exit_code == 0, done.output
    assert "holder-north.toml" in done.output and (tmp_path / "D" / "orchestrator.toml").exists()
    again = runner.invoke(app, ["cohort", "init", str(tmp_path / "D"), "--holder", f"north={data}"])
    assert again.exit_code == 1 and "not an empty directory" in again.output
    shown = runner.invoke(app, ["status", "--config", str(tmp_path / "D" / "host.toml")])
    assert shown.exit_code == 0 and "nothing is running" in shown.output
    as_json = runner.invoke(app, ["status", "--config", str(tmp_path / "D" / "orchestrator.toml"), "--json"])
    assert as_json.exit_code == 0 and json.loads(as_json.output)["running"] is False
    bad = runner.invoke(app, ["cohort", "init", str(tmp_path / "E"), "--holder", "north"])
    assert bad.exit_code != 0 and "NAME=PATH" in bad.output


def _served_status(cfg) -> dict:
    """`gputravel status` of a holder whose service has run: its state directory is its own, and
    the log is published as its service publishes it (0644); status reads as the holder."""
    from gputravel.service.party import own_state

    own_state(Path(cfg.state_dir), cfg.uid)
    log = Path(cfg.public_dir) / "audit.log"
    if log.exists():
        log.chmod(0o644)
    return cohort_status(cfg)


def test_a_holder_counts_its_travels_in_the_published_signed_log(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    from gputravel.crypto.certs import key_pem, new_key
    from gputravel.orchestrator.audit import AuditLog, ChunkId

    data = tmp_path / "data.txt"
    data.write_text("text\n" * 10)
    init_cohort(tmp_path / "D", [("north", str(data)), ("south", str(data))])
    public, key = tmp_path / "D" / "public", new_key()
    log = AuditLog.create(public / "audit.log", key_pem(key), gpu="GPU-EMU-0")
    for i, holder in enumerate(("north", "south", "north")):
        log.append("travel", ChunkId(holder, i << 12, 4096), time=1.0, epoch_before=i, epoch_after=i + 1,
                   chunk_digest=bytes(32), holder_key=bytes(32))
    log.close()
    (public / "orchestrator.pem").write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    north = load_service(tmp_path / "D" / "holder-north.toml")
    Path(north.state_dir, "status.json").write_text(json.dumps({"phase": "training", "running": "not mine"}))
    found = _served_status(north)
    assert (found["my_travels"], found["my_bytes"], found["published"]) == (2, 8192, ["orchestrator"])
    assert found["phase"] == "training" and found["running"] is False  # its own keys win over status.json's
    (public / "orchestrator.pem").write_bytes(new_key().public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    assert _served_status(north)["log"].startswith("does not verify")


def test_a_holders_status_checks_its_own_chunks_with_its_key_and_refuses_a_log_cut_short(tmp_path: Path) -> None:
    """`gputravel status` for a holder: its chunks' MACs against its own data under its own
    travel-log key (the log shows nothing else of them), whether the log is closed, and the
    head it verified, kept in its state directory: a later log without it was cut short."""
    from cryptography.hazmat.primitives import serialization

    from gputravel.crypto.certs import key_pem, new_key
    from gputravel.holder.cvm import Dataset, manifest_piece_bytes
    from gputravel.holder.log_key import own_log_key
    from gputravel.orchestrator.audit import AuditLog, ChunkId
    from gputravel.protocol.manifest import chunk_digest

    data = tmp_path / "data.txt"
    data.write_text("If music be the food of love, play on. " * 400)
    init_cohort(tmp_path / "D", [("north", str(data)), ("south", str(data))])
    north = load_service(tmp_path / "D" / "holder-north.toml")
    public, signer = Path(north.public_dir), new_key()
    (public / "orchestrator.pem").write_bytes(signer.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    pki = Path(north.state_dir) / "pki"
    pki.mkdir(parents=True)
    key = own_log_key(pki)  # as the holder's CVM makes it (service/members.py: state/pki)
    tokens = Dataset(north.data, north.format)
    piece = manifest_piece_bytes(north.layout.to_layout())
    log = AuditLog.create(public / "audit.log", key_pem(signer), gpu="GPU-EMU-0")

    def travel(i: int, digest_key: bytes, offset: int = 0) -> None:
        nbytes = min(piece, tokens.size - offset)
        log.append("travel", ChunkId("north", offset, nbytes), time=1.0, epoch_before=i, epoch_after=i + 1,
                   chunk_digest=chunk_digest(tokens.view[offset:offset + nbytes], piece), holder_key=digest_key)

    travel(0, key)
    found = _served_status(north)
    assert found["log"] == "verified, 1 entries, not closed: entries may be missing at the end", found
    assert found["my_chunks"] == "all 1 match this holder's data" and found["log_closed"] is False
    assert key.hex() not in json.dumps(found)
    kept = json.loads((Path(north.state_dir) / "audit-head.json").read_text())
    assert kept["seq"] == 0 and kept["hash"] == found["log_head"]
    travel(1, bytes(32))  # an entry keyed otherwise: not this holder's chunk as its data has it
    log.seal(time=2.0, epoch=2)
    log.close()
    found = _served_status(north)
    assert found["log"] == "verified, 3 entries, closed" and found["log_closed"] is True, found
    assert found["my_chunks"] == "1 of 2 do not match this holder's data (seq 1)"
    # The published log cut back to before the head north verified: refused, saying why.
    whole = (public / "audit.log").read_bytes()
    for kept_bytes in (b"", whole[:len(whole) // 3]):
        (public / "audit.log").write_bytes(kept_bytes)
        found = _served_status(north)
        assert found["log"].startswith("does not verify: audit log: known head missing"), found
        assert "cut short" in found["log"] and "my_travels" not in found
    (public / "audit.log").write_bytes(whole)
    assert _served_status(north)["log"] == "verified, 3 entries, closed"


def test_status_sees_a_live_socket_but_not_a_leftover_file(tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    data.write_text("text\n")
    init_cohort(tmp_path / "D", [("north", str(data))])
    host = load_service(tmp_path / "D" / "host.toml")
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(host.socket)
        live.listen()
        assert cohort_status(host)["services"] == {"host": "up"} and cohort_status(host)["running"]
    assert Path(host.socket).exists() and cohort_status(host)["services"] == {"host": "down"}  # left over
