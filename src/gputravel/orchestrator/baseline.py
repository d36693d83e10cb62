"""The centralised TLS baseline (paper 7.2): the holder sends its chunk over TLS, the orchestrator
writes it into VRAM through its own channel and checks its digest. Timed as the paper does:
``read`` (the holder's), ``tls`` (less the reading) and ``gpu_write``."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Protocol

from gputravel.driver.orchestrator import OrchestratorDriver
from gputravel.errors import BadInput, GputravelError, HolderLost, ProtocolError, RemoteError
from gputravel.protocol.control import BaselineReport
from gputravel.orchestrator.machine import Buffer, OrchestratorTravel
from gputravel.protocol.hardware import HardwareProfile, at_least
from gputravel.protocol.manifest import chunk_digest, chunk_digest_from_manifest, chunk_nbytes
from gputravel.protocol.travel import ChunkInfo, ChunkPiece, ChunkRefused, ChunkSent, HolderHello, SendChunk
from gputravel.transport.base import Transport

_PAGE = 4096


class HolderRefused(RemoteError):
    """The holder would not send the chunk asked for."""


# ----------------------------------------------------------------------------- piece accounting (sans-IO)
@dataclass(frozen=True)
class Store:
    """Write ``data`` into the staging buffer at ``offset`` (within the chunk)."""

    offset: int
    data: bytes


@dataclass(frozen=True)
class Received:
    """The whole chunk is in the staging buffer; the holder spent ``read_ns`` reading it."""

    read_ns: int


class ChunkReceipt:
    """Accepts this SendChunk's pieces in order, none empty or past the bytes asked, then ChunkSent."""

    def __init__(self, req: SendChunk, peer: str) -> None:
        self.req = req
        self.peer = peer  # named in errors
        self.got = 0

    def on_message(self, msg: ChunkPiece | ChunkSent | ChunkRefused) -> Store | Received:
        req = self.req
        if msg.travel_id != req.travel_id:
            raise ProtocolError(f"{self.peer}: answer to baseline transfer {msg.travel_id}, expected {req.travel_id}")
        if isinstance(msg, ChunkRefused):
            raise HolderRefused(f"{self.peer} refused to send its chunk: {msg.reason}")
        if isinstance(msg, ChunkSent):
            if msg.nbytes != req.nbytes or self.got != req.nbytes:
                raise ProtocolError(f"{self.peer}: sent {self.got} bytes, announced {msg.nbytes}, "
                                    f"{req.nbytes} were asked")
            return Received(msg.read_ns)
        if msg.offset != self.got or self.got + len(msg.data) > req.nbytes or not msg.data:
            raise ProtocolError(f"{self.peer}: piece of {len(msg.data)} bytes at {msg.offset} does not follow "
                                f"the {self.got} bytes received of {req.nbytes}")
        self.got += len(msg.data)
        return Store(msg.offset, msg.data)


# ----------------------------------------------------------------------------- the transfer
class _Timeouts(Protocol):
    @property
    def device_timeout(self) -> float: ...
    @property
    def holder_timeout(self) -> float: ...


class BaselineOrchestrator(Protocol):
    """The engine as its baseline uses it: cvm.py imports this module, so this one names a Protocol."""

    driver: OrchestratorDriver
    profile: HardwareProfile
    travel_sm: OrchestratorTravel | None
    holders: dict[str, Transport]  # the holders connected now

    @property
    def config(self) -> _Timeouts: ...
    def drop(self, holder: str) -> None: ...
    def buffer_view(self) -> memoryview: ...


class BaselinePath:
    """The orchestrator's side of the baseline. One per orchestrator (it owns the staging buffer)."""

    def __init__(self, orch: BaselineOrchestrator) -> None:
        self.orch = orch
        self._ids = 0

    def run(self, holder: str, dataset_offset: int) -> BaselineReport:
        hello = self._enrolled(holder)
        self._ids += 1
        assert self.orch.travel_sm is not None  # _enrolled says so
        nbytes = chunk_nbytes(holder, hello.dataset_bytes, hello.piece_bytes, dataset_offset, self._buffer.nbytes,
                              self.orch.travel_sm.held_base.get(holder, 0))
        req = SendChunk(self._ids, dataset_offset, nbytes)
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
    def _buffer(self) -> Buffer:
        assert self.orch.travel_sm is not None, "the orchestrator has not booted"
        return self.orch.travel_sm.buffer

    @functools.cached_property
    def _staging(self) -> bytearray:
        """Its pages mapped at once, before a transfer's clock starts (_enrolled): not its cost."""
        buf = bytearray(self._buffer.nbytes)
        buf[::_PAGE] = bytes(len(range(0, len(buf), _PAGE)))
        return buf

    def _enrolled(self, holder: str) -> HolderHello:
        assert self.orch.travel_sm is not None, "the orchestrator has not booted"
        hello = self.orch.travel_sm.holders.get(holder)
        if hello is None:
            raise BadInput(f"unknown holder {holder!r} (enrolled: {', '.join(sorted(self.orch.holders)) or 'none'})")
        if holder not in self.orch.holders:  # as for a travel: the training loop skips it
            raise HolderLost(holder, "it is offline (not connected); it may join again", "a baseline transfer")
        self._staging  # noqa: B018  made now, off the transfer's clock
        return hello

    def _write(self, nbytes: int) -> None:
        buf = self._buffer
        with memoryview(self._staging) as staging, at_least(self.orch.profile.write_s(nbytes)):  # the hardware's write
            self.orch.driver.copy_to_vram(staging[:nbytes], buf.offset, buffer_bytes=buf.nbytes,
                                          timeout=max(self.orch.config.device_timeout, 30.0))

    def _receive(self, holder: str, req: SendChunk) -> int:
        """Take the chunk into staging; the holder's read ns. One that breaks the exchange is dropped."""
        conn = self.orch.holders[holder]
        try:
            conn.send(req)
            return _take_pieces(conn, req, self._staging, self.orch.config.holder_timeout)
        except HolderRefused:
            raise  # the exchange ended cleanly: the connection stays in step
        except GputravelError as exc:
            self.orch.drop(holder)
            raise HolderLost(holder, f"{type(exc).__name__}: {exc}", "a baseline transfer") from None

    def _verify(self, hello: HolderHello, dataset_offset: int, nbytes: int) -> ChunkInfo:
        want = chunk_digest_from_manifest(hello.manifest, dataset_offset, nbytes, hello.piece_bytes)
        with self.orch.buffer_view() as view:  # released at once: the mapping cannot close under a view
            got = chunk_digest(view[:nbytes], hello.piece_bytes)
        if got != want:
            raise ProtocolError(f"baseline transfer {self._ids}: VRAM does not hold the chunk holder "
                                f"{hello.holder} described in its manifest")
        return ChunkInfo(dataset_offset=dataset_offset, nbytes=nbytes, digest=want)


def _take_pieces(conn: Transport, req: SendChunk, staging: bytearray, timeout: float) -> int:
    """Carry the holder's answers to a ChunkReceipt, its pieces into ``staging``; returns its read ns."""
    receipt = ChunkReceipt(req, conn.name)
    while True:
        msg = conn.recv(timeout=timeout, expect=(ChunkPiece, ChunkSent, ChunkRefused)).message
        act = receipt.on_message(msg)
        if isinstance(act, Received):
            return act.read_ns
        staging[act.offset : act.offset + len(act.data)] = act.data
