"""Releasing the model: recipients' keys, the statement holders sign, the quorum, and the HPKE-sealed
release file only the recipients open (red-team rows outsider-opens-release, release-short-of-quorum,
signature-over-other-model)."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import msgspec
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gputravel.crypto.pki import CohortPki
from gputravel.errors import BadInput, IntegrityError, ProtocolError
from gputravel.protocol.codec import encode
from gputravel.release import (
    NotARecipient,
    ReleaseRefused,
    ReleaseSignature,
    ReleaseStatement,
    check_signatures,
    keygen,
    load_private_key,
    load_public_key,
    open_release,
    raw_public,
    read_release,
    seal_release,
    sign_release,
    signature_verdicts,
)
from gputravel.release.seal import ca_der

HOLDERS = ("alice", "bob", "carol")
MODEL = b"torch.save'd state_dict of the trained model" * 100
JOB = hashlib.sha384(b"the approved job manifest").digest()


def der(pem: bytes) -> bytes:
    return x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> CohortPki:
    return CohortPki.create(tmp_path_factory.mktemp("pki"), [*HOLDERS, "mallory", "orchestrator"])


@pytest.fixture(scope="module")
def certs(pki: CohortPki) -> dict[str, bytes]:
    return {n: der(pki.member(n).cert_pem) for n in pki.names}


@pytest.fixture(scope="module")
def ca(pki: CohortPki) -> bytes:
    return ca_der(pki.ca_pem)


@pytest.fixture(scope="module")
def recipients() -> dict[str, X25519PrivateKey]:
    return {"lab": X25519PrivateKey.generate(), "clinic": X25519PrivateKey.generate()}


@pytest.fixture(scope="module")
def statement(recipients: dict[str, X25519PrivateKey]) -> ReleaseStatement:
    return ReleaseStatement.of(MODEL, JOB, {n: raw_public(k) for n, k in recipients.items()})


def sign(pki: CohortPki, statement: ReleaseStatement, *holders: str) -> list[ReleaseSignature]:
    return [sign_release(statement, h, pki.member(h).key_pem) for h in holders]


def seal(statement, signatures, certs, ca, quorum=2, model=MODEL) -> bytes:
    return seal_release(model, statement, signatures, quorum, holders=HOLDERS, certificates=certs, ca_cert_der=ca)


# ----------------------------------------------------------------------------- recipients' keys
def test_keygen_writes_a_private_key_0600_and_the_public_key_in_hex_once(tmp_path: Path) -> None:
    key_path, pub_path = keygen("lab", tmp_path / "keys")
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    text = pub_path.read_text()
    assert len(text) == 65 and text.endswith("\n")
    assert load_public_key(pub_path) == raw_public(load_private_key(key_path))
    with pytest.raises(BadInput, match="already exists"):
        keygen("lab", tmp_path / "keys")
    with pytest.raises(BadInput, match="recipient name"):
        keygen("Lab/..", tmp_path)


def test_key_loaders_name_the_file_at_fault(tmp_path: Path, pki: CohortPki) -> None:
    with pytest.raises(BadInput, match="does not exist"):
        load_private_key(tmp_path / "none.key")
    with pytest.raises(BadInput, match="not an X25519 private key"):
        load_private_key(pki.directory / "alice.key")  # a P-384 TLS key is not a recipient's
    (tmp_path / "bad.pub").write_text("abcd\n")
    with pytest.raises(BadInput, match=r"bad\.pub: a recipient's public key is 64 hex digits"):
        load_public_key(tmp_path / "bad.pub")


# ----------------------------------------------------------------------------- the statement
def test_a_statement_is_canonical_and_its_digest_covers_every_field(statement: ReleaseStatement,
                                                                     recipients) -> None:
    keys = {n: raw_public(k) for n, k in recipients.items()}
    assert statement.recipient_names == ("clinic", "lab")
    assert ReleaseStatement.of(MODEL, JOB, reversed(list(keys.items()))).digest() == statement.digest()
    others = [ReleaseStatement.of(MODEL + b"!", JOB, keys), ReleaseStatement.of(MODEL, bytes(48), keys),
              ReleaseStatement.of(MODEL, JOB, {"lab": keys["lab"]}),
              ReleaseStatement.of(MODEL, JOB, {"lab": keys["lab"], "clinic": bytes(32)})]
    assert len({s.digest() for s in [statement, *others]}) == 5
    with pytest.raises(BadInput, match="sorted by name"):
        ReleaseStatement(statement.model_sha384, JOB, tuple(reversed(statement.recipients)))
    with pytest.raises(BadInput, match="own 32-byte"):
        ReleaseStatement.of(MODEL, JOB, [("a", keys["lab"]), ("b", keys["lab"])])
    with pytest.raises(BadInput, match="at least one recipient"):
        ReleaseStatement.of(MODEL, JOB, {})


# ----------------------------------------------------------------------------- signatures
def test_valid_signatures_of_distinct_named_holders_count(pki, statement, certs, ca) -> None:
    assert check_signatures(statement, sign(pki, statement, "carol", "alice"), HOLDERS, certs, ca) == ["alice", "carol"]


def test_signature_over_other_model_does_not_count(pki, statement, certs, ca, recipients) -> None:
    """Red-team row signature-over-other-model: a holder's signature of another model digest (or
    another job, or other recipients) does not count towards this release."""
    keys = {n: raw_public(k) for n, k in recipients.items()}
    others = [ReleaseStatement.of(b"another model", JOB, keys), ReleaseStatement.of(MODEL, bytes(48), keys),
              ReleaseStatement.of(MODEL, JOB, {**keys, "mallory": raw_public(X25519PrivateKey.generate())})]
    for other in others:
        sigs = sign(pki, other, "alice", "bob")
        assert check_signatures(statement, sigs, HOLDERS, certs, ca) == []
        # Relabelled as over this statement, the signature does not verify either.
        relabelled = [msgspec.structs.replace(s, statement=statement.digest()) for s in sigs]
        verdicts = signature_verdicts(statement, relabelled, HOLDERS, certs, ca)
        assert verdicts == [(h, "the signature does not verify under its certificate") for h in ("alice", "bob")]
    with pytest.raises(ReleaseRefused, match="over another statement"):
        seal(statement, sign(pki, others[0], "alice", "bob"), certs, ca)


def test_a_holder_not_named_a_foreign_ca_or_a_duplicate_does_not_count(pki, statement, certs, ca,
                                                                         tmp_path: Path) -> None:
    mallory = sign(pki, statement, "mallory")
    assert signature_verdicts(statement, mallory, HOLDERS, certs, ca) == [
        ("mallory", "not a holder the manifest lets sign")]
    # An "alice" certified by another CA, with a key of its own.
    foreign = CohortPki.create(tmp_path / "foreign", ["alice"])
    fake = sign_release(statement, "alice", foreign.member("alice").key_pem)
    verdicts = signature_verdicts(statement, [fake], HOLDERS, {**certs, "alice": der(foreign.member("alice").cert_pem)}, ca)
    assert verdicts == [("alice", "its certificate is not issued by the cohort CA")]
    # Mallory's key under alice's name; bob's certificate for alice's signature.
    forged = sign_release(statement, "alice", pki.member("mallory").key_pem)
    assert signature_verdicts(statement, [forged], HOLDERS, certs, ca)[0][1] == \
        "the signature does not verify under its certificate"
    assert signature_verdicts(statement, sign(pki, statement, "alice"), HOLDERS, {"alice": certs["bob"]}, ca)[0][1] \
        == "its certificate names another party"
    # One holder signing twice counts once; no certificate: not counted.
    twice = sign(pki, statement, "alice", "alice")
    assert check_signatures(statement, twice, HOLDERS, certs, ca) == ["alice"]
    assert signature_verdicts(statement, twice, HOLDERS, certs, ca)[1] == ("alice", "a second signature of one holder")
    assert check_signatures(statement, sign(pki, statement, "bob"), HOLDERS, {}, ca) == []
    with pytest.raises(ReleaseRefused, match="1 of 2"):
        seal(statement, twice, certs, ca)


def test_release_short_of_quorum_is_refused(pki, statement, certs, ca) -> None:
    """Red-team row release-short-of-quorum: k-1 signatures seal nothing."""
    with pytest.raises(ReleaseRefused, match=r"^release short of quorum: 1 of 2 signatures$"):
        seal(statement, sign(pki, statement, "alice"), certs, ca)
    with pytest.raises(ReleaseRefused, match="release short of quorum: 2 of 3 signatures"):
        seal(statement, sign(pki, statement, "alice", "bob", "mallory"), certs, ca, quorum=3)
    for quorum in (0, 4, True):
        with pytest.raises(BadInput, match="quorum"):
            seal(statement, sign(pki, statement, *HOLDERS), certs, ca, quorum=quorum)


# ----------------------------------------------------------------------------- sealing and opening
@pytest.fixture(scope="module")
def release(pki, statement, certs, ca) -> bytes:
    return seal(statement, sign(pki, statement, "carol", "mallory", "alice"), certs, ca)


def test_each_recipient_opens_the_release_to_the_model_and_its_statement(release, statement, recipients) -> None:
    for key in recipients.values():
        assert open_release(release, key) == (statement, MODEL)
    parts = read_release(release)
    assert parts.signers == ("alice", "carol") and parts.quorum == 2
    assert MODEL not in release and MODEL[:64] not in release  # ciphertext only


def test_outsider_opens_release_is_refused(release) -> None:
    """Red-team row outsider-opens-release: a key outside the recipients opens nothing."""
    with pytest.raises(NotARecipient, match="this release is not sealed to that key"):
        open_release(release, X25519PrivateKey.generate())


def test_an_edited_release_does_not_open(release, statement, recipients) -> None:
    parts = read_release(release)
    flipped = bytearray(parts.ciphertext)
    flipped[10] ^= 1
    with pytest.raises(IntegrityError):
        open_release(encode(msgspec.structs.replace(parts, ciphertext=bytes(flipped))), recipients["lab"])
    # An outsider who writes itself into the statement and seals a key of its own gets no model.
    outsider = X25519PrivateKey.generate()
    keys = dict(statement.recipients)
    widened = ReleaseStatement.of(MODEL, JOB, {**keys, "mallory": raw_public(outsider)})
    from gputravel.release.seal import SUITE, SealedKey

    sealed = tuple(SealedKey(n, SUITE.encrypt(bytes(32), outsider.public_key(), info=widened.digest())
                             if n == "mallory" else next(s.enc for s in parts.sealed if s.recipient == n))
                   for n in widened.recipient_names)
    forged = encode(msgspec.structs.replace(parts, statement=widened, sealed=sealed))
    with pytest.raises(IntegrityError):
        open_release(forged, outsider)
    with pytest.raises(IntegrityError):  # the statement changed: the recipients' sealed keys no longer open
        open_release(forged, recipients["lab"])
    with pytest.raises(ProtocolError):
        read_release(release[:-1])


def test_a_model_the_statement_does_not_name_is_not_sealed(pki, statement, certs, ca) -> None:
    with pytest.raises(BadInput, match="not the one the release statement names"):
        seal(statement, sign(pki, statement, *HOLDERS), certs, ca, model=MODEL + b"x")


def test_stored_signatures_verify_under_the_cohort_ca(release, ca, tmp_path: Path) -> None:
    parts = read_release(release)
    assert parts.counted(ca) == ["alice", "carol"]
    assert parts.counted(ca_der(CohortPki.create(tmp_path / "other", ["x"]).ca_pem)) == []


def test_a_model_above_one_wire_frame_is_released_too(pki, certs, ca, recipients) -> None:
    big = bytes(65 << 20)  # above the codec's 64 MiB frame
    st = ReleaseStatement.of(big, JOB, {"lab": raw_public(recipients["lab"])})
    blob = seal(st, sign(pki, st, "alice", "bob"), certs, ca, model=big)
    assert open_release(blob, recipients["lab"])[1] == big
    with pytest.raises(ProtocolError, match="not a gputravel release file"):
        read_release(blob[:-1])


def test_signatures_count_under_a_deployments_pinned_certificates_whichever_comes_first(
        tmp_path: Path, statement: ReleaseStatement) -> None:
    """On the services each member signs its own certificate and the orchestrator pins the holders';
    its ca.pem starts with its own (the review found every signature judged against that one)."""
    from gputravel.crypto.pki import self_signed_member
    from gputravel.release.seal import anchors

    for n in ("orchestrator", *HOLDERS, "eve"):
        (tmp_path / n).mkdir(mode=0o700)
    pems = {n: self_signed_member(tmp_path / n, n) for n in ("orchestrator", *HOLDERS)}
    bundle = pems["orchestrator"] + b"".join(pems[h] for h in HOLDERS)
    keys = {h: (tmp_path / h / f"{h}.key").read_bytes() for h in HOLDERS}
    sigs = [sign_release(statement, h, keys[h]) for h in HOLDERS]
    certificates = {h: der(pems[h]) for h in HOLDERS}
    assert check_signatures(statement, sigs, HOLDERS, certificates, anchors(bundle)) == sorted(HOLDERS)
    assert check_signatures(statement, sigs, HOLDERS, certificates, anchors(bundle)[:1]) == []  # the bug
    stranger = self_signed_member(tmp_path / "eve", "alice")  # another key under alice's name, not pinned
    assert check_signatures(statement, sigs[:1], HOLDERS, {"alice": der(stranger)}, anchors(bundle)) == []
    # bob's pinned leaf issues a certificate naming alice, for a key of bob's: it does not count.
    from cryptography.hazmat.primitives.asymmetric import ec

    from gputravel.crypto.certs import issue_certificate, load_key, subject_name, utc_now
    forged_key = ec.generate_private_key(ec.SECP384R1())
    bob_key, bob_cert = load_key(keys["bob"]), x509.load_pem_x509_certificate(pems["bob"])
    forged = issue_certificate(subject=subject_name("alice"), public_key=forged_key.public_key(),
                               issuer=bob_cert.subject, issuer_key=bob_key, not_before=utc_now(None), days=1, is_ca=False)
    forged_der = forged.public_bytes(serialization.Encoding.DER)
    sig = sign_release(statement, "alice", forged_key)
    assert check_signatures(statement, [sig], HOLDERS, {"alice": forged_der}, anchors(bundle)) == []
