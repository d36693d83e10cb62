"""Dataset manifests: a SHA-256 per fixed-size piece; a chunk's digest is the SHA-256 of its
pieces' digests, recomputed by the orchestrator over VRAM after a travel.

Anyone who guesses a chunk can compute its digest, so the public travel log shows
:func:`chunk_mac` instead, keyed with a secret only the holder and the orchestrator have.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from gputravel.errors import BadInput

PIECE_BYTES = 1 << 20
LOG_KEY_BYTES = 32  # a holder's travel-log key (HMAC-SHA256)
JOB_BYTES = 16  # a job's random id, which its travel log names (orchestrator/audit)
_MAC_LABEL = b"gputravel/travel-log/chunk-mac/v2\x00"  # v2: the job is bound too
_NAME_LEN, _WHERE = struct.Struct(">H"), struct.Struct(">QQH")


def piece_digests(data: memoryview | bytes, piece_bytes: int = PIECE_BYTES) -> tuple[bytes, ...]:
    view = memoryview(data)
    return tuple(hashlib.sha256(view[i : i + piece_bytes]).digest() for i in range(0, len(view), piece_bytes))


def chunk_digest_from_manifest(manifest: tuple[bytes, ...], offset: int, nbytes: int, piece_bytes: int) -> bytes:
    if offset % piece_bytes or nbytes <= 0:
        raise BadInput("chunks start on a piece boundary and are not empty")
    first = offset // piece_bytes
    last = -(-(offset + nbytes) // piece_bytes)
    if last > len(manifest):
        raise BadInput("chunk reaches past the end of the dataset")
    return hashlib.sha256(b"".join(manifest[first:last])).digest()


def chunk_digest(data: memoryview | bytes, piece_bytes: int = PIECE_BYTES) -> bytes:
    """Digest of a chunk computed from its bytes (what the orchestrator does over VRAM)."""
    return hashlib.sha256(b"".join(piece_digests(data, piece_bytes))).digest()


def chunk_nbytes(holder: str, dataset_bytes: int, piece_bytes: int, dataset_offset: int, buffer_bytes: int,
                 held_base: int = 0) -> int:
    """How many bytes a chunk at ``dataset_offset`` holds; it may start at any piece boundary
    (training resumes mid-dataset), so its digest is checkable from the manifest. ``held_base``:
    where a holder's held-out records start (0: none); a chunk ends there, never mixing the two."""
    if dataset_bytes == 0:
        raise BadInput(f"holder {holder!r} has an empty dataset: nothing to copy")
    if dataset_offset % piece_bytes or not 0 <= dataset_offset < dataset_bytes:
        raise BadInput(f"dataset offset {dataset_offset} is not a chunk start of holder {holder!r}: chunks start "
                       f"on a {piece_bytes}-byte piece boundary inside its {dataset_bytes}-byte dataset")
    end = held_base if 0 < held_base and dataset_offset < held_base else dataset_bytes
    return min(buffer_bytes, end - dataset_offset)


def chunk_mac(key: bytes, job: bytes, holder: str, dataset_offset: int, nbytes: int, digest: bytes) -> bytes:
    """HMAC-SHA256 under the holder's travel-log key of the chunk's digest, job and place: the
    place binds so equal contents at two offsets do not show equal MACs; the job, so two jobs'
    logs do not show which chunks stayed the same. The key never appears in an error."""
    if not isinstance(key, bytes) or len(key) != LOG_KEY_BYTES:
        raise BadInput(f"a holder's travel-log key is {LOG_KEY_BYTES} bytes")
    if not isinstance(digest, bytes) or not 0 < len(digest) <= 64:
        raise BadInput("a chunk digest is 1-64 bytes")
    if not isinstance(job, bytes) or len(job) != JOB_BYTES:
        raise BadInput(f"a job id is {JOB_BYTES} bytes")
    name = holder.encode("utf-8")
    try:
        message = _MAC_LABEL + job + _NAME_LEN.pack(len(name)) + name + _WHERE.pack(dataset_offset, nbytes, len(digest))
    except struct.error:
        raise BadInput("a chunk's holder name, offset or size is out of range") from None
    return hmac.new(key, message + digest, hashlib.sha256).digest()
