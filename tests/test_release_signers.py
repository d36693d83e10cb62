"""A manifest that names each signer's own certificate (issue 28 on the deployed services): a
release signature counts only over the TLS certificate the manifest names for that holder, so a
key someone else made for a holder (whoever ran `cohort init`, in the first stop) signs nothing."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gputravel.crypto.certs import load_key
from gputravel.errors import BadInput
from gputravel.manifest import JobManifest, Recipient
from gputravel.orchestrator.release import Ending, end_job
from gputravel.redteam.identities import SigningLink, member_identity  # the red-team row's TLS link, as a holder answers
from gputravel.release import ReleaseStatement, open_release, sign_release
from gputravel.train.job import TrainConfig

HOLDERS = ("north", "south", "west")


def _ending(manifest: JobManifest, anchors: tuple[bytes, ...]) -> Ending:
    sealer = SimpleNamespace(seal=lambda data: b"sealed:" + hashlib.sha384(data).digest())
    return Ending(manifest, manifest.digest(), anchors, sealer, 5.0, SimpleNamespace())  # type: ignore[arg-type]


def test_a_signature_counts_only_over_the_certificate_the_manifest_names(tmp_path: Path) -> None:
    own = {n: member_identity(tmp_path / n, n) for n in HOLDERS}
    forged = member_identity(tmp_path / "operator", "south")  # same name, a key the init operator made and kept
    recipient = X25519PrivateKey.generate()
    manifest = JobManifest.for_job(TrainConfig(steps=2), holders=HOLDERS, quorum=2,
                                   recipients=[Recipient.of("alice", recipient.public_key())],
                                   certificates={n: hashlib.sha384(c).hexdigest() for n, (c, _) in own.items()})
    weights = b"the trained weights"
    links = {"north": SigningLink("north", own["north"]), "south": SigningLink("south", forged),
             "west": SigningLink("west", own["west"])}
    anchors = tuple(own[n][0] for n in HOLDERS)
    out = end_job(_ending(manifest, anchors + (forged[0],)), weights, {}, links, tmp_path, None)
    assert out.signed == ["north", "west"] and "not the one the manifest names" in out.declined["south"]
    assert out.released_to == ["alice"]
    statement, model = open_release((tmp_path / "model.release").read_bytes(), recipient)
    assert model == weights and statement.job_digest == manifest.digest()
    short = manifest.model_copy(update={"release": manifest.release.model_copy(update={"quorum": 3})})
    links["south"] = SigningLink("south", forged)
    (tmp_path / "model.release").unlink()
    out = end_job(_ending(short, anchors + (forged[0],)), weights, {}, links, tmp_path, None)
    assert out.signed == ["north", "west"] and out.released_to == [] and not (tmp_path / "model.release").exists()


def test_a_manifest_naming_certificates_this_orchestrator_does_not_pin_is_refused_before_training(
        tmp_path: Path) -> None:
    from gputravel.crypto.pki import CohortPki
    from gputravel.orchestrator.cvm import OrchestratorConfig
    from gputravel.orchestrator.process import _anchors, job_parties
    from gputravel.protocol.layout import Layout

    CohortPki.create(tmp_path / "pki", ["orchestrator", *HOLDERS])  # a local cohort's CA-issued members
    own = {n: member_identity(tmp_path / n, n) for n in HOLDERS}
    manifest = JobManifest.for_job(TrainConfig(steps=2), holders=HOLDERS, quorum=2, recipients=[
        Recipient.of("alice", X25519PrivateKey.generate().public_key())],
        certificates={n: hashlib.sha384(c).hexdigest() for n, (c, _) in own.items()})
    config = OrchestratorConfig(host_socket="", pki_dir=str(tmp_path / "pki"), layout=Layout(), buffer_bytes=4096,
                                job_json=TrainConfig(steps=2).canonical_json(), manifest_json=manifest.to_json(),
                                broker_socket="/nonexistent/broker.sock")
    with pytest.raises(BadInput, match=r"release\.certificates names holder .north..s certificate, but this orchestr"):
        _anchors(manifest, config)
    with pytest.raises(BadInput, match=r"needs its key broker.s identity: broker\.identity in the manifest"):
        job_parties(manifest, config)
    from dataclasses import replace

    other = manifest.with_parties(dict(manifest.release.certificates), _broker_key())
    with pytest.raises(BadInput, match="is not the key broker this orchestrator's measurement names"):
        job_parties(other, replace(config, broker_key=_broker_key()))
    assert job_parties(other, config) == other.broker.identity


def _broker_key() -> str:
    from cryptography.hazmat.primitives.asymmetric import ec

    from gputravel.broker.state import public_key_hex

    return public_key_hex(ec.generate_private_key(ec.SECP384R1()))


def test_a_holder_connecting_with_another_certificate_than_the_named_one_joins_nothing(tmp_path: Path) -> None:
    """The review of per-party identities put a second certificate under south's name in the
    orchestrator's ca.pem (the host writes it): TLS admitted it as south, and it could have fed
    data and taken south's link; the manifest's certificate is now checked at the join too."""
    from gputravel.errors import ProtocolError
    from gputravel.orchestrator.cvm import Orchestrator
    from gputravel.protocol.travel import Bye

    own, impostor = member_identity(tmp_path / "south", "south"), member_identity(tmp_path / "host", "south")
    sent, challenged = [], []

    class _Conn:
        def __init__(self, cert: bytes) -> None:
            self.cert = cert

        def peer_certificate(self) -> bytes:
            return self.cert

        def send(self, msg: object) -> None:
            sent.append(msg)

        def close(self) -> None:
            pass

    def stub(cert: bytes) -> SimpleNamespace:
        named = hashlib.sha384(own[0]).hexdigest()
        return SimpleNamespace(listener=SimpleNamespace(accept=lambda timeout: (_Conn(cert), "south")),
                               _named_certificate=lambda peer: named if peer == "south" else "",
                               attester=SimpleNamespace(serve_challenge=lambda *a: challenged.append(a) or
                                                        (_ for _ in ()).throw(RuntimeError("attested"))),
                               driver=None, _clock=lambda: 0.0)

    with pytest.raises(ProtocolError, match="other than the one the job's manifest names"):
        Orchestrator.accept_holder(stub(impostor[0]), 1.0)  # type: ignore[arg-type]
    assert challenged == [] and isinstance(sent[-1], Bye)
    with pytest.raises(RuntimeError, match="attested"):  # its own certificate goes on to attestation
        Orchestrator.accept_holder(stub(own[0]), 1.0)  # type: ignore[arg-type]
    assert len(challenged) == 1
    # The second review joined as 'west' and 'mallory', whom the manifest names no certificate for.
    unnamed = stub(own[0])
    unnamed.listener = SimpleNamespace(accept=lambda timeout: (_Conn(impostor[0]), "mallory"))
    unnamed._named_certificate = lambda peer: Orchestrator._named_certificate(
        SimpleNamespace(_manifest=SimpleNamespace(release=SimpleNamespace(certificates={"south": "ab" * 48}))), peer)
    with pytest.raises(ProtocolError, match="'mallory' is not a holder the job's manifest names a certificate for"):
        Orchestrator.accept_holder(unnamed, 1.0)  # type: ignore[arg-type]
    assert len(challenged) == 1


def test_a_recipient_checks_a_release_against_the_manifest_not_the_files_own_word(tmp_path: Path) -> None:
    """The second review forged a release of its own model to alice's real key for the real job,
    signed as north and south with keys it made and published in D/public: `model show --ca` with
    those certificates passed. `--manifest` counts only the certificates the manifest names."""
    from typer.testing import CliRunner

    from gputravel.cli.app import app
    from gputravel.manifest import write_manifest
    from gputravel.release import seal_release
    from gputravel.release.keys import keygen

    own = {n: member_identity(tmp_path / n, n) for n in HOLDERS}
    forged = {n: member_identity(tmp_path / f"host-{n}", n) for n in HOLDERS}
    key_path, pub_path = keygen("alice", tmp_path / "keys")
    alice = Recipient.of("alice", bytes.fromhex(pub_path.read_text().strip()))
    manifest = JobManifest.for_job(TrainConfig(steps=2), holders=HOLDERS, quorum=2, recipients=[alice],
                                   certificates={n: hashlib.sha384(c).hexdigest() for n, (c, _) in own.items()})
    write_manifest(tmp_path / "job.toml", manifest)

    def release(signers: dict[str, tuple[bytes, bytes]], job: bytes) -> Path:
        statement = ReleaseStatement.of(b"weights", job, manifest.recipient_keys())
        sigs = [sign_release(statement, n, load_key(k)) for n, (_, k) in signers.items()]
        blob = seal_release(b"weights", statement, sigs, 2, holders=HOLDERS, ca_cert_der=[c for c, _ in signers.values()],
                            certificates={n: c for n, (c, _) in signers.items()})
        path = tmp_path / f"release-{len(list(tmp_path.glob('release-*')))}"
        path.write_bytes(blob)
        return path

    def show(path: Path) -> tuple[int, str]:
        res = CliRunner().invoke(app, ["model", "show", str(path), "--manifest", str(tmp_path / "job.toml")])
        return res.exit_code, " ".join(res.output.replace("│", " ").split())

    good = release({n: own[n] for n in ("north", "south")}, manifest.digest())
    code, said = show(good)
    assert code == 0 and "signatures verify under the manifest's certificates: north, south (quorum 2)" in said
    code, said = show(release({n: forged[n] for n in ("north", "south")}, manifest.digest()))
    assert code != 0 and "only 0 of the release's signatures (none) verify under the certificates" in said
    code, said = show(release({"north": own["north"], "south": forged["south"]}, manifest.digest()))
    assert code != 0 and "only 1 of the release's signatures (north)" in said
    code, said = show(release({n: own[n] for n in ("north", "south")}, b"\x01" * 48))
    assert code != 0 and "the release is of job 0101010101010101..., not of" in said
    out = tmp_path / "weights.pt"
    opened = CliRunner().invoke(app, ["model", "open", str(good), "--key", str(key_path), "--out", str(out),
                                      "--manifest", str(tmp_path / "job.toml")])
    assert opened.exit_code == 0 and out.read_bytes() == b"weights", opened.output
