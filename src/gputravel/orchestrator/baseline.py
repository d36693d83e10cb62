"""The centralised TLS baseline (paper 7.2): what confidential training does without travelling.

The data holder sends its chunk over its TLS connection to the orchestrator (the same
connection, on the same link, that carries a travel's context blobs), and the orchestrator
writes it into the GPU's dataset buffer through its own encrypted channel: the same pipelined
copy through bounce buffers that a holder uses during a travel. The orchestrator then checks
the digest of what the device holds against the holder's manifest, as after a travel.

Three steps are timed, as the paper breaks the baseline down:

* ``read``: the holder reading its chunk out of its dataset (summed over the pieces);
* ``tls``: the transfer, from the request leaving the orchestrator to the last piece having
  arrived, less the holder's reading;
* ``gpu_write``: the orchestrator's encrypted copy into VRAM.

The chunk crosses in pieces of :data:`PIECE_BYTES` (one frame each, far under the stream
transport's 64 MiB frame limit), into a staging buffer the orchestrator allocates once.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gputravel.errors import BadInput, GputravelError, HolderLost, ProtocolError, RemoteError
from gputravel.protocol.travel import ChunkInfo, HolderHello
from gputravel.protocol.manifest import chunk_digest, chunk_digest_from_manifest
from gputravel.transport.base import Transport
from gputravel.protocol.codec import message

if TYPE_CHECKING:
    from gputravel.orchestrator.cvm import Orchestrator

#: Bytes per ChunkPiece frame. Small enough that the receiving transport reuses one buffer
#: for every frame (it keeps buffers up to 1 MiB) and that reading, sending and receiving
#: overlap: 8 MiB uncapped took 65 ms in 4 MiB frames, 25 ms in 1 MiB or 256 KiB frames.
PIECE_BYTES = 256 << 10
STEPS = ("read", "tls", "gpu_write")
_PAGE = 4096


class HolderRefused(RemoteError):
    """The holder would not send the chunk asked for (its reason is in the message)."""


# ----------------------------------------------------------------------------- messages
@message("baseline.send_chunk")
@dataclass(frozen=True)
class SendChunk:
    """Orchestrator -> holder over TLS: send me these bytes of your dataset."""

    travel_id: int
    dataset_offset: int
    nbytes: int


@message("baseline.piece")
@dataclass(frozen=True)
class ChunkPiece:
    """Holder -> orchestrator: the next piece of the chunk, in order."""

    travel_id: int
    offset: int  # within the chunk
    data: bytes


@message("baseline.sent")
@dataclass(frozen=True)
class ChunkSent:
    """Holder -> orchestrator: the whole chunk has been sent."""

    travel_id: int
    nbytes: int
    read_ns: int  # time the holder spent reading its dataset


@message("baseline.refused")
@dataclass(frozen=True)
class ChunkRefused:
    travel_id: int
    reason: str


@message("ctl.baseline")
@dataclass(frozen=True)
class DoBaseline:
    """Supervisor -> orchestrator: fill the dataset buffer the baseline way."""

    holder: str
    dataset_offset: int


@message("report.baseline")
@dataclass(frozen=True)
class BaselineReport:
    travel_id: int
    holder: str
    chunk: ChunkInfo  # digest checked against the holder's manifest over what VRAM holds
    steps_ms: dict[str, float]  # read, tls, gpu_write
    total_ms: float  # request sent to GPU write done (verification not included, as for a travel)
    verify_ms: float


# ----------------------------------------------------------------------------- holder side
def refusal(req: SendChunk, dataset_bytes: int, piece_bytes: int) -> str | None:
    """Why a holder will not serve ``req``, or None."""
    if req.nbytes <= 0:
        return f"a chunk must not be empty (asked for {req.nbytes} bytes)"
    if req.dataset_offset % piece_bytes or not 0 <= req.dataset_offset < dataset_bytes:
        return f"dataset offset {req.dataset_offset} is not a {piece_bytes}-byte piece boundary inside the dataset"
    if req.dataset_offset + req.nbytes > dataset_bytes:
        return f"{req.nbytes} bytes at {req.dataset_offset} reach past the end of the {dataset_bytes}-byte dataset"
    return None


def send_chunk(dataset: memoryview, piece_bytes: int, conn: Transport, req: SendChunk) -> None:
    """Serve one SendChunk: read the chunk piece by piece and send each piece over TLS."""
    reason = refusal(req, len(dataset), piece_bytes)
    if reason is not None:
        conn.send(ChunkRefused(req.travel_id, reason))
        return
    read_ns = 0
    for start in range(0, req.nbytes, PIECE_BYTES):
        t0 = time.perf_counter_ns()
        lo = req.dataset_offset + start
        data = bytes(dataset[lo : lo + min(PIECE_BYTES, req.nbytes - start)])
        read_ns += time.perf_counter_ns() - t0
        conn.send(ChunkPiece(req.travel_id, start, data))
    conn.send(ChunkSent(req.travel_id, req.nbytes, read_ns))


# ----------------------------------------------------------------------------- orchestrator side
def chunk_bytes(hello: HolderHello, buffer_bytes: int, dataset_offset: int) -> int:
    """How many bytes a baseline transfer at ``dataset_offset`` moves (as much as a travel would)."""
    if hello.dataset_bytes == 0:
        raise BadInput(f"holder {hello.holder!r} has an empty dataset: nothing to send")
    if dataset_offset % hello.piece_bytes or not 0 <= dataset_offset < hello.dataset_bytes:
        raise BadInput(f"dataset offset {dataset_offset} is not a chunk start of holder {hello.holder!r}: chunks start "
                       f"on a {hello.piece_bytes}-byte piece boundary inside its {hello.dataset_bytes}-byte dataset")
    return min(buffer_bytes, hello.dataset_bytes - dataset_offset)


def _prefaulted(nbytes: int) -> bytearray:
    """A staging buffer whose pages are already mapped (first touch is not the transfer's cost)."""
    buf = bytearray(nbytes)
    buf[::_PAGE] = bytes(len(range(0, nbytes, _PAGE)))
    return buf


class BaselinePath:
    """The orchestrator's side of the baseline. One per orchestrator (it owns the staging buffer)."""

    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch
        self._staging: bytearray | None = None
        self._ids = 0

    def run(self, holder: str, dataset_offset: int) -> BaselineReport:
        hello = self._enrolled(holder)
        self._ids += 1
        req = SendChunk(self._ids, dataset_offset, chunk_bytes(hello, self._buffer.nbytes, dataset_offset))
        clock = time.perf_counter
        t0 = clock()
        read_ms = self._receive(holder, req) / 1e6
        t1 = clock()
        self._write(req.nbytes)
        t2 = clock()
        chunk = self._verify(hello, dataset_offset, req.nbytes)
        steps = {"read": read_ms, "tls": max((t1 - t0) * 1e3 - read_ms, 0.0), "gpu_write": (t2 - t1) * 1e3}
        return BaselineReport(req.travel_id, holder, chunk, steps, (t2 - t0) * 1e3, (clock() - t2) * 1e3)

    @property
    def _buffer(self):
        assert self.orch.travel_sm is not None, "the orchestrator has not booted"
        return self.orch.travel_sm.buffer

    def _enrolled(self, holder: str) -> HolderHello:
        assert self.orch.travel_sm is not None, "the orchestrator has not booted"
        hello = self.orch.travel_sm.holders.get(holder)
        if hello is None:
            raise BadInput(f"unknown holder {holder!r} (enrolled: {', '.join(sorted(self.orch.holders)) or 'none'})")
        if holder not in self.orch.holders:  # as for a travel: the training loop skips it
            raise HolderLost(holder, "it is offline (not connected); it may join again", "a baseline transfer")
        if self._staging is None:
            self._staging = _prefaulted(self._buffer.nbytes)
        return hello

    def _write(self, nbytes: int) -> None:
        """The orchestrator's own encrypted copy into the dataset buffer (bounce buffers, CE)."""
        buf = self._buffer
        with memoryview(self._staging) as staging:
            self.orch.driver.copy_to_vram(staging[:nbytes], buf.offset, buffer_bytes=buf.nbytes,
                                          timeout=max(self.orch.config.device_timeout, 30.0))

    def _receive(self, holder: str, req: SendChunk) -> int:
        """Ask for the chunk and take the pieces into the staging buffer; returns the holder's
        read time (ns). A holder that dies, hangs or breaks the exchange loses its connection
        (the stream would be out of step) and is reported lost, as in a travel."""
        conn = self.orch.holders[holder]
        try:
            conn.send(req)
            return _take_pieces(conn, req, self._staging, self.orch.config.holder_timeout)
        except HolderRefused:
            raise  # the exchange ended cleanly: the connection stays in step
        except GputravelError as exc:
            self.orch.holders.pop(holder, None)
            conn.close()
            raise HolderLost(holder, f"{type(exc).__name__}: {exc}", "a baseline transfer") from None

    def _verify(self, hello: HolderHello, dataset_offset: int, nbytes: int) -> ChunkInfo:
        want = chunk_digest_from_manifest(hello.manifest, dataset_offset, nbytes, hello.piece_bytes)
        view = self.orch.buffer_view()
        try:
            got = chunk_digest(view[:nbytes], hello.piece_bytes)
        finally:
            view.release()
        if got != want:
            raise ProtocolError(f"baseline transfer {self._ids}: VRAM does not hold the chunk holder "
                                f"{hello.holder} described in its manifest")
        return ChunkInfo(dataset_offset=dataset_offset, nbytes=nbytes, digest=want)


def _take_pieces(conn: Transport, req: SendChunk, staging: bytearray, timeout: float) -> int:
    got = 0
    while True:
        msg = conn.recv(timeout=timeout, expect=(ChunkPiece, ChunkSent, ChunkRefused)).message
        if msg.travel_id != req.travel_id:
            raise ProtocolError(f"{conn.name}: answer to baseline transfer {msg.travel_id}, expected {req.travel_id}")
        if isinstance(msg, ChunkRefused):
            raise HolderRefused(f"{conn.name} refused to send its chunk: {msg.reason}")
        if isinstance(msg, ChunkSent):
            if msg.nbytes != req.nbytes or got != req.nbytes:
                raise ProtocolError(f"{conn.name}: sent {got} bytes, announced {msg.nbytes}, {req.nbytes} were asked")
            return msg.read_ns
        if msg.offset != got or got + len(msg.data) > req.nbytes or not msg.data:
            raise ProtocolError(f"{conn.name}: piece of {len(msg.data)} bytes at {msg.offset} does not follow "
                                f"the {got} bytes received of {req.nbytes}")
        staging[got : got + len(msg.data)] = msg.data
        got += len(msg.data)


# ----------------------------------------------------------------------------- training
class _BaselineEngine:
    """Looks like the travelling engine to TravelSource, but fills the buffer the baseline way."""

    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch

    def travel(self, holder: str, dataset_offset: int) -> BaselineReport:
        return self.orch.baseline(holder, dataset_offset)

    def buffer_view(self) -> memoryview:
        return self.orch.buffer_view()


class BaselineSource:
    """A training loader source fed by the centralised TLS baseline instead of travels: the
    same visits, the same buffer, the same bytes; only the way they reach VRAM differs."""

    def __init__(self, orch: Orchestrator, dataset_bytes: Mapping[str, int]) -> None:
        from gputravel.train.loader import TravelSource

        self._inner = TravelSource(_BaselineEngine(orch), dataset_bytes)

    def sizes(self) -> Mapping[str, int]:
        return self._inner.sizes()

    def fetch(self, visit):
        return self._inner.fetch(visit)

    @property
    def last_report(self) -> BaselineReport | None:
        return self._inner.last_report
