"""The travel roles (sans-IO): OrchestratorTravel and HolderTravel paired in memory.

No IO and no clocks: every event gets ``now`` from the test, so step timings are exact.
Messages between the two go through the wire codec, as they would over TLS.
"""

from __future__ import annotations

import hashlib

import pytest

from gputravel.errors import BadInput, IllegalTransition, ProtocolError
from gputravel.protocol.travel import ChunkInfo, HolderHello, TravelRefused, TravelRequest, TravelResult
from gputravel.holder.machine import AwaitGpu as HolderAwaitGpu
from gputravel.holder.machine import (
    CopyChunk,
    ExportBlob,
    HolderPhase,
    HolderTravel,
    ImportBlob,
    Reply,
    SwitchBack,
)
from gputravel.protocol.manifest import chunk_digest, chunk_digest_from_manifest, piece_digests
from gputravel.orchestrator.machine import (
    STEPS,
    AwaitGpu,
    AwaitReply,
    AwaitRotation,
    AwaitScrub,
    Buffer,
    Depart,
    OrchestratorTravel,
    Phase,
    RotateAndImport,
    ScrubBuffer,
    TravelReport,
    VerifyChunk,
)
from gputravel.testing import ORCHESTRATOR, TEST_LAYOUT, InProcessGpu, leaks
from gputravel.protocol.codec import decode, encode

PIECE = 4096
BUFFER = Buffer(offset=0x2000, nbytes=4 * PIECE)
BLOB = b"\x01context-blob\xfe" * 4
DATASET = bytes((i * 31 + 7) % 256 for i in range(10 * PIECE))  # 2.5 buffers: last chunk is short


def over_tls(msg):
    return decode(encode(msg))


def hello(name: str = "alice", data: bytes = DATASET, piece: int = PIECE) -> HolderHello:
    return HolderHello(name, len(data), piece, piece_digests(data, piece), "")


def holder_sm(name: str = "alice", data: bytes = DATASET) -> HolderTravel:
    return HolderTravel(name, len(data), piece_digests(data, PIECE), PIECE)


def orchestrator_sm(*hellos: HolderHello) -> OrchestratorTravel:
    sm = OrchestratorTravel(BUFFER)
    for h in hellos or (hello(),):
        sm.enrol(h)
    return sm


def go_away(o: OrchestratorTravel, holder: str = "alice", offset: int = 0, blob: bytes = BLOB) -> TravelRequest:
    o.start(holder, offset, 0.0)
    o.exported(blob, 0.25)
    req = o.scrubbed(0.5).request
    o.switched(0.75)
    return over_tls(req)


def come_home(o: OrchestratorTravel, result: TravelResult | TravelRefused):
    o.holder_replied(result, 3.0)
    o.home(3.125)
    o.imported(3.375)
    return o.rotated(3.5)


def serve(h: HolderTravel, req: TravelRequest, returned: bytes = b"\x02returned") -> TravelResult | TravelRefused:
    act = h.on_request(req, 100.125)
    if isinstance(act, ImportBlob):
        h.imported(100.25)
        copy = h.attached(100.375)
        h.copied(copy.nbytes, 101.25)
        h.switch_requested(101.375)
        return over_tls(h.exported(returned, 101.625).message)
    assert h.attached(100.375) == SwitchBack()
    return over_tls(h.switch_requested(101.625).message)


# ============================================================================ a whole travel
def test_a_travel_end_to_end_with_exact_timings() -> None:
    o, h = orchestrator_sm(), holder_sm()

    assert o.start("alice", 0, 0.0) == ScrubBuffer(BUFFER.offset, BUFFER.nbytes)
    assert o.phase is Phase.CLEANUP
    assert o.exported(BLOB, 0.25) == AwaitScrub()  # the context is packed while the device scrubs
    assert o.phase is Phase.SCRUB
    depart = o.scrubbed(0.5)
    assert isinstance(depart, Depart) and depart.holder == "alice"
    req = over_tls(depart.request)
    assert req == TravelRequest(1, BUFFER.offset, BUFFER.nbytes, 0, BLOB)
    assert o.phase is Phase.DEPART
    assert o.switched(0.75) == AwaitReply()
    assert o.phase is Phase.AWAY

    act = h.on_request(req, 100.125)
    assert act == ImportBlob(BLOB)
    assert h.imported(100.25) == HolderAwaitGpu()  # imported while the MUX switches; now wait for it
    assert h.phase is HolderPhase.ATTACH
    copy = h.attached(100.375)
    assert copy == CopyChunk(BUFFER.offset, BUFFER.nbytes, 0, BUFFER.nbytes)
    assert h.copied(copy.nbytes, 101.25) == SwitchBack()  # done with the device: the GPU goes home first
    assert h.switch_requested(101.375) == ExportBlob()  # and the context is packed while it switches
    reply = h.exported(b"\x02returned", 101.625)
    assert isinstance(reply, Reply) and h.phase is HolderPhase.IDLE
    result = over_tls(reply.message)
    assert isinstance(result, TravelResult)
    assert result.steps_ns == {"dh_import": 125_000_000, "dh_switch": 125_000_000, "dh_copy": 875_000_000,
                               "dh_export": 250_000_000, "handler": 1_500_000_000}
    assert result.chunk == ChunkInfo(0, BUFFER.nbytes, chunk_digest(DATASET[: BUFFER.nbytes], PIECE))
    assert result.nonzero_on_arrival == -1 and result.context == b"\x02returned"

    assert o.holder_replied(result, 3.0) == AwaitGpu()
    assert o.home(3.125) == RotateAndImport(b"\x02returned")  # the device rotates while we import
    assert o.imported(3.375) == AwaitRotation()
    verify = o.rotated(3.5)
    assert verify == VerifyChunk(BUFFER.offset, BUFFER.nbytes, PIECE)
    report = o.verified(chunk_digest(DATASET[: BUFFER.nbytes], PIECE), 4.0)
    assert o.phase is Phase.IDLE

    # Each step is its share of the critical path: the switches only what was waited for,
    # tls the time away less the holder's handler, o_export inside o_cleanup.
    assert report.steps_ms == {
        "o_cleanup": 500.0, "o_export": 250.0, "dh_switch": 125.0, "dh_import": 125.0, "dh_copy": 875.0,
        "dh_export": 250.0, "tls": 1000.0, "o_switch": 125.0, "o_import": 250.0, "o_rotate": 125.0,
    }
    assert tuple(report.steps_ms) == STEPS
    handler_rest = 125.0  # the holder's export to its switch request: in no step
    assert report.total_ms == 3500.0 == sum(report.steps_ms.values()) - report.steps_ms["o_export"] + handler_rest
    assert report.verify_ms == 500.0
    assert (report.travel_id, report.holder, report.refused) == (1, "alice", None)
    assert report.chunk == result.chunk
    assert over_tls(report) == report


def test_consecutive_travels_walk_the_dataset_and_number_themselves() -> None:
    o, h = orchestrator_sm(), holder_sm()
    sizes = []
    for n, offset in enumerate(range(0, len(DATASET), BUFFER.nbytes), start=1):
        req = go_away(o, offset=offset)
        assert req.travel_id == n and req.dataset_offset == offset
        result = serve(h, req)
        verify = come_home(o, result)
        want = DATASET[offset : offset + BUFFER.nbytes]
        assert verify.nbytes == len(want)
        report = o.verified(chunk_digest(want, PIECE), 4.0)
        sizes.append(report.chunk.nbytes)
    assert sizes == [4 * PIECE, 4 * PIECE, 2 * PIECE]


def test_arrival_audit_is_reported() -> None:
    o, h = orchestrator_sm(), holder_sm()
    h.on_request(go_away(o), 10.0)
    h.imported(10.0)
    h.attached(10.0)
    h.audited(0)
    h.copied(BUFFER.nbytes, 10.0)
    h.switch_requested(10.0)
    assert h.exported(b"x", 10.0).message.nonzero_on_arrival == 0


# ============================================================================ illegal transitions
@pytest.mark.parametrize("event", [
    lambda o: o.scrubbed(1.0),
    lambda o: o.exported(BLOB, 1.0),
    lambda o: o.switched(1.0),
    lambda o: o.holder_replied(TravelRefused(1, BLOB, "no", {}), 1.0),
    lambda o: o.imported(1.0),
    lambda o: o.home(1.0),
    lambda o: o.rotated(1.0),
    lambda o: o.verified(b"\x00" * 32, 1.0),
], ids=["scrubbed", "exported", "switched", "holder_replied", "imported", "home", "rotated", "verified"])
def test_orchestrator_events_while_idle_are_illegal(event) -> None:
    o = orchestrator_sm()
    with pytest.raises(IllegalTransition) as err:
        event(o)
    assert err.value.state == "idle"
    assert o.phase is Phase.IDLE


def test_orchestrator_out_of_order_and_double_events_are_illegal() -> None:
    o = orchestrator_sm()
    o.start("alice", 0, 0.0)
    with pytest.raises(IllegalTransition):
        o.start("alice", 0, 0.0)  # one travel at a time
    with pytest.raises(IllegalTransition):
        o.scrubbed(0.1)  # the context must be packed before the scrub is confirmed
    with pytest.raises(IllegalTransition):
        o.switched(0.1)  # nothing asked of the MUX yet
    o.exported(BLOB, 0.25)
    with pytest.raises(IllegalTransition):
        o.exported(BLOB, 0.3)
    o.scrubbed(0.5)
    with pytest.raises(IllegalTransition):
        o.scrubbed(0.6)
    o.switched(1.0)
    with pytest.raises(IllegalTransition):
        o.home(1.1)  # the context is away: the GPU cannot be home yet
    with pytest.raises(IllegalTransition):
        o.rotated(1.1)  # the context is away
    with pytest.raises(IllegalTransition) as err:
        o.imported(1.1)
    assert "orchestrator" in str(err.value) and "away" in str(err.value)
    assert o.phase is Phase.AWAY


@pytest.mark.parametrize("event", [
    lambda h: h.imported(1.0),
    lambda h: h.attached(1.0),
    lambda h: h.attach_failed("no GPU", 1.0),
    lambda h: h.copied(PIECE, 1.0),
    lambda h: h.copy_failed("boom", 1.0),
    lambda h: h.audited(0),
    lambda h: h.exported(BLOB, 1.0),
    lambda h: h.switch_requested(1.0),
], ids=["imported", "attached", "attach_failed", "copied", "copy_failed", "audited", "exported", "switch_requested"])
def test_holder_events_while_idle_are_illegal(event) -> None:
    h = holder_sm()
    with pytest.raises(IllegalTransition) as err:
        event(h)
    assert err.value.state == "idle" and "holder alice" in str(err.value)


def test_holder_takes_one_request_at_a_time() -> None:
    o, h = orchestrator_sm(), holder_sm()
    req = go_away(o)
    h.on_request(req, 1.0)
    with pytest.raises(IllegalTransition):
        h.on_request(req, 1.0)
    with pytest.raises(IllegalTransition):
        h.copied(PIECE, 1.0)  # before importing
    h.imported(1.0)
    with pytest.raises(IllegalTransition):
        h.copied(PIECE, 1.0)  # before the GPU is ours
    h.attached(1.0)
    with pytest.raises(IllegalTransition):
        h.exported(BLOB, 1.0)  # before the switch home is asked for


# ============================================================================ bad input
def test_start_for_an_unknown_holder_names_the_enrolled_ones() -> None:
    o = orchestrator_sm(hello("alice"), hello("bob"))
    with pytest.raises(BadInput, match="'carol'.*alice, bob"):
        o.start("carol", 0, 0.0)
    assert o.phase is Phase.IDLE
    with pytest.raises(BadInput, match="none"):
        OrchestratorTravel(BUFFER).start("alice", 0, 0.0)


def test_start_for_a_holder_with_an_empty_dataset_is_refused() -> None:
    o = orchestrator_sm(hello("empty", b""))
    with pytest.raises(BadInput, match="empty"):
        o.start("empty", 0, 0.0)
    assert o.phase is Phase.IDLE


@pytest.mark.parametrize("offset", [PIECE + 1, BUFFER.nbytes + 1, -BUFFER.nbytes, 3 * BUFFER.nbytes])
def test_start_at_an_offset_that_is_not_a_chunk_start_is_refused(offset: int) -> None:
    o = orchestrator_sm()
    with pytest.raises(BadInput, match="chunk start"):
        o.start("alice", offset, 0.0)
    assert o.phase is Phase.IDLE
    o.start("alice", 2 * BUFFER.nbytes, 0.0)  # the short last chunk is a chunk start


def test_a_chunk_may_start_at_any_piece_boundary() -> None:
    o = orchestrator_sm()
    assert o.start("alice", PIECE, 0.0).nbytes == BUFFER.nbytes


def test_enrolment_checks_piece_size_and_manifest_length() -> None:
    o = OrchestratorTravel(BUFFER)
    with pytest.raises(ProtocolError, match="piece size"):
        o.enrol(hello(piece=3 * PIECE))
    with pytest.raises(ProtocolError, match="piece size"):
        o.enrol(HolderHello("alice", len(DATASET), 0, (), ""))
    short = hello()
    with pytest.raises(ProtocolError, match="manifest"):
        o.enrol(HolderHello("alice", len(DATASET), PIECE, short.manifest[:-1], ""))
    assert o.holders == {}


def test_reply_to_another_travel_is_a_protocol_error() -> None:
    o, h = orchestrator_sm(), holder_sm()
    result = serve(h, go_away(o))
    stale = TravelResult(result.travel_id + 7, result.context, result.chunk, result.steps_ns, -1)
    with pytest.raises(ProtocolError, match="travel 8, expected 1"):
        o.holder_replied(stale, 3.0)
    assert o.phase is Phase.AWAY
    assert isinstance(o.holder_replied(result, 3.0), AwaitGpu)  # the right reply still works


@pytest.mark.parametrize("lie", ["digest", "offset", "nbytes"])
def test_chunk_that_does_not_match_the_manifest_is_a_protocol_error(lie: str) -> None:
    o, h = orchestrator_sm(), holder_sm()
    result = serve(h, go_away(o))
    c = result.chunk
    bad = {
        "digest": ChunkInfo(c.dataset_offset, c.nbytes, hashlib.sha256(b"other").digest()),
        "offset": ChunkInfo(c.dataset_offset + BUFFER.nbytes, c.nbytes, c.digest),
        "nbytes": ChunkInfo(c.dataset_offset, c.nbytes - PIECE, c.digest),
    }[lie]
    with pytest.raises(ProtocolError, match="alice"):
        o.holder_replied(TravelResult(result.travel_id, result.context, bad, result.steps_ns, -1), 3.0)


def test_holder_lying_about_its_data_is_caught_against_the_enrolled_manifest() -> None:
    """The holder enrolled one dataset and copies another: its chunk digest gives it away."""
    o = orchestrator_sm(hello("alice", DATASET))
    liar = holder_sm("alice", bytes(len(DATASET)))
    with pytest.raises(ProtocolError, match="manifest"):
        o.holder_replied(serve(liar, go_away(o)), 3.0)


def test_verified_with_a_wrong_digest_is_a_protocol_error() -> None:
    o, h = orchestrator_sm(), holder_sm()
    come_home(o, serve(h, go_away(o)))
    wrong = chunk_digest(bytes(BUFFER.nbytes), PIECE)
    with pytest.raises(ProtocolError, match="VRAM does not hold"):
        o.verified(wrong, 4.0)
    assert o.phase is Phase.IDLE  # the travel is over; the next one can start
    o.start("alice", 0, 5.0)


def test_abort_returns_to_idle() -> None:
    o = orchestrator_sm()
    go_away(o)
    o.abort()
    assert o.phase is Phase.IDLE
    assert go_away(o).travel_id == 2


# ============================================================================ refusals
@pytest.mark.parametrize("why", ["empty dataset", "offset outside", "offset not a piece", "buffer not pieces"])
def test_holder_refusal_returns_the_untouched_context(why: str) -> None:
    h = holder_sm("alice", b"" if why == "empty dataset" else DATASET)
    req = TravelRequest(
        travel_id=4,
        buffer_offset=BUFFER.offset,
        buffer_bytes=BUFFER.nbytes + (1 if why == "buffer not pieces" else 0),
        dataset_offset={"offset outside": len(DATASET), "offset not a piece": 100}.get(why, 0),
        context=BLOB,
    )
    act = h.on_request(req, 7.0)
    assert act == HolderAwaitGpu()  # the context untouched; wait for the GPU, so the switch home comes after
    assert h.attached(7.25) == SwitchBack()  # and straight home, the GPU untouched
    reply = h.switch_requested(7.5)
    refused = reply.message
    assert isinstance(refused, TravelRefused)
    assert refused.travel_id == 4 and refused.context == BLOB
    assert refused.reason
    assert refused.steps_ns == {"dh_import": 0, "dh_switch": 250_000_000, "dh_copy": 0, "dh_export": 0,
                                "handler": 500_000_000}
    assert h.phase is HolderPhase.IDLE


def test_refused_travel_is_reported_without_a_chunk_or_verification() -> None:
    o = orchestrator_sm()
    req = go_away(o)
    refusal = over_tls(TravelRefused(req.travel_id, req.context, "disk on fire", {"handler": 500_000_000}))
    assert o.holder_replied(refusal, 3.0) == AwaitGpu()
    assert o.home(3.125) == RotateAndImport(BLOB)
    o.imported(3.375)
    report = o.rotated(3.5)
    assert isinstance(report, TravelReport)
    assert report.refused == "disk on fire" and report.chunk is None and report.verify_ms == 0.0
    assert report.steps_ms["tls"] == 2000.0  # 2.5 s away (from the scrub), 0.5 s of it in the holder's handler
    assert report.total_ms == 3500.0
    assert o.phase is Phase.IDLE


def test_failed_copy_is_a_refusal_with_the_exported_context() -> None:
    o, h = orchestrator_sm(), holder_sm()
    h.on_request(go_away(o), 1.0)
    h.imported(1.0)
    h.attached(1.0)
    assert h.copy_failed("ChannelFaulted: user channel faulted", 2.0) == SwitchBack()
    assert h.switch_requested(2.0) == ExportBlob()
    refused = h.exported(b"\x03after-copy", 2.0).message
    assert isinstance(refused, TravelRefused)
    assert refused.context == b"\x03after-copy"  # the channel moved on: the new context goes home
    assert "ChannelFaulted" in refused.reason


# ============================================================================ manifests
def test_manifest_digests() -> None:
    manifest = piece_digests(DATASET, PIECE)
    assert len(manifest) == 10
    assert chunk_digest_from_manifest(manifest, 8 * PIECE, 2 * PIECE, PIECE) == chunk_digest(DATASET[8 * PIECE :], PIECE)
    partial = DATASET[: 2 * PIECE + 5]
    assert chunk_digest_from_manifest(piece_digests(partial, PIECE), 0, len(partial), PIECE) == chunk_digest(partial, PIECE)
    with pytest.raises(BadInput):
        chunk_digest_from_manifest(manifest, 1, PIECE, PIECE)
    with pytest.raises(BadInput):
        chunk_digest_from_manifest(manifest, 0, 0, PIECE)
    with pytest.raises(BadInput):
        chunk_digest_from_manifest(manifest, 8 * PIECE, 3 * PIECE, PIECE)


# ============================================================================ roles driving the real device
def test_roles_drive_real_drivers_and_verify_vram() -> None:
    """The actions the two machines emit, carried out on the in-process device and drivers."""
    gpu = InProcessGpu()
    data = bytes((i * 13 + 1) % 256 for i in range(3 * TEST_LAYOUT.record_bytes + 4096))
    orch, holders = gpu.boot("alice")
    buf = orch.alloc_dataset_buffer(2 * TEST_LAYOUT.record_bytes)
    o = OrchestratorTravel(Buffer(buf.offset, buf.nbytes))
    o.enrol(HolderHello("alice", len(data), PIECE, piece_digests(data, PIECE), ""))
    h = holder_sm("alice", data)
    alice, t = holders["alice"], iter(range(1000))
    for offset in range(0, len(data), buf.nbytes):
        scrub = o.start("alice", offset, next(t))
        pending = orch.start_scrub(scrub.offset, scrub.nbytes)
        assert isinstance(o.exported(orch.export_for_travel(), next(t)), AwaitScrub)
        orch.finish_scrub(pending)
        depart = o.scrubbed(next(t))
        req = over_tls(depart.request)
        act = h.on_request(req, next(t))
        alice.import_context(act.blob)  # before the switch, as over a real link
        h.imported(next(t))
        gpu.switch(depart.holder)
        o.switched(next(t))
        copy = h.attached(next(t))
        alice.copy_to_vram(memoryview(data)[copy.dataset_offset : copy.dataset_offset + copy.nbytes],
                           copy.buffer_offset, buffer_bytes=copy.buffer_bytes)
        h.copied(copy.nbytes, next(t))
        h.switch_requested(next(t))
        reply = over_tls(h.exported(alice.export_context(), next(t)).message)
        o.holder_replied(reply, next(t))
        gpu.switch(ORCHESTRATOR)
        back = o.home(next(t))
        orch.start_rotation()
        orch.import_returned(back.blob)
        o.imported(next(t))
        orch.finish_rotation()
        verify = o.rotated(next(t))
        report = o.verified(chunk_digest(gpu.vram_at(verify.offset, verify.nbytes), PIECE), next(t))
        assert report.chunk.nbytes == min(buf.nbytes, len(data) - offset)
    assert gpu.core.epoch == 2 and gpu.core.stats.faults == []


# ============================================================================ regressions and known gaps
def test_travel_messages_do_not_print_the_context_blob() -> None:
    gpu = InProcessGpu()
    orch, _ = gpu.boot()
    blob = orch.export_for_travel()
    from gputravel.driver.context import unpack_context

    ctx = unpack_context(blob, layout=TEST_LAYOUT.digest())
    keys = [b for s in ctx.senders + ctx.receivers for b in (s.key, s.iv_mask)]
    o = orchestrator_sm()
    o.start("alice", 0, 0.0)
    o.exported(blob, 0.0)
    send = o.scrubbed(0.0)
    chunk = ChunkInfo(0, PIECE, b"\x00" * 32)
    texts = [repr(send), repr(send.request), repr(TravelResult(1, blob, chunk, {}, -1)),
             repr(TravelRefused(1, blob, "no", {})), repr(RotateAndImport(blob)), repr(ImportBlob(blob))]
    for text in texts:
        assert not leaks(text, keys), text[:80]


def test_a_context_exported_again_after_the_scrub_is_the_one_that_travels() -> None:
    o = orchestrator_sm()
    o.start("alice", 0, 0.0)
    o.exported(BLOB, 0.25)
    depart = o.scrubbed(0.5, reexported=b"\x05fresh")
    assert depart.request.context == b"\x05fresh"


def test_a_gpu_that_never_comes_is_a_refusal_that_still_returns_the_context() -> None:
    o, h = orchestrator_sm(), holder_sm()
    h.on_request(go_away(o), 1.0)
    h.imported(1.5)
    assert h.attach_failed("PeerTimeout: the host never said", 11.5) == SwitchBack()
    assert h.switch_requested(11.5) == ExportBlob()  # it imported the context: pack it again
    refused = h.exported(b"\x04repacked", 11.75).message
    assert isinstance(refused, TravelRefused) and refused.context == b"\x04repacked"
    assert "never said" in refused.reason and refused.steps_ns["dh_switch"] == 10_000_000_000

    req = TravelRequest(9, BUFFER.offset, BUFFER.nbytes, len(DATASET), BLOB)  # refused on sight
    assert h.on_request(req, 20.0) == HolderAwaitGpu()
    assert h.attach_failed("PeerTimeout", 30.0) == SwitchBack()
    refused = h.switch_requested(30.0).message  # never imported: the untouched context goes back
    assert isinstance(refused, TravelRefused) and refused.context == BLOB and "outside" in refused.reason
