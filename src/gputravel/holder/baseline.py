"""The data holder's side of the centralised TLS baseline (paper 7.2): a chunk asked for
(`SendChunk`) goes over the attested TLS link in ChunkPiece frames, then `ChunkSent`, or
`ChunkRefused` (orchestrator/baseline.py is the other side)."""

from __future__ import annotations

import time

from gputravel.protocol.hardware import EMULATED, HardwareProfile, hardware_profile, hold_until
from gputravel.protocol.travel import ChunkPiece, ChunkRefused, ChunkSent, SendChunk
from gputravel.transport.base import Transport

#: Bytes per ChunkPiece frame: the receiver reuses one buffer (up to 1 MiB), and reading, sending
#: and receiving overlap (8 MiB took 65 ms in 4 MiB frames, 25 ms in 256 KiB ones).
PIECE_BYTES = 256 << 10


def refusal(req: SendChunk, dataset_bytes: int, piece_bytes: int, held_base: int = 0) -> str | None:
    """Why a holder will not serve ``req``, or None; ``held_base``: where its held-out records start."""
    if req.nbytes <= 0:
        return f"a chunk must not be empty (asked for {req.nbytes} bytes)"
    if req.dataset_offset % piece_bytes or not 0 <= req.dataset_offset < dataset_bytes:
        return f"dataset offset {req.dataset_offset} is not a {piece_bytes}-byte piece boundary inside the dataset"
    if req.dataset_offset + req.nbytes > dataset_bytes:
        return f"{req.nbytes} bytes at {req.dataset_offset} reach past the end of the {dataset_bytes}-byte dataset"
    if 0 < held_base and req.dataset_offset < held_base < req.dataset_offset + req.nbytes:
        return f"{req.nbytes} bytes at {req.dataset_offset} mix training and held-out records (from byte {held_base})"
    return None


def send_chunk(dataset: memoryview, piece_bytes: int, conn: Transport, req: SendChunk,
               profile: HardwareProfile = hardware_profile(EMULATED), held_base: int = 0) -> None:
    """Serve one SendChunk piece by piece. A hardware profile's read rate is held against one
    deadline for the whole chunk, so the sleeps' overshoots do not add up."""
    reason = refusal(req, len(dataset), piece_bytes, held_base)
    if reason is not None:
        conn.send(ChunkRefused(req.travel_id, reason))
        return
    read_ns = 0
    began = time.perf_counter()
    for start in range(0, req.nbytes, PIECE_BYTES):
        t0 = time.perf_counter_ns()
        lo = req.dataset_offset + start
        data = bytes(dataset[lo : lo + min(PIECE_BYTES, req.nbytes - start)])
        hold_until(began, profile.read_s(start + len(data)))
        read_ns += time.perf_counter_ns() - t0
        conn.send(ChunkPiece(req.travel_id, start, data))
    conn.send(ChunkSent(req.travel_id, req.nbytes, read_ns))
