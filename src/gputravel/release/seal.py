"""The release file: the model encrypted once under a random AES-256-GCM data key, that key sealed to
each recipient with HPKE (RFC 9180: X25519, HKDF-SHA256, AES-256-GCM; info: the statement's digest),
next to the statement and the signatures that let it out. Only after a quorum of holders signed."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence

import msgspec
from cryptography import x509
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hpke, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gputravel.errors import BadInput, IntegrityError, ProtocolError
from gputravel.protocol.codec import MAX_FRAME_BYTES, Message, decode, encode
from gputravel.release.keys import raw_public
from gputravel.release.statement import (Anchors, ReleaseSignature, ReleaseStatement, check_signatures,
                                         require_quorum)

SUITE = hpke.Suite(hpke.KEM.X25519, hpke.KDF.HKDF_SHA256, hpke.AEAD.AES_256_GCM)
DATA_KEY_BYTES, NONCE_BYTES = 32, 12
MAX_MODEL_BYTES = 2**31 - 1  # one AES-GCM call's limit in cryptography
MAX_RELEASE_BYTES = 2**31 + (1 << 20)  # the model, the tag and a header of statement, keys, certificates
_MODEL_AAD = b"gputravel/release/model/v1\x00"  # the model's ciphertext is bound to its statement


class NotARecipient(BadInput):
    """The key opening a release is none of the recipients' the holders approved."""


class SealedKey(Message, tag="release.sealed-key", secret=("enc",)):
    recipient: str
    enc: bytes  # HPKE's encapsulated key and the sealed data key


class ReleaseFile(Message, tag="release.file"):
    statement: ReleaseStatement
    quorum: int
    signatures: tuple[ReleaseSignature, ...]  # those that counted, one per signer
    certificates: dict[str, bytes]  # each signer's cohort certificate (DER): a recipient may check them
    sealed: tuple[SealedKey, ...]  # one per recipient, in the statement's order
    nonce: bytes
    ciphertext: bytes

    def __post_init__(self) -> None:
        if tuple(s.recipient for s in self.sealed) != self.statement.recipient_names:
            raise BadInput("a release seals the data key to exactly its statement's recipients")
        if len(self.nonce) != NONCE_BYTES:
            raise BadInput(f"a release's nonce is {NONCE_BYTES} bytes")

    @property
    def signers(self) -> tuple[str, ...]:
        return tuple(s.holder for s in self.signatures)

    def counted(self, ca_cert_der: Anchors) -> list[str]:
        """The signers whose signature verifies under the certificate stored, issued by this CA."""
        return check_signatures(self.statement, self.signatures, self.certificates, self.certificates, ca_cert_der)


def check_approved(release: ReleaseFile, job_digest: bytes, recipients: Mapping[str, bytes], holders: Sequence[str],
                   named: Mapping[str, str], quorum: int) -> list[str]:
    """The holders whose signatures count for a recipient who knows the approved job (its digest,
    recipients, signers, their certificates' SHA-384 and quorum): the file's own certificates and
    quorum count for nothing. BadInput saying what differs, or how few verify."""
    s = release.statement
    if s.job_digest != job_digest:
        raise BadInput(f"the release is of job {s.job_digest.hex()[:16]}..., not of the approved job "
                       f"({job_digest.hex()[:16]}...)")
    if dict(s.recipients) != dict(recipients):
        raise BadInput("the release's recipients are not the approved job's")
    if not named:
        raise BadInput("the approved job names no holder's certificate: check the release under the cohort CA instead")
    matched = {h: der for h, der in release.certificates.items()
               if h in named and hashlib.sha384(der).hexdigest() == named[h]}
    counted = check_signatures(s, release.signatures, holders, matched, tuple(matched.values())) if matched else []
    if len(counted) < quorum:
        raise BadInput(f"only {len(counted)} of the release's signatures ({', '.join(counted) or 'none'}) verify "
                       f"under the certificates the approved job names: below its quorum of {quorum}")
    return counted


def seal_release(model_bytes: bytes, statement: ReleaseStatement, signatures: Iterable[ReleaseSignature],
                 quorum: int, *, holders: Iterable[str], certificates: Mapping[str, bytes],
                 ca_cert_der: Anchors) -> bytes:
    """The release file for `model_bytes` (the state_dict file as torch.save wrote it), or
    ReleaseRefused with fewer than `quorum` valid signatures of distinct holders in `holders`."""
    if not isinstance(statement, ReleaseStatement):
        raise BadInput(f"a release needs a ReleaseStatement, got {type(statement).__name__}")
    model_bytes = bytes(model_bytes)
    if hashlib.sha384(model_bytes).digest() != statement.model_sha384:
        raise BadInput("the model to seal is not the one the release statement names (its SHA-384 differs)")
    if len(model_bytes) > MAX_MODEL_BYTES:
        raise BadInput(f"a model of {len(model_bytes):,} bytes is above the {MAX_MODEL_BYTES:,} one release holds")
    counted = require_quorum(statement, signatures, quorum, holders, certificates, ca_cert_der)
    digest = statement.digest()
    data_key, nonce = AESGCM.generate_key(bit_length=256), os.urandom(NONCE_BYTES)
    ciphertext = AESGCM(data_key).encrypt(nonce, model_bytes, _MODEL_AAD + digest)
    sealed = tuple(SealedKey(name, SUITE.encrypt(data_key, X25519PublicKey.from_public_bytes(key), info=digest))
                   for name, key in statement.recipients)
    return encode(ReleaseFile(statement=statement, quorum=quorum, signatures=counted,
                              certificates={s.holder: bytes(certificates[s.holder]) for s in counted}, sealed=sealed,
                              nonce=nonce, ciphertext=ciphertext))


_LARGE = msgspec.msgpack.Decoder(ReleaseFile)


def read_release(blob: bytes) -> ReleaseFile:
    """The release file's parts, not yet opened; ProtocolError for anything else."""
    if len(blob) > MAX_RELEASE_BYTES:
        raise ProtocolError(f"a release of {len(blob):,} bytes is above the {MAX_RELEASE_BYTES:,} one may be")
    if len(blob) <= MAX_FRAME_BYTES:
        return decode(blob, expect=ReleaseFile)
    try:  # a model above one wire frame: the same strict schema, read by msgspec directly
        return _LARGE.decode(blob)
    except Exception:  # malformed, or an invariant refused, whatever raised it: never quoting a value
        raise ProtocolError("not a gputravel release file (malformed, or another message)") from None


def open_release(blob: bytes, private_key: X25519PrivateKey) -> tuple[ReleaseStatement, bytes]:
    """(statement, model bytes) for a recipient's key; NotARecipient for any other key, IntegrityError
    if the file was altered, or the model is not the one its statement names."""
    if not isinstance(private_key, X25519PrivateKey):
        raise BadInput("a release is opened with a recipient's X25519 private key (gputravel model keygen)")
    release = read_release(blob)
    statement, own = release.statement, raw_public(private_key)
    names = [name for name, key in statement.recipients if key == own]
    if not names:
        raise NotARecipient("this release is not sealed to that key: it is none of the recipients' the holders "
                            f"signed for ({', '.join(statement.recipient_names)})")
    digest = statement.digest()
    sealed = next(s for s in release.sealed if s.recipient == names[0])
    try:
        data_key = SUITE.decrypt(sealed.enc, private_key, info=digest)
        model = AESGCM(data_key).decrypt(release.nonce, release.ciphertext, _MODEL_AAD + digest)
    except (InvalidTag, ValueError):
        raise IntegrityError("the release does not open: its sealed key or model was altered") from None
    if hashlib.sha384(model).digest() != statement.model_sha384:
        raise IntegrityError("the released model is not the one its statement names")
    return statement, model


def anchors(pem: bytes) -> tuple[bytes, ...]:
    """Every certificate of a ca.pem (the cohort CA, or a deployment's pinned certificates), as DER."""
    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError:
        raise BadInput("the trust anchors are not PEM certificates") from None
    return tuple(c.public_bytes(serialization.Encoding.DER) for c in certs)


def ca_der(pem_or_der: bytes) -> bytes:
    """The cohort CA certificate as DER, from its ca.pem or DER bytes."""
    try:
        cert = (x509.load_pem_x509_certificate(pem_or_der) if pem_or_der.lstrip().startswith(b"-----")
                else x509.load_der_x509_certificate(pem_or_der))
    except ValueError:
        raise BadInput("the cohort CA certificate is neither PEM nor DER") from None
    return cert.public_bytes(serialization.Encoding.DER)
