"""Cohort PKI (mutual TLS 1.3) and the emulated device identity."""

from __future__ import annotations

import socket
import ssl
import stat
import threading
from datetime import datetime, timezone

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gputravel.crypto.device_identity import make_device_identity
from cryptography.hazmat.primitives import serialization

from gputravel.crypto.certs import cert_pem, issue_certificate, key_pem, subject_name
from gputravel.crypto.pki import CohortPki, MemberIdentity, peer_name, pin_peers, self_signed_member
from gputravel.errors import BadInput

MEMBERS = ("orchestrator", "holder-1", "host")


@pytest.fixture(scope="module")
def cohort(tmp_path_factory):
    return CohortPki.create(tmp_path_factory.mktemp("cohort"), MEMBERS)


@pytest.fixture(scope="module")
def other_cohort(tmp_path_factory):
    return CohortPki.create(tmp_path_factory.mktemp("other"), MEMBERS)


def run_tls(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, server_hostname: str):
    """Handshake over a socketpair, server in a thread, and one byte each way.

    Returns (server result, client result); a result is the peer name or the exception.
    """
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    results: dict[str, object] = {}

    def serve():
        try:
            with server_ctx.wrap_socket(a, server_side=True) as s:
                s.sendall(b"s")
                s.recv(1)
                results["server"] = peer_name(s)
        except Exception as exc:  # reported to the test thread
            results["server"] = exc

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with client_ctx.wrap_socket(b, server_hostname=server_hostname) as c:
            # In TLS 1.3 the server checks the client certificate after the client finished,
            # so a refusal shows up on the first read.
            if c.recv(1) != b"s":
                raise ConnectionError("no data")
            c.sendall(b"c")
            results["client"] = peer_name(c)
    except Exception as exc:
        results["client"] = exc
    finally:
        thread.join(10)
        a.close()
        b.close()
    return results["server"], results["client"]


def test_mutual_tls13_reports_peer_names(cohort):
    server, client = run_tls(
        cohort.server_context("orchestrator"), cohort.client_context("holder-1"), "orchestrator"
    )
    assert server == "holder-1"
    assert client == "orchestrator"


def test_contexts_are_tls13_only(cohort):
    for ctx in (cohort.server_context("host"), cohort.client_context("host")):
        assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
        assert ctx.maximum_version == ssl.TLSVersion.TLSv1_3
        assert ctx.verify_mode == ssl.CERT_REQUIRED
    assert cohort.client_context("host").check_hostname


def test_server_from_other_cohort_refused(cohort, other_cohort):
    server, client = run_tls(
        other_cohort.server_context("orchestrator"), cohort.client_context("holder-1"), "orchestrator"
    )
    assert isinstance(client, ssl.SSLCertVerificationError)
    assert isinstance(server, Exception)


def test_client_cert_from_other_cohort_refused(cohort, other_cohort):
    # A client that trusts our CA but presents a certificate from another cohort's CA.
    rogue = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    rogue.minimum_version = ssl.TLSVersion.TLSv1_3
    rogue.load_verify_locations(cadata=cohort.ca_pem.decode())
    d = other_cohort.directory
    rogue.load_cert_chain(d / "holder-1.pem", d / "holder-1.key")
    server, client = run_tls(cohort.server_context("orchestrator"), rogue, "orchestrator")
    assert isinstance(server, ssl.SSLError)
    assert isinstance(client, Exception)


def test_client_without_cert_refused(cohort):
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.load_verify_locations(cadata=cohort.ca_pem.decode())
    server, client = run_tls(cohort.server_context("orchestrator"), bare, "orchestrator")
    assert isinstance(server, ssl.SSLError)
    assert isinstance(client, Exception)


def test_wrong_hostname_refused(cohort):
    _, client = run_tls(cohort.server_context("host"), cohort.client_context("holder-1"), "orchestrator")
    assert isinstance(client, ssl.SSLCertVerificationError)


def test_unknown_member_is_bad_input(cohort):
    with pytest.raises(BadInput, match="holder-1"):
        cohort.member("mallory")
    with pytest.raises(BadInput):
        cohort.server_context("mallory")


@pytest.mark.parametrize("name", ["Alice", "", "a" * 33, "a_b", "ca", "../x"])
def test_invalid_names(tmp_path, name):
    with pytest.raises(BadInput):
        CohortPki.create(tmp_path, [name])


def test_create_refuses_duplicates_and_existing(tmp_path, cohort):
    with pytest.raises(BadInput):
        CohortPki.create(tmp_path, ["a", "a"])
    with pytest.raises(BadInput):
        CohortPki.create(cohort.directory, ["a"])


def test_files_and_modes(cohort):
    d = cohort.directory
    assert (d / "ca.pem").is_file()
    # The CA's private key is discarded once it has signed the members: only member keys remain.
    assert sorted(p.name for p in d.iterdir() if p.suffix == ".key") == sorted(f"{n}.key" for n in MEMBERS)
    assert not any(b"PRIVATE KEY" in (d / f).read_bytes() for f in ("ca.pem", *(f"{n}.pem" for n in MEMBERS)))
    for name in MEMBERS:
        assert (d / f"{name}.pem").is_file()
        assert stat.S_IMODE((d / f"{name}.key").stat().st_mode) == 0o600


def test_certificates_shape(cohort):
    ca = x509.load_pem_x509_certificate(cohort.ca_pem)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    leaf = x509.load_pem_x509_certificate(cohort.member("host").cert_pem)
    assert leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "host"
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["host"]
    for cert in (ca, leaf):
        assert isinstance(cert.public_key().curve, ec.SECP384R1)
        assert cert.signature_hash_algorithm.name == "sha384"
    leaf.verify_directly_issued_by(ca)


def test_load_round_trip(cohort):
    loaded = CohortPki.load(cohort.directory)
    assert loaded.names == tuple(sorted(MEMBERS))
    assert loaded.member("host") == cohort.member("host")
    assert loaded.ca_pem == cohort.ca_pem


def test_load_rejects_foreign_member(tmp_path, other_cohort):
    mine = CohortPki.create(tmp_path / "c", ["alice"])
    d = other_cohort.directory
    (mine.directory / "host.pem").write_bytes((d / "host.pem").read_bytes())
    (mine.directory / "host.key").write_bytes((d / "host.key").read_bytes())
    with pytest.raises(BadInput, match="host"):
        CohortPki.load(mine.directory)


def test_load_missing_ca(tmp_path):
    with pytest.raises(BadInput):
        CohortPki.load(tmp_path)


def test_member_repr_hides_key(cohort):
    ident = cohort.member("host")
    assert isinstance(ident, MemberIdentity)
    assert b"PRIVATE KEY" in ident.key_pem
    assert "PRIVATE" not in repr(ident) and "key_pem" not in repr(ident)
    assert "PRIVATE" not in repr(cohort)


def test_naive_now_rejected(tmp_path):
    with pytest.raises(BadInput):
        CohortPki.create(tmp_path, ["a"], now=datetime(2030, 1, 1))


def test_device_identity():
    now = datetime(2030, 1, 1, tzinfo=timezone.utc)
    ident = make_device_identity(serial="GPU-TEST-1", now=now)
    assert len(ident.chain_der) == 2
    leaf, root = (x509.load_der_x509_certificate(c) for c in ident.chain_der)
    root_cn = root.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    assert "EMULATED" in root_cn and "not NVIDIA" in root_cn
    assert root.subject == root.issuer
    leaf.verify_directly_issued_by(root)
    assert "GPU-TEST-1" in leaf.subject.rfc4514_string()
    assert leaf.public_key().public_numbers() == ident.private_key.public_key().public_numbers()
    for cert in (leaf, root):
        assert cert.signature_hash_algorithm.name == "sha384"
        assert isinstance(cert.public_key().curve, ec.SECP384R1)
    assert leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc
    assert "private_key" not in repr(ident)
    assert ident.root_der == ident.chain_der[-1]
    with pytest.raises(BadInput):
        make_device_identity(serial="bad serial!")


# ----------------------------------------------------------------------------- pinned peers (service/)
def _pinned(tmp_path, name):
    d = tmp_path / name
    d.mkdir()
    pem = self_signed_member(d, name)
    return d, pem


def test_pinned_members_meet_and_an_unpinned_one_is_refused(tmp_path):
    """Deployed parties trust exactly the certificates they pinned: a holder the orchestrator
    pinned gets in; one with a certificate of its own for the same name does not."""
    o_dir, o_pem = _pinned(tmp_path, "orchestrator")
    h_dir, h_pem = _pinned(tmp_path, "north")
    (tmp_path / "impostor").mkdir()
    impostor_dir, _ = _pinned(tmp_path / "impostor", "north")
    pin_peers(o_dir, "orchestrator", [h_pem])
    pin_peers(h_dir, "north", [o_pem])
    pin_peers(impostor_dir, "north", [o_pem])
    server = CohortPki.load(o_dir).server_context("orchestrator")
    assert run_tls(server, CohortPki.load(h_dir).client_context("north"), "orchestrator") == ("north", "orchestrator")
    s, c = run_tls(server, CohortPki.load(impostor_dir).client_context("north"), "orchestrator")
    assert isinstance(s, ssl.SSLError) and isinstance(c, Exception)


def test_a_pinned_self_signed_certificate_cannot_issue_another(tmp_path):
    """A pinned holder's key is not a CA: a certificate it signs for another name is refused."""
    o_dir, o_pem = _pinned(tmp_path, "orchestrator")
    h_dir, h_pem = _pinned(tmp_path, "north")
    pin_peers(o_dir, "orchestrator", [h_pem])
    forged_dir = tmp_path / "forged"
    forged_dir.mkdir()
    h_key = serialization.load_pem_private_key((h_dir / "north.key").read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP384R1())
    cert = issue_certificate(subject=subject_name("south"), public_key=key.public_key(), issuer=subject_name("north"),
                             issuer_key=h_key, not_before=datetime.now(timezone.utc), days=1, is_ca=False,
                             extensions=[(x509.SubjectAlternativeName([x509.DNSName("south")]), False)])
    (forged_dir / "south.pem").write_bytes(cert_pem(cert) + h_pem)
    (forged_dir / "south.key").write_bytes(key_pem(key))
    (forged_dir / "ca.pem").write_bytes(h_pem + o_pem)
    client = CohortPki.load(forged_dir).client_context("south")
    s, c = run_tls(CohortPki.load(o_dir).server_context("orchestrator"), client, "orchestrator")
    assert isinstance(s, ssl.SSLError), s


def test_a_restarted_member_keeps_its_pinned_identity(tmp_path):
    d, pem = _pinned(tmp_path, "north")
    assert self_signed_member(d, "north") == pem
    assert stat.S_IMODE((d / "north.key").stat().st_mode) == 0o600
