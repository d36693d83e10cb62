"""Files sealed with a key from the key broker (checkpoints, the model until its release):
AES-256-GCM under a random 96-bit nonce, with a header (format, purpose, job digest) as the
associated data, so a blob opens only with the key of the same measurement, job and purpose.
"""

from __future__ import annotations

import os

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gputravel.broker.machine import KEY_BYTES, PURPOSES
from gputravel.errors import BadInput, ProtocolError, SealedError
from gputravel.protocol.codec import Message, decode, encode

__all__ = ["SEALED_FORMAT", "SealedBlob", "SealedHeader", "Sealer", "is_sealed"]

SEALED_FORMAT = "gputravel-sealed-v1"
NONCE_BYTES = 12
JOB_DIGEST_BYTES = 48
MAX_PLAINTEXT = 2**31 - 1  # one AES-GCM call of `cryptography` takes at most this


class SealedHeader(Message, tag="broker.sealed_header"):
    format: str
    purpose: str
    job_digest: bytes


class SealedBlob(Message, tag="broker.sealed"):
    header: bytes  # an encoded SealedHeader: authenticated as these very bytes
    nonce: bytes
    ciphertext: bytes


# A sealed checkpoint outgrows a wire frame (codec.MAX_FRAME_BYTES): a decoder of this one type
# reads it, as strictly as the codec (tag, every field, no other).
_BLOB = msgspec.msgpack.Decoder(SealedBlob)
_ENCODER = msgspec.msgpack.Encoder()


def is_sealed(data: bytes) -> bool:
    """Whether `data` is a sealed blob at all (to say "sealed" rather than "corrupt" to a reader without a key)."""
    try:
        _BLOB.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return True


class Sealer:
    """Seals and opens the blobs of one (key, purpose, job): `key` from the broker (broker/client.py)."""

    def __init__(self, key: bytes, purpose: str, job_digest: bytes) -> None:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise BadInput(f"a sealing key is {KEY_BYTES} bytes")
        if purpose not in PURPOSES:
            raise BadInput(f"unknown sealing purpose {purpose!r}: use {' or '.join(PURPOSES)}")
        if not isinstance(job_digest, bytes) or len(job_digest) != JOB_DIGEST_BYTES:
            raise BadInput(f"a job digest is {JOB_DIGEST_BYTES} bytes")
        self._aead = AESGCM(key)
        self.purpose, self.job_digest = purpose, job_digest
        self._header = encode(SealedHeader(SEALED_FORMAT, purpose, job_digest))

    def __repr__(self) -> str:  # never the key
        return f"Sealer(purpose={self.purpose!r}, job={self.job_digest.hex()[:16]}...)"

    def seal(self, plaintext: bytes) -> bytes:
        if len(plaintext) > MAX_PLAINTEXT:
            raise BadInput(f"cannot seal {len(plaintext)} bytes: at most {MAX_PLAINTEXT} in one blob")
        nonce = os.urandom(NONCE_BYTES)
        blob = SealedBlob(self._header, nonce, self._aead.encrypt(nonce, plaintext, self._header))
        return _ENCODER.encode(blob)

    def open(self, data: bytes, what: str = "the sealed file") -> bytes:
        """The plaintext of `data`; SealedError naming why it does not open (never the key)."""
        try:
            blob = _BLOB.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise SealedError(f"{what} is not a sealed file (a plaintext checkpoint, or corrupt): refused") from None
        header = self._header_of(blob, what)
        if header.purpose != self.purpose:
            raise SealedError(f"{what} was sealed for the {header.purpose[:32]!r} key, not {self.purpose!r}")
        if header.job_digest != self.job_digest:
            raise SealedError(f"{what} was sealed for job {header.job_digest.hex()[:16]}..., "
                              f"not this job {self.job_digest.hex()[:16]}...")
        try:
            return self._aead.decrypt(blob.nonce, blob.ciphertext, blob.header)
        except (InvalidTag, ValueError):  # ValueError: a nonce of another size
            raise SealedError(f"{what} does not open: it was sealed for another orchestrator measurement or job, "
                              "or it is corrupt") from None

    @staticmethod
    def _header_of(blob: SealedBlob, what: str) -> SealedHeader:
        try:
            header = decode(blob.header, expect=SealedHeader)
        except ProtocolError:  # a peer's error type; this is a file on our own disk
            raise SealedError(f"{what} has a malformed header: corrupt") from None
        if header.format != SEALED_FORMAT:
            raise SealedError(f"{what} is sealed in format {header.format[:40]!r}, not {SEALED_FORMAT}")
        return header
