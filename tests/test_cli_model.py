"""`gputravel model keygen | show | open`: a recipient makes its keys, reads what the holders signed,
and opens the release to the weights as they were trained."""

from __future__ import annotations

import hashlib
import io
import stat
from pathlib import Path

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from typer.testing import CliRunner

from gputravel.cli.model import model_app
from gputravel.crypto.pki import CohortPki
from gputravel.release import ReleaseStatement, load_public_key, seal_release, sign_release
from gputravel.release.seal import ca_der

HOLDERS = ("alice", "bob", "carol")
JOB = hashlib.sha384(b"job").digest()


def der(pem: bytes) -> bytes:
    return x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)


def run(*args: str):
    return CliRunner().invoke(model_app, [*args])


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> CohortPki:
    return CohortPki.create(tmp_path_factory.mktemp("pki"), HOLDERS)


@pytest.fixture
def released(tmp_path: Path, pki: CohortPki) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """A release of a small model's state_dict to recipient "lab", signed by alice and carol."""
    keys = tmp_path / "keys"
    assert run("keygen", "lab", "--out", str(keys)).exit_code == 0
    torch.manual_seed(0)
    weights = torch.nn.Linear(4, 3).state_dict()
    buf = io.BytesIO()
    torch.save(weights, buf)
    model = buf.getvalue()
    statement = ReleaseStatement.of(model, JOB, {"lab": load_public_key(keys / "lab.pub")})
    sigs = [sign_release(statement, h, pki.member(h).key_pem) for h in ("alice", "carol")]
    blob = seal_release(model, statement, sigs, 2, holders=HOLDERS, ca_cert_der=ca_der(pki.ca_pem),
                        certificates={h: der(pki.member(h).cert_pem) for h in HOLDERS})
    (tmp_path / "model.release").write_bytes(blob)
    return tmp_path / "model.release", keys / "lab.key", weights


def test_keygen_refuses_to_overwrite_a_key(tmp_path: Path) -> None:
    assert run("keygen", "lab", "--out", str(tmp_path)).exit_code == 0
    assert stat.S_IMODE((tmp_path / "lab.key").stat().st_mode) == 0o600
    result = run("keygen", "lab", "--out", str(tmp_path))
    assert result.exit_code == 1 and "already exists" in result.output


def test_open_writes_the_weights_as_trained_and_prints_the_statement(released, pki: CohortPki, tmp_path: Path) -> None:
    release, key, weights = released
    out = tmp_path / "weights.pt"
    result = run("open", str(release), "--key", str(key), "--out", str(out), "--ca", str(pki.directory / "ca.pem"))
    assert result.exit_code == 0, result.output
    assert "alice, carol (2 of a quorum of 2)" in result.output and JOB.hex() in result.output.replace("\n", "")
    assert "signatures verify under the cohort CA" in result.output
    opened = torch.load(out, weights_only=True)
    assert opened.keys() == weights.keys() and all(torch.equal(opened[k], weights[k]) for k in weights)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    again = run("open", str(release), "--key", str(key), "--out", str(out))
    assert again.exit_code == 1 and "already exists" in again.output


def test_show_needs_no_key_and_an_outsider_opens_nothing(released, tmp_path: Path) -> None:
    release, _, _ = released
    shown = run("show", str(release))
    assert shown.exit_code == 0 and "recipient      lab" in shown.output and "not checked" in shown.output
    assert run("keygen", "eve", "--out", str(tmp_path / "eve")).exit_code == 0
    out = tmp_path / "stolen.pt"
    result = run("open", str(release), "--key", str(tmp_path / "eve" / "eve.key"), "--out", str(out))
    assert result.exit_code == 1 and "this release is not sealed to that key" in result.output
    assert not out.exists()


def test_a_foreign_ca_or_a_file_that_is_no_release_is_refused(released, tmp_path: Path) -> None:
    release, key, _ = released
    other = CohortPki.create(tmp_path / "other", ["x"])
    result = run("show", str(release), "--ca", str(other.directory / "ca.pem"))
    assert result.exit_code == 1 and "below its quorum of 2" in result.output
    (tmp_path / "junk").write_bytes(b"\x81\xa1t\xa3abc")
    result = run("open", str(tmp_path / "junk"), "--key", str(key), "--out", str(tmp_path / "w.pt"))
    assert result.exit_code == 1 and "unknown message tag" in result.output
    result = run("show", str(tmp_path / "missing"))
    assert result.exit_code == 1 and "does not exist" in result.output


def test_keygen_prints_the_fingerprint_holders_confirm(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from gputravel.cli.app import app
    from gputravel.manifest import key_fingerprint

    res = CliRunner().invoke(app, ["model", "keygen", "alice", "--out", str(tmp_path / "keys")])
    said = " ".join(res.output.split())
    fingerprint = key_fingerprint(bytes.fromhex((tmp_path / "keys" / "alice.pub").read_text().strip()))
    assert res.exit_code == 0 and f"(job approve --recipient alice=...): {fingerprint}" in said, said
