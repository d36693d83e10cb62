"""Dataset manifests: a SHA-256 per fixed-size piece, so any piece-aligned chunk has a digest.

A holder computes its manifest once, when it loads its dataset; a chunk's digest is the
SHA-256 over the digests of its pieces. The orchestrator recomputes it over what the device
holds after a travel and compares.
"""

from __future__ import annotations

import hashlib

from gputravel.errors import BadInput

PIECE_BYTES = 1 << 20


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


def chunk_nbytes(holder: str, dataset_bytes: int, piece_bytes: int, dataset_offset: int, buffer_bytes: int) -> int:
    """How many bytes a chunk starting at ``dataset_offset`` holds: a travel's or a baseline
    transfer's. A chunk may start at any manifest piece boundary inside the dataset (training
    resumes mid-dataset), so its digest is checkable from the manifest."""
    if dataset_bytes == 0:
        raise BadInput(f"holder {holder!r} has an empty dataset: nothing to copy")
    if dataset_offset % piece_bytes or not 0 <= dataset_offset < dataset_bytes:
        raise BadInput(f"dataset offset {dataset_offset} is not a chunk start of holder {holder!r}: chunks start "
                       f"on a {piece_bytes}-byte piece boundary inside its {dataset_bytes}-byte dataset")
    return min(buffer_bytes, dataset_bytes - dataset_offset)
