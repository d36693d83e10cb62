"""The centralised TLS baseline (paper 7.2) and the links a cohort runs on.

Unit tests drive the chunk exchange over an in-memory transport pair and the transport's
pacing hook with a fake bucket; bytes sent the baseline way arrive intact in VRAM on the
in-process cohort (the real orchestrator and holder); integration tests boot real cohorts: a
cohort on shaped links leaves no namespace behind, and the token-bucket fallback works, each
sending a baseline chunk over TLS. No timing assertions: rates are checked by `bench compare`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from gputravel.errors import BadInput, HolderLost, ProtocolError
from gputravel.holder.baseline import PIECE_BYTES, refusal, send_chunk
from gputravel.net import LINK_NETNS, LINK_TOKEN_BUCKET, netns_available
from gputravel.net.pace import pace
from gputravel.orchestrator.cvm import Orchestrator
from gputravel.orchestrator.baseline import (
    BaselinePath,
    ChunkReceipt,
    HolderRefused,
    Received,
    Store,
    _take_pieces,
)
from gputravel.protocol.control import BaselineReport
from gputravel.protocol.manifest import chunk_digest
from gputravel.protocol.travel import ChunkInfo, ChunkPiece, ChunkRefused, ChunkSent, HolderHello, SendChunk
from gputravel.train.loader import BaselineSource
from gputravel.train.schedule import Visit
from gputravel.cohort.links import LINK_NONE, check_link_config, resolve_link
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.local import Cohort
from gputravel.transport.memory import memory_pair
from gputravel.transport.unix import socketpair_transports

MIB = 1 << 20
NETNS_OK, NETNS_WHY = netns_available()
needs_netns = pytest.mark.skipif(not NETNS_OK, reason=f"shaped links unavailable: {NETNS_WHY}")


# ----------------------------------------------------------------------------- the exchange (unit)
def test_holder_refuses_what_it_cannot_serve() -> None:
    assert refusal(SendChunk(1, 0, MIB), 3 * MIB, MIB) is None
    assert "empty" in refusal(SendChunk(1, 0, 0), 3 * MIB, MIB)
    assert "piece boundary" in refusal(SendChunk(1, 12345, MIB), 3 * MIB, MIB)
    assert "piece boundary" in refusal(SendChunk(1, 3 * MIB, 1), 3 * MIB, MIB)
    assert "past the end" in refusal(SendChunk(1, 2 * MIB, 2 * MIB), 3 * MIB, MIB)


def test_chunk_crosses_in_bounded_pieces_and_lands_in_order() -> None:
    data = os.urandom(PIECE_BYTES * 2 + 777)
    holder_end, orch_end = memory_pair("holder", "orchestrator")
    req = SendChunk(7, 0, len(data))
    send_chunk(memoryview(data), MIB, holder_end, req)
    staging = bytearray(len(data))
    assert _take_pieces(orch_end, req, staging, timeout=1) >= 0
    assert staging == data


def test_refusal_and_out_of_order_pieces_are_errors() -> None:
    holder_end, orch_end = memory_pair("holder", "orchestrator")
    send_chunk(memoryview(b"x" * MIB), MIB, holder_end, SendChunk(1, 12345, 10))
    with pytest.raises(HolderRefused, match="piece boundary"):
        _take_pieces(orch_end, SendChunk(1, 12345, 10), bytearray(10), timeout=1)
    holder_end.send(ChunkPiece(2, 5, b"abc"))
    with pytest.raises(ProtocolError, match="does not follow"):
        _take_pieces(orch_end, SendChunk(2, 0, 8), bytearray(8), timeout=1)
    holder_end.send(ChunkSent(3, 8, 0))
    with pytest.raises(ProtocolError, match="sent 0 bytes"):
        _take_pieces(orch_end, SendChunk(3, 0, 8), bytearray(8), timeout=1)


def test_the_receipt_takes_pieces_in_order_and_nothing_else() -> None:
    """The orchestrator's piece accounting, with no transport: what each answer leads to."""
    receipt = ChunkReceipt(SendChunk(4, 0, 8), "alice")
    assert receipt.on_message(ChunkPiece(4, 0, b"abcde")) == Store(0, b"abcde")
    assert receipt.on_message(ChunkPiece(4, 5, b"fgh")) == Store(5, b"fgh")
    assert receipt.on_message(ChunkSent(4, 8, 123)) == Received(123)
    bad = [(ChunkPiece(5, 0, b"a"), ProtocolError, "answer to baseline transfer 5, expected 4"),
           (ChunkPiece(4, 0, b""), ProtocolError, "does not follow"),  # empty
           (ChunkPiece(4, 0, b"x" * 9), ProtocolError, "does not follow"),  # past the bytes asked for
           (ChunkPiece(4, 1, b"x"), ProtocolError, "does not follow"),  # out of order
           (ChunkSent(4, 8, 0), ProtocolError, "sent 0 bytes, announced 8"),  # early
           (ChunkRefused(4, "no"), HolderRefused, "alice refused to send its chunk: no")]
    for msg, error, match in bad:
        with pytest.raises(error, match=match):
            ChunkReceipt(SendChunk(4, 0, 8), "alice").on_message(msg)
    receipt = ChunkReceipt(SendChunk(4, 0, 8), "alice")
    receipt.on_message(ChunkPiece(4, 0, b"x" * 8))
    with pytest.raises(ProtocolError, match="announced 9"):
        receipt.on_message(ChunkSent(4, 9, 0))


def test_a_baseline_source_fetches_through_the_engines_baseline_transfer() -> None:
    """Training fed the baseline way: the same visits and buffer as travels (train/loader.py)."""
    tokens = np.arange(16, dtype=np.uint16)
    asked = []

    class Engine:
        def baseline(self, holder: str, dataset_offset: int) -> BaselineReport:
            asked.append((holder, dataset_offset))
            return BaselineReport(1, holder, ChunkInfo(dataset_offset, 8, b""), {}, 0.0, 0.0)

        def buffer_view(self) -> memoryview:
            return memoryview(tokens.tobytes())

    source = BaselineSource(Engine(), {"alice": 32})
    assert source.sizes() == {"alice": 16}
    assert list(source.fetch(Visit("alice", 2, 4))) == [0, 1, 2, 3]
    assert asked == [("alice", 4)] and source.last_report.holder == "alice"


# ----------------------------------------------------------------------------- pacing (unit)
class FakeBucket:
    burst_bytes = 4096

    def __init__(self) -> None:
        self.paid: list[int] = []

    def throttle(self, nbytes: int) -> float:
        self.paid.append(nbytes)
        return 0.0


def test_a_paced_transport_pays_for_every_byte_once_before_it_leaves() -> None:
    a, b = socketpair_transports()
    bucket = FakeBucket()
    a.pace(bucket)
    a.send(ChunkPiece(1, 0, os.urandom(100_000)))
    assert b.recv(timeout=5).message.data
    assert sum(bucket.paid) == a.bytes_sent
    assert max(bucket.paid) <= bucket.burst_bytes
    a.pace(None)
    a.send(ChunkSent(1, 1, 0))
    assert sum(bucket.paid) < a.bytes_sent
    a.close()
    b.close()


def test_each_party_paces_its_end_only_with_a_rate_and_a_stream() -> None:
    paced = []
    pace(SimpleNamespace(pace=paced.append), None)
    assert paced == []
    pace(SimpleNamespace(pace=paced.append), 20.0)
    assert len(paced) == 1
    with pytest.raises(BadInput, match="cannot be paced"):
        pace(object(), 20.0)


# ----------------------------------------------------------------------------- link settings (unit)
def test_link_settings_are_checked() -> None:
    check_link_config("auto", 20.0, False)
    with pytest.raises(BadInput, match="link must be one of"):
        check_link_config("wifi", None, False)
    with pytest.raises(BadInput, match="needs a link"):
        check_link_config("none", 20.0, False)
    with pytest.raises(BadInput, match="positive"):
        check_link_config("auto", -1.0, False)
    with pytest.raises(BadInput, match="at most"):  # what the links would refuse, refused before booting
        check_link_config("token-bucket", 2e5, False)
    with pytest.raises(BadInput, match="tap"):
        check_link_config("netns", 20.0, True)
    assert resolve_link("auto", None) == LINK_NONE
    assert resolve_link("token-bucket", 20.0) == LINK_TOKEN_BUCKET
    assert resolve_link("auto", 20.0) == (LINK_NETNS if NETNS_OK else LINK_TOKEN_BUCKET)


# ----------------------------------------------------------------------------- cohorts (integration)
@pytest.fixture
def dataset(tmp_path: Path) -> tuple[str, bytes]:
    data = os.urandom(3 * MIB + 12345)
    path = tmp_path / "holder.bin"
    path.write_bytes(data)
    return str(path), data


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _check_baseline(cohort: Cohort | Orchestrator, data: bytes, offset: int, want: int) -> None:
    r = cohort.baseline("h", offset)
    assert r.chunk.dataset_offset == offset and r.chunk.nbytes == want
    # The orchestrator checked VRAM against the manifest; check the digest independently too.
    assert r.chunk.digest == chunk_digest(data[offset : offset + want])
    assert set(r.steps_ms) == {"read", "tls", "gpu_write"} and r.total_ms > 0


def test_baseline_bytes_arrive_intact_in_vram(dataset, tmp_path: Path) -> None:
    """The real orchestrator and holder on the in-process cohort (a memory link, not TLS: the
    exchange and the VRAM write are the point here; the two cohorts below run it over TLS)."""
    from gputravel.protocol.layout import Layout
    from gputravel.testing.cohort import InProcessCohort

    path, data = dataset
    cfg = CohortConfig(holders=(HolderSpec("h", path),), buffer_bytes=2 * MIB)
    assert resolve_link(cfg.link, cfg.bandwidth_mbit) == LINK_NONE  # a cohort asked for no link gets none
    with InProcessCohort({"h": Path(path)}, buffer_bytes=cfg.buffer_bytes, layout=Layout(), workdir=tmp_path) as c:
        orch = c.orchestrator
        _check_baseline(orch, data, 0, 2 * MIB)  # a chunk equal to the buffer
        _check_baseline(orch, data, 2 * MIB, MIB + 12345)  # one smaller than the buffer
        travel = orch.travel("h", 0)  # the orchestrator's own copy left the channel in step
        assert travel.chunk is not None and travel.chunk.digest == chunk_digest(data[: 2 * MIB])
        _check_baseline(orch, data, MIB, 2 * MIB)
        with pytest.raises(BadInput, match="not a chunk start"):
            orch.baseline("h", 12345)
        with pytest.raises(BadInput, match="not a chunk start"):
            orch.baseline("h", 4 * MIB)
        with pytest.raises(BadInput, match="unknown holder"):
            orch.baseline("nobody", 0)
        _check_baseline(orch, data, 0, 2 * MIB)  # refusals leave the cohort usable


@pytest.mark.integration
@needs_netns
def test_cohort_on_shaped_links_runs_inside_namespaces_and_leaves_none(processes, dataset) -> None:
    path, data = dataset
    before = _namespaces()
    cfg = CohortConfig(holders=(HolderSpec("h", path),), buffer_bytes=MIB, bandwidth_mbit=200.0, link="netns")
    with Cohort(cfg) as cohort:
        assert cohort.link == LINK_NETNS
        shaped = cohort.links.shaped
        ours = {shaped.namespace(m) for m in shaped.members}
        assert ours <= _namespaces()
        for member in ("h", "orchestrator"):
            pids = subprocess.run(["ip", "netns", "pids", shaped.namespace(member)], capture_output=True,
                                  text=True, check=True).stdout.split()
            assert str(cohort.pids()[member]) in pids
        assert "tbf" in shaped.qdisc_report("h")
        _check_baseline(cohort, data, 0, MIB)
        assert cohort.travel("h", MIB).chunk is not None
    assert not ours & _namespaces()
    assert _namespaces() <= before


@pytest.mark.integration
def test_token_bucket_fallback_paces_the_tls_connection(processes, dataset) -> None:
    path, data = dataset
    before = _namespaces() if NETNS_OK else set()
    cfg = CohortConfig(holders=(HolderSpec("h", path),), buffer_bytes=MIB, bandwidth_mbit=200.0, link="token-bucket")
    with Cohort(cfg) as cohort:
        assert cohort.link == LINK_TOKEN_BUCKET and cohort.links.shaped is None
        for member in ("h", "orchestrator"):  # each end got the rate to pace itself to
            argv = Path(f"/proc/{cohort.pids()[member]}/cmdline").read_bytes()
            assert b'"pace_mbit": 200.0' in argv
        _check_baseline(cohort, data, 0, MIB)
        assert cohort.travel("h", 2 * MIB).chunk is not None
    if NETNS_OK:
        assert _namespaces() <= before


def test_a_holder_that_breaks_the_exchange_is_lost_as_in_a_travel() -> None:
    """It is dropped (the stream would be out of step) and reported HolderLost, which the
    training loop treats as it treats a holder lost mid-travel; offline, it stays lost."""
    holder_end, orch_end = memory_pair("holder", "orchestrator")
    hello = HolderHello("alice", 8, 8, (b"\x00" * 32,), "", "", 0, 0, True, bytes(32))
    orch = SimpleNamespace(holders={"alice": orch_end}, config=SimpleNamespace(holder_timeout=1),
                           travel_sm=SimpleNamespace(holders={"alice": hello}, buffer=SimpleNamespace(nbytes=8)))
    orch.drop = lambda name: Orchestrator.drop(orch, name)  # the real one, on this link
    path = BaselinePath(orch)
    path._staging = bytearray(8)
    holder_end.send(ChunkPiece(1, 5, b"abc"))  # out of order
    with pytest.raises(HolderLost, match=r"'alice' lost during a baseline transfer.*does not follow"):
        path._receive("alice", SendChunk(1, 0, 8))
    assert "alice" not in orch.holders
    with pytest.raises(HolderLost, match="offline"):
        path.run("alice", 0)
    with pytest.raises(BadInput, match="unknown holder 'bob'"):
        path.run("bob", 0)
