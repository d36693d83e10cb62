"""The cohort PKI for mutual TLS 1.3: one cohort CA signs a leaf per member, and every peer is
named by its certificate's CN. `CohortPki.create` drops the CA key once done, so nobody can mint
a member later; a running cohort's `CohortCa` lives only in the launcher's memory and signs the
members' own keys' requests (`member_csr`). Deployed services pin self-signed peers instead.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gputravel.crypto.certs import (
    cert_pem,
    issue_certificate,
    key_matches,
    key_pem,
    load_key,
    new_key,
    own_key_request,
    requested_key,
    self_signed_ca,
    subject_name,
    utc_now,
    write_private,
)
from gputravel.errors import BadInput, ProtocolError
from gputravel.files import atomic_write_bytes, read_plain

CA_FILE = "ca.pem"
MAX_PEM_BYTES = 64 << 10  # a member's certificate is about 1 KiB
MEMBER_NAME = re.compile(r"[a-z0-9-]{1,32}")  # a member's name: its files, certificate and peers are keyed by it
# "ca" would be written to ca.pem and clobber the cohort CA certificate.
_RESERVED_NAMES = frozenset({"ca"})


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not MEMBER_NAME.fullmatch(name) or name in _RESERVED_NAMES:
        raise BadInput(
            f"member name {name!r} is invalid: use 1-32 characters from a-z, 0-9 and '-' "
            f"(and not {', '.join(sorted(_RESERVED_NAMES))})"
        )
    return name


# ----------------------------------------------------------------------------- cohort
@dataclass(frozen=True)
class MemberIdentity:
    """One cohort member's certificate and private key (the key never shows in repr)."""

    name: str
    cert_pem: bytes
    key_pem: bytes = field(repr=False)


@dataclass(frozen=True, eq=False)
class CohortPki:
    """The cohort CA certificate plus the member identities found in one directory."""

    directory: Path
    ca_pem: bytes = field(repr=False)
    _members: Mapping[str, MemberIdentity] = field(repr=False)

    def __repr__(self) -> str:
        return f"CohortPki(directory={str(self.directory)!r}, members={self.names!r})"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._members))

    @classmethod
    def create(cls, directory: Path, members: Iterable[str], *, now: datetime | None = None,
               valid_days: int = 30) -> CohortPki:
        """Make a cohort CA and one leaf per member; write ca.pem, <name>.pem, <name>.key."""
        names = [_check_name(n) for n in members]
        if not names:
            raise BadInput("a cohort needs at least one member")
        if len(set(names)) != len(names):
            raise BadInput("member names must be unique")
        if not isinstance(valid_days, int) or valid_days < 1:
            raise BadInput("valid_days must be a positive integer")
        directory = Path(directory)
        if (directory / CA_FILE).exists():
            raise BadInput(f"{directory} already holds a cohort PKI; load it or use an empty directory")
        ca = CohortCa(now=now, valid_days=valid_days)  # dropped on return: no member can be added later
        identities = {n: ca.member(n) for n in names}
        directory.mkdir(parents=True, exist_ok=True)
        for ident in identities.values():
            (directory / f"{ident.name}.pem").write_bytes(ident.cert_pem)
            write_private(directory / f"{ident.name}.key", ident.key_pem)
        # ca.pem last: its presence marks a complete cohort directory.
        (directory / CA_FILE).write_bytes(ca.cert_pem)
        return cls(directory, ca.cert_pem, identities)

    @classmethod
    def load(cls, directory: str | Path) -> CohortPki:
        """Read a cohort directory; members without a .key (others', when deployed) are skipped."""
        directory = Path(directory)
        try:
            ca_pem = (directory / CA_FILE).read_bytes()
            # One cohort CA, or (a deployed party: service/) the self-signed certificates of the
            # peers it pinned: every certificate in the file is a trust anchor.
            anchors = x509.load_pem_x509_certificates(ca_pem)
        except (OSError, ValueError):
            raise BadInput(f"{directory / CA_FILE} is missing or not a PEM certificate") from None
        members: dict[str, MemberIdentity] = {}
        for cert_path in sorted(directory.glob("*.pem")):
            name = cert_path.stem
            key_path = directory / f"{name}.key"
            if cert_path.name == CA_FILE or not key_path.exists():
                continue
            _check_name(name)
            ident = MemberIdentity(name, cert_path.read_bytes(), key_path.read_bytes())
            _check_member(ident, anchors)
            members[name] = ident
        return cls(directory, ca_pem, members)

    def member(self, name: str) -> MemberIdentity:
        try:
            return self._members[name]
        except (KeyError, TypeError):
            raise BadInput(f"unknown cohort member {name!r}; known: {', '.join(self.names) or '(none)'}") from None

    def server_context(self, name: str) -> ssl.SSLContext:
        """TLS 1.3 server side for member `name`: clients must present a cohort certificate."""
        return self._context(ssl.PROTOCOL_TLS_SERVER, name)

    def client_context(self, name: str) -> ssl.SSLContext:
        """TLS 1.3 client side for member `name`; wrap with server_hostname=<peer name>."""
        ctx = self._context(ssl.PROTOCOL_TLS_CLIENT, name)
        ctx.check_hostname = True  # the peer's SAN must equal the member name we dial
        return ctx

    def _context(self, protocol: int, name: str) -> ssl.SSLContext:
        self.member(name)  # BadInput for unknown names, before touching files
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.maximum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED  # mutual authentication on both sides
        ctx.load_verify_locations(cadata=self.ca_pem.decode("ascii"))
        # ssl wants paths; the files are the ones create()/load() wrote or read.
        ctx.load_cert_chain(self.directory / f"{name}.pem", self.directory / f"{name}.key")
        return ctx


def _leaf(name: str, public_key: ec.EllipticCurvePublicKey, ca_name: x509.Name,
          ca_key: ec.EllipticCurvePrivateKey, start: datetime, days: int) -> x509.Certificate:
    return issue_certificate(
        subject=subject_name(name), public_key=public_key, issuer=ca_name, issuer_key=ca_key,
        not_before=start, days=days, is_ca=False,
        extensions=[
            (x509.SubjectAlternativeName([x509.DNSName(name)]), False),
            (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), False),
        ],
    )


# ----------------------------------------------------------------------------- enrolment
class CohortCa:
    """A running launcher's cohort CA. Its key lives in this object only, never on disk:
    members make their own keys (`member_csr`) and the CA signs their requests."""

    def __init__(self, *, now: datetime | None = None, valid_days: int = 30) -> None:
        self._start, self._days = utc_now(now), valid_days
        self._key, cert = self_signed_ca("gputravel cohort CA", self._start, valid_days)
        self._name = cert.subject
        self.cert_pem = cert_pem(cert)

    def __repr__(self) -> str:  # the key never shows
        return "CohortCa()"

    def issue(self, name: str, csr_pem: bytes) -> bytes:
        """The certificate of member `name` for the P-384 key that signed `csr_pem`."""
        key = requested_key(csr_pem, _check_name(name), f"member {name!r}")
        return self._certify(name, key)

    def member(self, name: str) -> MemberIdentity:
        """A member whose key this CA makes too (`CohortPki.create`)."""
        key = new_key()
        return MemberIdentity(name, self._certify(name, key.public_key()), key_pem(key))

    def _certify(self, name: str, public_key: ec.EllipticCurvePublicKey) -> bytes:
        return cert_pem(_leaf(name, public_key, self._name, self._key, self._start, self._days))


def member_csr(directory: Path, name: str) -> bytes:
    """Run by the member itself: its key (made once, 0600) and a request to certify it."""
    return own_key_request(Path(directory) / f"{_check_name(name)}.key", name)


def install_member_cert(directory: Path, name: str, cert_pem: bytes, ca_pem: bytes) -> None:
    """Store what the CA sent back next to the key, so that `CohortPki.load` finds a member."""
    directory = Path(directory)
    (directory / f"{_check_name(name)}.pem").write_bytes(cert_pem)
    (directory / CA_FILE).write_bytes(ca_pem)  # last: its presence marks a complete directory


def _check_member(ident: MemberIdentity, anchors: list[x509.Certificate]) -> None:
    """A loaded member is issued by a trust anchor (the CA, or itself if pinned) and holds its key."""
    try:
        cert = x509.load_pem_x509_certificate(ident.cert_pem)
        key = load_key(ident.key_pem)
    except (ValueError, TypeError):
        raise BadInput(f"member {ident.name!r}: certificate or EC key is not readable PEM") from None
    if not any(_issued_by(cert, anchor) for anchor in anchors):
        raise BadInput(f"member {ident.name!r}: certificate is not issued by this cohort CA") from None
    if not key_matches(cert, key):
        raise BadInput(f"member {ident.name!r}: private key does not match its certificate")


def _issued_by(cert: x509.Certificate, anchor: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(anchor)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


# ----------------------------------------------------------------------------- pinned peers
def self_signed_member(directory: Path, name: str, *, now: datetime | None = None, valid_days: int = 365) -> bytes:
    """Run by a deployed member itself (service/): its key (made once, 0600) and the certificate
    it signs itself, which its peers pin (no CA); PEM. It trusts only itself until `pin_peers`."""
    directory = Path(directory)
    key_path = directory / f"{_check_name(name)}.key"
    own_key_request(key_path, name)  # makes the key once; the request itself is not needed
    key = load_key(key_path.read_bytes())
    cert_path = directory / f"{name}.pem"
    if cert_path.exists() and _same_key(cert_path.read_bytes(), key):
        pem = cert_path.read_bytes()  # a restart keeps its identity: peers pinned this one
    else:
        own = subject_name(name)
        pem = cert_pem(_leaf(name, key.public_key(), own, key, utc_now(now), valid_days))
        cert_path.write_bytes(pem)
    bundle = (directory / CA_FILE).read_bytes() if (directory / CA_FILE).exists() else b""
    if pem not in bundle:  # peers pinned before this member first started, and itself
        (directory / CA_FILE).write_bytes(pem + bundle)
    return pem


def pin_peers(directory: Path, name: str, peers: Iterable[bytes]) -> None:
    """Trust exactly this member's own certificate and the peers' (PEM): the new ca.pem."""
    directory = Path(directory)
    own = read_plain(directory / f"{_check_name(name)}.pem", MAX_PEM_BYTES)  # the member's own directory
    bundle = [own] + [p for p in peers if p != own]
    for pem in bundle:
        try:
            x509.load_pem_x509_certificate(pem)
        except ValueError:
            raise BadInput(f"a pinned certificate for {name!r} is not PEM") from None
    atomic_write_bytes(directory / CA_FILE, b"".join(bundle))  # replaced, never written through a link


def _same_key(cert_pem_bytes: bytes, key: ec.EllipticCurvePrivateKey) -> bool:
    try:
        return key_matches(x509.load_pem_x509_certificate(cert_pem_bytes), key)
    except ValueError:
        return False


def peer_name(ssl_socket: ssl.SSLSocket | ssl.SSLObject) -> str:
    """The CN of the peer's verified certificate (contexts above require one)."""
    der = ssl_socket.getpeercert(binary_form=True)
    if not der:
        raise ProtocolError("peer presented no certificate")
    names = x509.load_der_x509_certificate(der).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(names) != 1:
        raise ProtocolError("peer certificate has no single common name")
    return str(names[0].value)
