"""`gputravel job init | show | digest | approve` (issue 28): a manifest written, reviewed and
approved from a holder's own config, idempotently, and refused when it is not the job told of."""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
import tomli_w
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from typer.testing import CliRunner

from gputravel.broker.state import public_key_hex
from gputravel.cli.app import app
from gputravel.crypto.pki import self_signed_member
from gputravel.data.records import RecordSchema
from gputravel.manifest import key_fingerprint, load_manifest, write_manifest
from gputravel.service.config import load_service
from gputravel.service.job import certificate_sha384

SCHEMA = RecordSchema.parse("x: float32[30]; label: int64[]")


def _run(*args: str, input: str | None = None):
    res = CliRunner().invoke(app, list(args), input=input)
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    return res


def _ok(*args: str, input: str | None = None) -> str:
    res = _run(*args, input=input)
    assert res.exit_code == 0, res.output
    return res.output


def _refused(*args: str, says: str, input: str | None = None) -> str:
    res = _run(*args, input=input)
    out = " ".join(res.output.split())
    assert res.exit_code != 0 and says in out, out
    return out


@pytest.fixture
def pub(tmp_path: Path) -> Path:
    """A recipient's NAME.pub, as `gputravel model keygen` writes it: 64 hex and a newline."""
    path = tmp_path / "dana.pub"
    path.write_text(X25519PrivateKey.generate().public_key().public_bytes_raw().hex() + "\n")
    return path


@pytest.fixture
def job(tmp_path: Path, pub: Path) -> Path:
    out = tmp_path / "job.toml"
    _ok("job", "init", "--out", str(out), "--holders", "alice,bob,carol", "--recipient", f"dana={pub}",
        "--steps", "40", "--lr", "0.002")
    return out


@pytest.fixture
def confirm(job: Path, tmp_path: Path) -> list[str]:
    return _name_parties(job, tmp_path)


BROKER = public_key_hex(ec.generate_private_key(ec.SECP384R1()))


def _name_parties(path: Path, tmp_path: Path) -> list[str]:
    """Name in the manifest at `path` alice's own certificate (made in her state, as `cohort identity`
    would), the other signers' and a key broker; the flags with which alice confirms them."""
    pki = tmp_path / "state" / "pki"
    pki.mkdir(parents=True, exist_ok=True)
    own = self_signed_member(pki, "alice")
    m = load_manifest(path)
    others = {h: (h[0] * 96 if h[0] in "abcdef" else "d" * 96) for h in m.release.holders if h != "alice"}
    certs = {**others, **({"alice": certificate_sha384(own)} if "alice" in m.release.holders else {})}
    write_manifest(path, m.with_parties(certs, BROKER), force=True)
    return ["--broker", key_fingerprint(bytes.fromhex(BROKER)),
            *(a for h, c in others.items() for a in ("--signer", f"{h}={c}")),
            *(a for r in m.release.recipients for a in ("--recipient", f"{r.name}={key_fingerprint(r.key_bytes())}"))]


def _holder_config(tmp_path: Path, name: str = "alice", **extra: object) -> Path:
    """A holder's service config (service/config.py HolderService); its paths need not exist to be read."""
    base = str(tmp_path)
    raw = {"party": "holder", "name": name, "cohort_dir": base, "state_dir": f"{base}/state", "uid": -1,
           "host_socket": f"{base}/h.sock", "boot_lock": f"{base}/gpu.lock", "trust_dir": base, "public_dir": base,
           "data": f"{base}/data", "orchestrator_port": 7000, "layout": {"record_bytes": 1 << 20},
           "policy": {"orchestrator_measurements": ["ab" * 48]}, **extra}
    path = tmp_path / f"holder-{name}.toml"
    path.write_text("# alice's holder\n" + tomli_w.dumps(raw))
    return path


def test_init_writes_a_manifest_that_show_and_digest_read(job: Path, pub: Path) -> None:
    m = load_manifest(job)
    assert m.job.steps == 40 and m.job.lr == 0.002 and m.release.quorum == 2  # a majority of 3
    assert m.release.recipients[0].public_key == pub.read_text().strip() and m.outputs.model == "release"
    assert _ok("job", "digest", str(job)) == m.digest_hex() + "\n"
    shown = _ok("job", "show", str(job))
    assert m.digest_hex() in shown and "2 of 3 holders must sign: alice, bob, carol" in shown


def test_init_pins_a_workload_files_code_and_the_holders_schema(tmp_path: Path) -> None:
    code = tmp_path / "mine.py"
    code.write_text("def build(schema):\n    return None\n")
    data = tmp_path / "data"
    data.mkdir()
    (data / "schema.json").write_text(json.dumps(SCHEMA.to_dict()))
    out = tmp_path / "job.toml"
    _ok("job", "init", "-o", str(out), "--holders", "alice", "--workload", str(code), "--schema-from", str(data),
        "--model", "sealed")
    m = load_manifest(out)
    assert m.workload.name == "mine" and m.workload.file == "mine.py"
    assert m.workload.code == hashlib.sha384(code.read_bytes()).hexdigest()
    assert m.data.schema_digest == SCHEMA.digest() and m.outputs.model == "sealed" and m.release.quorum == 1


def test_init_refuses_bad_input_naming_the_flag_or_key(tmp_path: Path, pub: Path, job: Path) -> None:
    out = str(tmp_path / "new.toml")
    _refused("job", "init", "-o", str(job), "--holders", "alice", "--model", "sealed", says="exists")
    _refused("job", "init", "-o", out, "--holders", "alice,bob,carol", "--quorum", "4", "--recipient", f"d={pub}",
             says="release.quorum: expected at most 3 (the holders named), got 4")
    _refused("job", "init", "-o", out, "--holders", "alice", says="release.recipients: expected at least one")
    _refused("job", "init", "-o", out, "--holders", "alice", "--recipient", "dana", says="NAME=PUBFILE")
    _refused("job", "init", "-o", out, "--holders", "alice", "--recipient", f"dana={tmp_path / 'no.pub'}",
             says="is not a file")
    (tmp_path / "bad.pub").write_text("00" * 31 + "\n")
    _refused("job", "init", "-o", out, "--holders", "alice", "--recipient", f"dana={tmp_path / 'bad.pub'}",
             says="does not hold a raw X25519 public key")
    _refused("job", "init", "-o", out, "--holders", "alice", "--workload", "tabular", "--model", "sealed",
             says="--schema-from: workload 'tabular' trains on records")
    _refused("job", "init", "-o", out, "--holders", "alice", "--model", "sealed", "--schema-from", str(tmp_path),
             says="--schema-from: gpt2 trains on tokens")
    _refused("job", "init", "-o", out, "--holders", "alice", "--model", "sealed", "--lr", "2",
             says="--lr: expected less than 1")
    assert not Path(out).exists()


def test_approve_adds_the_digest_once_keeping_the_other_keys(job: Path, confirm: list[str], tmp_path: Path) -> None:
    cfg = _holder_config(tmp_path)
    digest = load_manifest(job).digest_hex()
    said = _ok("job", "approve", str(job), "--holder-config", str(cfg), "--yes", "--digest", digest.upper(), *confirm)
    assert "alice approves job " + digest in said and "2 of 3 holders" in said
    policy = load_service(cfg, "holder").policy
    assert policy.approved_jobs == [digest] and policy.orchestrator_measurements == ["ab" * 48]
    assert policy.to_policy(str(tmp_path)).approved_jobs == (bytes.fromhex(digest),)
    before = cfg.read_bytes()
    assert "already approves" in _ok("job", "approve", str(job), "--holder-config", str(cfg))
    assert cfg.read_bytes() == before  # idempotent: no second entry, no rewrite
    assert tomllib.loads(before.decode())["layout"] == {"record_bytes": 1 << 20}


def test_approve_asks_first_and_a_no_changes_nothing(job: Path, confirm: list[str], tmp_path: Path) -> None:
    cfg = _holder_config(tmp_path)
    before = cfg.read_bytes()
    _refused("job", "approve", str(job), "--holder-config", str(cfg), *confirm, input="n\n", says="not approved")
    assert cfg.read_bytes() == before
    _ok("job", "approve", str(job), "--holder-config", str(cfg), *confirm, input="y\n")
    assert load_service(cfg, "holder").policy.approved_jobs == [load_manifest(job).digest_hex()]


def test_approve_refuses_another_digest_holder_share_or_format(job: Path, tmp_path: Path) -> None:
    cfg = _holder_config(tmp_path)
    before = cfg.read_bytes()
    _refused("job", "approve", str(job), "--holder-config", str(cfg), "--yes", "--digest", "00" * 48,
             says="is not the --digest given")
    _refused("job", "approve", str(job), "--holder-config", str(_holder_config(tmp_path, "erin")), "--yes",
             says="name: 'erin' is not among")
    _refused("job", "approve", str(job), "--holder-config", str(_holder_config(tmp_path, "bob", eval_share=0.1)),
             "--yes", says="eval_share: 0.1 differs from")
    _refused("job", "approve", str(job), "--holder-config", str(_holder_config(tmp_path, "carol", format="records")),
             "--yes", says="format: 'records', but")
    _refused("job", "approve", str(job), "--holder-config", str(job), "--yes", says="party")
    assert cfg.read_bytes() == before


def test_show_and_digest_refuse_a_bad_manifest_naming_file_and_key(job: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(job.read_text().replace("quorum = 2", "quorum = 4\ncolour = 1"))
    for cmd in ("show", "digest"):
        out = _refused("job", cmd, str(bad), says="release.colour: unknown key")
        assert "release.quorum: expected at most 3" not in out  # per-key errors come first; cross checks after
    _refused("job", "digest", str(tmp_path / "none.toml"), says="not found")


def test_approve_checks_a_records_job_against_the_holders_own_schema(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "schema.json").write_text(json.dumps(SCHEMA.to_dict()))
    out = tmp_path / "job.toml"
    _ok("job", "init", "-o", str(out), "--holders", "alice", "--workload", "tabular", "--schema-from", str(data),
        "--model", "sealed")
    cfg = _holder_config(tmp_path, format="records")
    _ok("job", "approve", str(out), "--holder-config", str(cfg), "--yes", *_name_parties(out, tmp_path))
    other = RecordSchema.parse("x: float32[31]; label: int64[]")
    (data / "schema.json").write_text(json.dumps(other.to_dict()))
    out.unlink()
    _ok("job", "init", "-o", str(out), "--holders", "alice", "--workload", "tabular", "--schema-from",
        str(tmp_path / "data" / "schema.json"), "--model", "sealed")
    (data / "schema.json").write_text(json.dumps(SCHEMA.to_dict()))
    _refused("job", "approve", str(out), "--holder-config", str(cfg), "--yes", *_name_parties(out, tmp_path),
             says="data: its records' schema")


def test_approve_refuses_a_recipient_or_a_party_not_confirmed(job: Path, confirm: list[str], tmp_path: Path) -> None:
    """The second review named its own key "dana" in a manifest and every holder approved: a holder
    now confirms each recipient's key too; malformed or self-confirming flags are refused."""
    cfg = _holder_config(tmp_path)
    before = cfg.read_bytes()
    recipient = confirm.index("--recipient")
    without = confirm[:recipient] + confirm[recipient + 2:]
    base = ("job", "approve", str(job), "--holder-config", str(cfg), "--yes")
    _refused(*base, *without, says="confirm recipient dana's key with --recipient dana=FINGERPRINT")
    _refused(*base, *without, "--recipient", "dana=sha256:" + "0" * 32,
             says="has key sha256:")
    _refused(*base, *confirm, "--recipient", "erin=sha256:" + "0" * 32, says="--recipient erin: not among")
    _refused(*base, *confirm[2:], "--broker", "abc", says="--broker: expected the key broker's fingerprint")
    _refused(*base, *confirm, "--signer", "alice=" + "0" * 32, says="--signer alice: this holder's own certificate")
    assert cfg.read_bytes() == before
    said = _ok(*base, *confirm)
    assert "recipient dana sha256:" in said and "(confirmed now)" in said
    assert load_service(cfg, "holder").policy.known_recipients == {"dana": confirm[recipient + 1].split("=", 1)[1]}
