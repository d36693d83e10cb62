"""Certificates: the cohort PKI for mutual TLS 1.3, and the emulated device identity.

Cohort PKI: one cohort CA (P-384, ecdsa-with-SHA384) signs a leaf per member (orchestrator,
data holders, host). Every TLS connection in a cohort is mutually authenticated against that
CA and the peer is named by its certificate CN. `CohortPki.create` makes every key itself
and discards the CA key after it, on purpose: nobody can mint a new member afterwards. A
running cohort uses `CohortCa` instead: each member makes its own key (`member_csr`) and the
CA, held only in the launcher's memory, signs the request.

Device identity: the emulated GPU's signing key and its certificate chain, rooted in an
emulated vendor root that says plainly it is not NVIDIA's. The real H100 chain has five
certificates (spec section 4); this one has two for now, built with the same `_issue`
helper so more levels slot in between.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gputravel.errors import BadInput, ProtocolError

__all__ = [
    "CohortCa",
    "CohortPki",
    "DeviceIdentity",
    "MemberIdentity",
    "install_member_cert",
    "make_device_identity",
    "member_csr",
    "own_key_request",
    "peer_name",
    "requested_key",
]

CA_FILE = "ca.pem"
_NAME_RE = re.compile(r"[a-z0-9-]{1,32}")
_SERIAL_RE = re.compile(r"[A-Za-z0-9-]{1,64}")
# "ca" would be written to ca.pem and clobber the cohort CA certificate.
_RESERVED_NAMES = frozenset({"ca"})
# Certificates start a little in the past so peers with slightly skewed clocks accept them.
_CLOCK_SKEW = timedelta(minutes=5)
DEVICE_VALID_DAYS = 3650
VENDOR_ROOT_CN = "EMULATED GPU vendor root (not NVIDIA)"
_EMULATION_ORG = "gputravel emulation"


# ----------------------------------------------------------------------------- helpers
def _check_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name in _RESERVED_NAMES:
        raise BadInput(
            f"member name {name!r} is invalid: use 1-32 characters from a-z, 0-9 and '-' "
            f"(and not {', '.join(sorted(_RESERVED_NAMES))})"
        )
    return name


def _now(now: datetime | None) -> datetime:
    if now is None:
        return datetime.now(timezone.utc)
    if now.tzinfo is None:
        raise BadInput("now must be timezone-aware (e.g. datetime.now(timezone.utc))")
    return now


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP384R1())


def _name(common_name: str, *extra: x509.NameAttribute) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, _EMULATION_ORG), *extra,
         x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def _issue(
    *,
    subject: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    not_before: datetime,
    days: int,
    is_ca: bool,
    extensions: Iterable[tuple[x509.ExtensionType, bool]] = (),
) -> x509.Certificate:
    """One P-384 certificate signed with ecdsa-with-SHA384 (self-signed if issuer == subject)."""
    if is_ca:
        usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
    else:
        usage = x509.KeyUsage(True, False, False, False, False, False, False, False, False)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before - _CLOCK_SKEW)
        .not_valid_after(not_before + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
        )
    )
    for ext, critical in extensions:
        builder = builder.add_extension(ext, critical=critical)
    return builder.sign(issuer_key, hashes.SHA384())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write_private(path: Path, data: bytes) -> None:
    # Created 0600 from the start (no window where the key is world-readable); fchmod
    # as well in case the file already existed with a looser mode.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- cohort
@dataclass(frozen=True)
class MemberIdentity:
    """One cohort member's certificate and private key (the key never shows in repr)."""

    name: str
    cert_pem: bytes
    key_pem: bytes = field(repr=False)


class CohortPki:
    """The cohort CA certificate plus the member identities found in one directory."""

    def __init__(self, directory: Path, ca_pem: bytes, members: Mapping[str, MemberIdentity]) -> None:
        self._directory = Path(directory)
        self._ca_pem = ca_pem
        self._members = dict(members)

    def __repr__(self) -> str:
        return f"CohortPki(directory={str(self._directory)!r}, members={self.names!r})"

    @property
    def directory(self) -> Path:
        return self._directory

    @property
    def ca_pem(self) -> bytes:
        return self._ca_pem

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._members))

    @classmethod
    def create(
        cls,
        directory: Path,
        members: Iterable[str],
        *,
        now: datetime | None = None,
        valid_days: int = 30,
    ) -> CohortPki:
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
        start = _now(now)
        ca_key = _new_key()
        ca_name = _name("gputravel cohort CA")
        ca_cert = _issue(
            subject=ca_name, public_key=ca_key.public_key(), issuer=ca_name, issuer_key=ca_key,
            not_before=start, days=valid_days, is_ca=True,
        )
        identities = {n: _member(n, ca_name, ca_key, start, valid_days) for n in names}
        directory.mkdir(parents=True, exist_ok=True)
        for ident in identities.values():
            (directory / f"{ident.name}.pem").write_bytes(ident.cert_pem)
            _write_private(directory / f"{ident.name}.key", ident.key_pem)
        # ca.pem last: its presence marks a complete cohort directory.
        (directory / CA_FILE).write_bytes(_cert_pem(ca_cert))
        return cls(directory, _cert_pem(ca_cert), identities)

    @classmethod
    def load(cls, directory: Path) -> CohortPki:
        """Read a cohort directory. Members whose .key is absent are skipped: a deployed
        member typically holds only ca.pem and its own certificate and key."""
        directory = Path(directory)
        try:
            ca_pem = (directory / CA_FILE).read_bytes()
            ca_cert = x509.load_pem_x509_certificate(ca_pem)
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
            _check_member(ident, ca_cert)
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
        ctx.load_verify_locations(cadata=self._ca_pem.decode("ascii"))
        # ssl wants paths; the files are the ones create()/load() wrote or read.
        ctx.load_cert_chain(self._directory / f"{name}.pem", self._directory / f"{name}.key")
        return ctx


def _member(
    name: str, ca_name: x509.Name, ca_key: ec.EllipticCurvePrivateKey, start: datetime, days: int
) -> MemberIdentity:
    key = _new_key()
    cert = _leaf(name, key.public_key(), ca_name, ca_key, start, days)
    return MemberIdentity(name, _cert_pem(cert), _key_pem(key))


def _leaf(name: str, public_key: ec.EllipticCurvePublicKey, ca_name: x509.Name,
          ca_key: ec.EllipticCurvePrivateKey, start: datetime, days: int) -> x509.Certificate:
    return _issue(
        subject=_name(name), public_key=public_key, issuer=ca_name, issuer_key=ca_key,
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
        self._start, self._days = _now(now), valid_days
        self._key = _new_key()
        self._name = _name("gputravel cohort CA")
        self.cert_pem = _cert_pem(_issue(
            subject=self._name, public_key=self._key.public_key(), issuer=self._name, issuer_key=self._key,
            not_before=self._start, days=valid_days, is_ca=True,
        ))

    def __repr__(self) -> str:  # the key never shows
        return "CohortCa()"

    def issue(self, name: str, csr_pem: bytes) -> bytes:
        """The certificate of member `name` for the P-384 key that signed `csr_pem`."""
        key = requested_key(csr_pem, _check_name(name), f"member {name!r}")
        return _cert_pem(_leaf(name, key, self._name, self._key, self._start, self._days))


def requested_key(csr_pem: bytes, common_name: str, who: str) -> ec.EllipticCurvePublicKey:
    """Run by the issuer: the P-384 key that self-signed `csr_pem`, a request that names
    `common_name` (BadInput otherwise; `who` names the requester in the message)."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError:
        raise BadInput(f"{who}: the certificate request is not PEM") from None
    key = csr.public_key()
    if not csr.is_signature_valid or not isinstance(key, ec.EllipticCurvePublicKey) \
            or not isinstance(key.curve, ec.SECP384R1):
        raise BadInput(f"{who}: the request is not self-signed by a P-384 key")
    cns = [a.value for a in csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if cns != [common_name]:
        raise BadInput(f"{who}: the request names {cns!r}")
    return key


def own_key_request(path: Path, common_name: str) -> bytes:
    """Run by the party itself: its key at `path`, made there (0600) or, after a restart,
    the one it made before; and a request to certify it for `common_name` (public material
    only: the private key never leaves the party)."""
    path = Path(path)
    if path.exists():
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise BadInput(f"{path} is not an EC private key")
    else:
        key = _new_key()
        _write_private(path, _key_pem(key))
    csr = x509.CertificateSigningRequestBuilder().subject_name(_name(common_name)).sign(key, hashes.SHA384())
    return csr.public_bytes(serialization.Encoding.PEM)


def member_csr(directory: Path, name: str) -> bytes:
    """Run by the member itself: its key, made in its own directory (0600) or, after a
    restart, the one it made before; and a request to certify it (public material only)."""
    return own_key_request(Path(directory) / f"{_check_name(name)}.key", name)


def install_member_cert(directory: Path, name: str, cert_pem: bytes, ca_pem: bytes) -> None:
    """Store what the CA sent back next to the key, so that `CohortPki.load` finds a member."""
    directory = Path(directory)
    (directory / f"{_check_name(name)}.pem").write_bytes(cert_pem)
    (directory / CA_FILE).write_bytes(ca_pem)  # last: its presence marks a complete directory


def _check_member(ident: MemberIdentity, ca_cert: x509.Certificate) -> None:
    """A loaded member must be issued by this CA and its key must match its certificate."""
    try:
        cert = x509.load_pem_x509_certificate(ident.cert_pem)
        key = serialization.load_pem_private_key(ident.key_pem, password=None)
    except (ValueError, TypeError):
        raise BadInput(f"member {ident.name!r}: certificate or key is not readable PEM") from None
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        raise BadInput(f"member {ident.name!r}: certificate is not issued by this cohort CA") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise BadInput(f"member {ident.name!r}: key is not an EC private key")
    if key.public_key().public_numbers() != cert.public_key().public_numbers():
        raise BadInput(f"member {ident.name!r}: private key does not match its certificate")


def peer_name(ssl_socket: ssl.SSLSocket | ssl.SSLObject) -> str:
    """The CN of the peer's verified certificate (contexts above require one)."""
    der = ssl_socket.getpeercert(binary_form=True)
    if not der:
        raise ProtocolError("peer presented no certificate")
    names = x509.load_der_x509_certificate(der).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(names) != 1:
        raise ProtocolError("peer certificate has no single common name")
    return str(names[0].value)


# ----------------------------------------------------------------------------- device
@dataclass(frozen=True)
class DeviceIdentity:
    """The emulated GPU's identity key and certificate chain (leaf first, root last)."""

    private_key: ec.EllipticCurvePrivateKey = field(repr=False)
    chain_der: tuple[bytes, ...]

    @property
    def root_der(self) -> bytes:
        return self.chain_der[-1]


def make_device_identity(*, serial: str = "GPU-EMU-0", now: datetime | None = None) -> DeviceIdentity:
    """An emulated vendor root signing one device certificate for `serial`."""
    if not isinstance(serial, str) or not _SERIAL_RE.fullmatch(serial):
        raise BadInput("serial must be 1-64 characters from A-Z, a-z, 0-9 and '-'")
    start = _now(now)
    root_key = _new_key()
    root_name = _name(VENDOR_ROOT_CN)
    root = _issue(
        subject=root_name, public_key=root_key.public_key(), issuer=root_name, issuer_key=root_key,
        not_before=start, days=DEVICE_VALID_DAYS, is_ca=True,
    )
    device_key = _new_key()
    device = _issue(
        subject=_name(f"EMULATED GPU {serial}", x509.NameAttribute(NameOID.SERIAL_NUMBER, serial)),
        public_key=device_key.public_key(), issuer=root_name, issuer_key=root_key,
        not_before=start, days=DEVICE_VALID_DAYS, is_ca=False,
    )
    der = serialization.Encoding.DER
    return DeviceIdentity(device_key, (device.public_bytes(der), root.public_bytes(der)))
