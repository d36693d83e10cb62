"""What a holder signs to release the model: exactly (model SHA-384, job digest, recipients), and how
signatures count towards the manifest's quorum. A holder signs with the P-384 key of its TLS
certificate in the cohort PKI; a signature counts only if that certificate is issued by one of the
anchors the orchestrator trusts (the cohort CA, or on the deployed services the holders' pinned
self-signed certificates), which its measurement binds."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gputravel.crypto.certs import load_key
from gputravel.errors import BadInput
from gputravel.protocol.codec import Message, encode
from gputravel.release.keys import PUBLIC_KEY_BYTES, check_recipient

DIGEST_BYTES = 48  # SHA-384: the model's, the job's, the statement's
# Domain separation: a statement's digest and a holder's signature never pass for another use of the key.
_STATEMENT_LABEL = b"gputravel/release/statement/v1\x00"
_SIGNATURE_LABEL = b"gputravel/release/signature/v1\x00"
_ECDSA = ec.ECDSA(hashes.SHA384())


class ReleaseRefused(BadInput):
    """Fewer valid signatures than the manifest's quorum: nothing is sealed to the recipients."""


class ReleaseStatement(Message, tag="release.statement"):
    model_sha384: bytes
    job_digest: bytes  # the job manifest's digest, which the orchestrator's RTMR[3] holds
    recipients: tuple[tuple[str, bytes], ...]  # (name, X25519 public key), sorted by name

    def __post_init__(self) -> None:
        if len(self.model_sha384) != DIGEST_BYTES or len(self.job_digest) != DIGEST_BYTES:
            raise BadInput(f"a release statement names the model and the job by {DIGEST_BYTES}-byte digests")
        if not self.recipients:
            raise BadInput("a release statement names at least one recipient")
        names = [check_recipient(name) for name, _ in self.recipients]
        if names != sorted(set(names)):
            raise BadInput("a release statement's recipients are sorted by name, each once (ReleaseStatement.of)")
        keys = [key for _, key in self.recipients]
        if any(len(k) != PUBLIC_KEY_BYTES for k in keys) or len(set(keys)) != len(keys):
            raise BadInput(f"each recipient has its own {PUBLIC_KEY_BYTES}-byte X25519 public key")

    @classmethod
    def of(cls, model: bytes, job_digest: bytes, recipients: Iterable[tuple[str, bytes]] | Mapping[str, bytes], *,
           model_is_digest: bool = False) -> ReleaseStatement:
        """The statement for `model` (its bytes, or its SHA-384 with `model_is_digest`), recipients sorted."""
        pairs = recipients.items() if isinstance(recipients, Mapping) else recipients
        digest = bytes(model) if model_is_digest else hashlib.sha384(model).digest()
        return cls(digest, bytes(job_digest), tuple(sorted((str(n), bytes(k)) for n, k in pairs)))

    def digest(self) -> bytes:
        """SHA-384 of a label and the canonical encoding: what holders sign and HPKE's info."""
        return hashlib.sha384(_STATEMENT_LABEL + encode(self)).digest()

    @property
    def recipient_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.recipients)


class ReleaseSignature(Message, tag="release.signature"):
    holder: str
    statement: bytes  # the digest of the statement signed
    signature: bytes  # ECDSA P-384 (DER) over the label and that digest

    def __post_init__(self) -> None:
        if len(self.statement) != DIGEST_BYTES:
            raise BadInput(f"a release signature names the statement by its {DIGEST_BYTES}-byte digest")


def _signed(digest: bytes) -> bytes:
    return _SIGNATURE_LABEL + digest


def sign_release(statement: ReleaseStatement, holder_name: str, key: ec.EllipticCurvePrivateKey | bytes) \
        -> ReleaseSignature:
    """Holder `holder_name`'s signature of `statement` with its TLS key (an object or PEM)."""
    if isinstance(key, bytes):
        try:
            key = load_key(key)
        except (ValueError, TypeError):
            raise BadInput(f"holder {holder_name!r}: the signing key is not an unencrypted EC private key PEM") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP384R1):
        raise BadInput(f"holder {holder_name!r}: a release is signed with a P-384 key (its cohort TLS key)")
    digest = statement.digest()
    return ReleaseSignature(holder=holder_name, statement=digest, signature=key.sign(_signed(digest), _ECDSA))


Anchors = bytes | Sequence[bytes]  # one trust anchor's DER, or several (a deployment's pinned certificates)


def _issued(cert: x509.Certificate, anchor: x509.Certificate) -> bool:
    """Is `cert` the pinned `anchor` itself, or issued by an anchor that is a CA? A holder's pinned
    self-signed leaf issues nothing: the review had one holder sign a certificate naming another."""
    if cert == anchor:
        return True
    try:
        is_ca = anchor.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        return False
    try:
        cert.verify_directly_issued_by(anchor)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _holder_key(holder: str, der: bytes | None, anchors: Sequence[x509.Certificate]) -> ec.EllipticCurvePublicKey | str:
    """The holder's P-384 key from its cohort certificate, or why the certificate does not count."""
    if der is None:
        return "no certificate of this holder"
    try:
        cert = x509.load_der_x509_certificate(der)
    except (ValueError, TypeError):
        return "its certificate is not issued by the cohort CA"
    if not any(_issued(cert, a) for a in anchors):
        return "its certificate is not issued by the cohort CA"
    names = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if names != [holder]:
        return "its certificate names another party"
    key = cert.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP384R1):
        return "its certificate's key is not P-384"
    return key


def signature_verdicts(statement: ReleaseStatement, signatures: Iterable[ReleaseSignature],
                       holders: Iterable[str], certificates: Mapping[str, bytes],
                       ca_cert_der: Anchors) -> list[tuple[str, str | None]]:
    """(holder, None) for each signature that counts, (holder, why not) for each that does not;
    `ca_cert_der`: the anchor, or anchors, a holder's certificate must be issued by."""
    ders = [ca_cert_der] if isinstance(ca_cert_der, bytes) else list(ca_cert_der)
    try:
        ca = [x509.load_der_x509_certificate(d) for d in ders]
    except (ValueError, TypeError):
        raise BadInput("the cohort CA certificate is not DER") from None
    if not ca:
        raise BadInput("no trust anchor to count signatures under")
    digest, allowed = statement.digest(), frozenset(holders)
    seen: set[str] = set()  # holders counted so far: a second signature of one holder does not count
    verdicts: list[tuple[str, str | None]] = []
    for sig in signatures:
        if not isinstance(sig, ReleaseSignature):
            raise BadInput(f"a release signature is a ReleaseSignature, got {type(sig).__name__}")
        verdicts.append((sig.holder, _verdict(sig, digest, allowed, seen, certificates, ca)))
    return verdicts


def _verdict(sig: ReleaseSignature, digest: bytes, allowed: frozenset[str], seen: set[str],
             certificates: Mapping[str, bytes], ca: Sequence[x509.Certificate]) -> str | None:
    if sig.holder not in allowed:
        return "not a holder the manifest lets sign"
    if sig.holder in seen:
        return "a second signature of one holder"
    if sig.statement != digest:
        return "over another statement (model, job or recipients)"
    key = _holder_key(sig.holder, certificates.get(sig.holder), ca)
    if isinstance(key, str):
        return key
    try:
        key.verify(sig.signature, _signed(digest), _ECDSA)
    except (InvalidSignature, ValueError):
        return "the signature does not verify under its certificate"
    seen.add(sig.holder)
    return None


def check_signatures(statement: ReleaseStatement, signatures: Iterable[ReleaseSignature], holders: Iterable[str],
                     certificates: Mapping[str, bytes], ca_cert_der: Anchors) -> list[str]:
    """The distinct holders, of those named in `holders`, whose signature of `statement` is valid under
    their cohort certificate (`certificates`: name -> DER, issued by the CA `ca_cert_der`), sorted."""
    return sorted(h for h, why in signature_verdicts(statement, signatures, holders, certificates, ca_cert_der)
                  if why is None)


def require_quorum(statement: ReleaseStatement, signatures: Iterable[ReleaseSignature], quorum: int,
                   holders: Iterable[str], certificates: Mapping[str, bytes],
                   ca_cert_der: Anchors) -> tuple[ReleaseSignature, ...]:
    """The signatures that count, one per signer, if at least `quorum`; else ReleaseRefused naming
    each signature that did not count and why."""
    holders = tuple(holders)
    if type(quorum) is not int or not 1 <= quorum <= len(holders):
        raise BadInput(f"a release quorum is between 1 and the {len(holders)} holders the manifest names, "
                       f"got {quorum!r}")
    signatures = tuple(signatures)
    verdicts = signature_verdicts(statement, signatures, holders, certificates, ca_cert_der)
    counted = sorted((s for s, (_, why) in zip(signatures, verdicts, strict=True) if why is None),
                     key=lambda s: s.holder)
    if len(counted) < quorum:
        refused = "; ".join(f"{h!r}: {why}" for h, why in verdicts if why is not None)
        raise ReleaseRefused(f"release short of quorum: {len(counted)} of {quorum} signatures"
                             + (f" (not counted: {refused})" if refused else ""))
    return tuple(counted)
