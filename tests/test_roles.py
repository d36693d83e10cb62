"""The travel roles (sans-IO): OrchestratorTravel and HolderTravel paired in memory.

No IO and no clocks: every event gets ``now`` from the test, so step timings are exact.
Messages between the two go through the wire codec, as they would over TLS. The machines'
own rules (the transition table, the error phase, abort, deadlines) are in
test_travel_machines.py.
"""

from __future__ import annotations

import hashlib

import pytest

from gputravel.errors import BadInput, IllegalTransition, ProtocolError
from gputravel.holder import steps as hs
from gputravel.holder.machine import HolderPhase, HolderTravel
from gputravel.orchestrator import machine as om
from gputravel.orchestrator.machine import Buffer, OrchestratorTravel, Phase
from gputravel.protocol.codec import decode, encode
from gputravel.protocol.control import STEPS, TravelReport
from gputravel.protocol.manifest import chunk_digest, chunk_digest_from_manifest, piece_digests
from gputravel.protocol.travel import ChunkInfo, HolderHello, TravelRefused, TravelRequest, TravelResult
from gputravel.testing import ORCHESTRATOR, TEST_LAYOUT, InProcessGpu, leaks

PIECE = 4096
BUFFER = Buffer(offset=0x2000, nbytes=4 * PIECE)
BLOB = b"\x01context-blob\xfe" * 4
DATASET = bytes((i * 31 + 7) % 256 for i in range(10 * PIECE))  # 2.5 buffers: last chunk is short


def over_tls(msg):
    return decode(encode(msg))


def hello(name: str = "alice", data: bytes = DATASET, piece: int = PIECE) -> HolderHello:
    return HolderHello(name, len(data), piece, piece_digests(data, piece), "", "", 0, 0, True, bytes(32))


def holder_sm(name: str = "alice", data: bytes = DATASET, audit: bool = False) -> HolderTravel:
    """A holder that attested the orchestrator at time 0, under a policy that never expires here."""
    h = HolderTravel(name, len(data), piece_digests(data, PIECE), PIECE, audit_arrival=audit)
    h.handle(hs.Attest(joining=False), 0.0)
    h.handle(hs.Attested(valid_s=1e9), 0.0)
    return h


def orchestrator_sm(*hellos: HolderHello) -> OrchestratorTravel:
    sm = OrchestratorTravel(BUFFER)
    for h in hellos or (hello(),):
        sm.enrol(h)
    return sm


def go_away(o: OrchestratorTravel, holder: str = "alice", offset: int = 0, blob: bytes = BLOB) -> TravelRequest:
    o.handle(om.Start(holder, offset), 0.0)
    o.handle(om.ScrubStarted(7), 0.0)
    o.handle(om.Exported(blob), 0.25)
    o.handle(om.Scrubbed(), 0.5)
    req = o.handle(om.SwitchAsked(), 0.5).request
    o.handle(om.RequestSent(), 0.5)
    o.handle(om.Switched(), 0.75)
    return over_tls(req)


def come_home(o: OrchestratorTravel, result: TravelResult | TravelRefused):
    o.handle(om.Replied(result), 3.0)
    o.handle(om.Home(), 3.125)
    o.handle(om.RotationStarted(), 3.125)
    o.handle(om.Imported(), 3.375)
    return o.handle(om.Rotated(), 3.5)


def serve(h: HolderTravel, req: TravelRequest, returned: bytes = b"\x02returned") -> TravelResult | TravelRefused:
    act = h.handle(hs.Request(req), 100.125)
    if isinstance(act, hs.ImportBlob):
        h.handle(hs.Imported(), 100.25)
        check = h.handle(hs.Attached(), 100.375)
        copy = h.handle(hs.Granted(req.buffer_bytes), 100.375)
        assert check == hs.CheckBuffer(req.buffer_offset)
        h.handle(hs.Copied(copy.nbytes), 101.25)
        h.handle(hs.SwitchAsked(), 101.375)
        reply = h.handle(hs.Exported(returned), 101.625)
    else:
        assert h.handle(hs.Attached(), 100.375) == hs.SwitchBack()
        reply = h.handle(hs.SwitchAsked(), 101.625)
    h.handle(hs.Replied(), 101.625)
    h.handle(hs.SwitchedHome(), 101.75)
    return over_tls(reply.message)


# ============================================================================ a whole travel
def test_a_travel_end_to_end_with_exact_timings() -> None:
    o, h = orchestrator_sm(), holder_sm()

    assert o.handle(om.Start("alice", 0), 0.0) == om.StartScrub(BUFFER.offset, BUFFER.nbytes)
    assert o.phase is Phase.CLEANUP
    assert o.handle(om.ScrubStarted(7), 0.0) == om.ExportContext()  # the context is packed while the device scrubs
    assert o.handle(om.Exported(BLOB), 0.25) == om.AwaitScrub(7)
    assert o.phase is Phase.SCRUB
    assert o.handle(om.Scrubbed(), 0.5) == om.SwitchTo("alice")  # the MUX switches while the request goes out
    assert o.phase is Phase.DEPART
    send = o.handle(om.SwitchAsked(), 0.5)
    assert isinstance(send, om.SendRequest) and send.holder == "alice"
    req = over_tls(send.request)
    assert req == TravelRequest(1, BUFFER.offset, BUFFER.nbytes, 0, BLOB)
    assert o.handle(om.RequestSent(), 0.5) == om.AwaitSwitch("alice")
    assert o.handle(om.Switched(), 0.75) == om.AwaitReply("alice")
    assert o.phase is Phase.AWAY

    act = h.handle(hs.Request(req), 100.125)
    assert act == hs.ImportBlob(BLOB)
    assert h.handle(hs.Imported(), 100.25) == hs.AwaitGpu()  # imported while the MUX switches; now wait for it
    assert h.phase is HolderPhase.ATTACH
    assert h.handle(hs.Attached(), 100.375) == hs.CheckBuffer(BUFFER.offset)
    copy = h.handle(hs.Granted(BUFFER.nbytes), 100.375)
    assert copy == hs.CopyChunk(BUFFER.offset, BUFFER.nbytes, 0, BUFFER.nbytes, BUFFER.nbytes)
    assert h.handle(hs.Copied(copy.nbytes), 101.25) == hs.SwitchBack()  # done with the device: the GPU goes home first
    assert h.handle(hs.SwitchAsked(), 101.375) == hs.ExportBlob()  # and the context is packed while it switches
    reply = h.handle(hs.Exported(b"\x02returned"), 101.625)
    assert isinstance(reply, hs.Reply) and h.phase is HolderPhase.REPLY
    assert h.handle(hs.Replied(), 101.625) == hs.AwaitSwitchHome()  # replied before the switch home is done
    assert h.handle(hs.SwitchedHome(), 102.0) is None and h.phase is HolderPhase.IDLE
    result = over_tls(reply.message)
    assert isinstance(result, TravelResult)
    assert result.steps_ns == {"dh_import": 125_000_000, "dh_switch": 125_000_000, "dh_copy": 875_000_000,
                               "dh_export": 250_000_000, "handler": 1_500_000_000}
    assert result.chunk == ChunkInfo(0, BUFFER.nbytes, chunk_digest(DATASET[: BUFFER.nbytes], PIECE))
    assert result.nonzero_on_arrival == -1 and result.context == b"\x02returned"

    assert o.handle(om.Replied(result), 3.0) == om.AwaitGpu()
    assert o.handle(om.Home(), 3.125) == om.StartRotation()  # the device rotates while we import
    assert o.handle(om.RotationStarted(), 3.125) == om.ImportContext("alice", b"\x02returned")
    assert o.handle(om.Imported(), 3.375) == om.AwaitRotation()
    verify = o.handle(om.Rotated(), 3.5)
    assert verify == om.VerifyChunk(BUFFER.offset, BUFFER.nbytes, PIECE)
    report = o.handle(om.Verified(chunk_digest(DATASET[: BUFFER.nbytes], PIECE)), 4.0)
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
        report = o.handle(om.Verified(chunk_digest(want, PIECE)), 4.0)
        sizes.append(report.chunk.nbytes)
    assert sizes == [4 * PIECE, 4 * PIECE, 2 * PIECE]


def test_arrival_audit_is_reported() -> None:
    o, h = orchestrator_sm(), holder_sm(audit=True)
    h.handle(hs.Request(go_away(o)), 10.0)
    h.handle(hs.Imported(), 10.0)
    assert h.handle(hs.Attached(), 10.0) == hs.AuditArrival(BUFFER.offset, BUFFER.nbytes)  # before anything is copied
    assert h.handle(hs.Audited(0), 10.0) == hs.CheckBuffer(BUFFER.offset)
    h.handle(hs.Granted(BUFFER.nbytes), 10.0)
    h.handle(hs.Copied(BUFFER.nbytes), 10.0)
    h.handle(hs.SwitchAsked(), 10.0)
    assert h.handle(hs.Exported(b"x"), 10.0).message.nonzero_on_arrival == 0


def test_a_granted_buffer_smaller_than_the_request_is_refused_without_copying() -> None:
    o, h = orchestrator_sm(), holder_sm()
    h.handle(hs.Request(go_away(o)), 1.0)
    h.handle(hs.Imported(), 1.0)
    h.handle(hs.Attached(), 1.0)
    assert h.handle(hs.Granted(BUFFER.nbytes - PIECE), 1.5) == hs.SwitchBack()
    assert h.handle(hs.SwitchAsked(), 2.0) == hs.ExportBlob()
    refused = h.handle(hs.Exported(b"\x03back"), 2.0).message
    assert isinstance(refused, TravelRefused) and refused.context == b"\x03back"
    assert refused.reason == f"BadInput: the device buffer holds {BUFFER.nbytes - PIECE} bytes, the request claims {BUFFER.nbytes}"


# ============================================================================ illegal transitions
ORCHESTRATOR_EVENTS = {
    "scrubbed": om.Scrubbed(), "exported": om.Exported(BLOB), "switched": om.Switched(),
    "replied": om.Replied(TravelRefused(1, BLOB, "no", {})), "imported": om.Imported(), "home": om.Home(),
    "rotated": om.Rotated(), "verified": om.Verified(b"\x00" * 32),
}


@pytest.mark.parametrize("event", ORCHESTRATOR_EVENTS.values(), ids=ORCHESTRATOR_EVENTS)
def test_orchestrator_events_while_idle_are_illegal(event) -> None:
    o = orchestrator_sm()
    with pytest.raises(IllegalTransition) as err:
        o.handle(event, 1.0)
    assert err.value.state == "idle"
    assert o.phase is Phase.ERROR  # and it stays there until aborted
    o.abort()
    assert go_away(o).travel_id == 1


def at_cleanup(o: OrchestratorTravel) -> None:
    o.handle(om.Start("alice", 0), 0.0)


def at_scrub(o: OrchestratorTravel) -> None:
    at_cleanup(o)
    o.handle(om.ScrubStarted(7), 0.1)
    o.handle(om.Exported(BLOB), 0.25)


@pytest.mark.parametrize("walk, event, why", [
    (at_cleanup, om.Start("alice", 0), "one travel at a time"),
    (at_cleanup, om.Scrubbed(), "the context must be packed before the scrub is confirmed"),
    (at_cleanup, om.Switched(), "nothing asked of the MUX yet"),
    (at_scrub, om.Exported(BLOB), "exported twice"),
    (at_scrub, om.Switched(), "the request has not left"),
    (go_away, om.Home(), "the context is away: the GPU cannot be home yet"),
    (go_away, om.Rotated(), "the context is away"),
    (go_away, om.Imported(), "nothing came back"),
])
def test_orchestrator_out_of_order_and_double_events_are_illegal(walk, event, why) -> None:
    o = orchestrator_sm()
    walk(o)
    state = o.phase.value
    with pytest.raises(IllegalTransition) as err:
        o.handle(event, 1.1)
    assert "orchestrator" in str(err.value) and state in str(err.value), why
    assert o.phase is Phase.ERROR


HOLDER_EVENTS = {
    "imported": hs.Imported(), "attached": hs.Attached(), "failed": hs.StepFailed("boom"), "copied": hs.Copied(PIECE),
    "audited": hs.Audited(0), "granted": hs.Granted(PIECE), "exported": hs.Exported(BLOB),
    "switch_asked": hs.SwitchAsked(), "replied": hs.Replied(), "switched_home": hs.SwitchedHome(),
}


@pytest.mark.parametrize("event", HOLDER_EVENTS.values(), ids=HOLDER_EVENTS)
def test_holder_events_while_idle_are_illegal(event) -> None:
    h = holder_sm()
    with pytest.raises(IllegalTransition) as err:
        h.handle(event, 1.0)
    assert err.value.state == "idle" and "holder alice" in str(err.value)
    assert h.phase is HolderPhase.ERROR


@pytest.mark.parametrize("steps, event, why", [
    (1, hs.Request(TravelRequest(1, BUFFER.offset, BUFFER.nbytes, 0, BLOB)), "one request at a time"),
    (1, hs.Copied(PIECE), "before importing"),
    (2, hs.Copied(PIECE), "before the GPU is ours"),
    (3, hs.Exported(BLOB), "before the switch home is asked for"),
])
def test_holder_takes_one_request_at_a_time(steps: int, event, why: str) -> None:
    o, h = orchestrator_sm(), holder_sm()
    walk = [hs.Request(go_away(o)), hs.Imported(), hs.Attached()]
    for e in walk[:steps]:
        h.handle(e, 1.0)
    with pytest.raises(IllegalTransition):
        h.handle(event, 1.0)
    assert h.phase is HolderPhase.ERROR, why


# ============================================================================ bad input
def test_start_for_an_unknown_holder_names_the_enrolled_ones() -> None:
    o = orchestrator_sm(hello("alice"), hello("bob"))
    with pytest.raises(BadInput, match=r"'carol'.*alice, bob"):
        o.handle(om.Start("carol", 0), 0.0)
    assert o.phase is Phase.ERROR
    with pytest.raises(BadInput, match="none"):
        OrchestratorTravel(BUFFER).handle(om.Start("alice", 0), 0.0)


def test_start_for_a_holder_with_an_empty_dataset_is_refused() -> None:
    o = orchestrator_sm(hello("empty", b""))
    with pytest.raises(BadInput, match="empty"):
        o.handle(om.Start("empty", 0), 0.0)
    assert o.phase is Phase.ERROR


@pytest.mark.parametrize("offset", [PIECE + 1, BUFFER.nbytes + 1, -BUFFER.nbytes, 3 * BUFFER.nbytes])
def test_start_at_an_offset_that_is_not_a_chunk_start_is_refused(offset: int) -> None:
    o = orchestrator_sm()
    with pytest.raises(BadInput, match="chunk start"):
        o.handle(om.Start("alice", offset), 0.0)
    assert o.phase is Phase.ERROR
    o.abort()  # as the runtime does: nothing had moved
    o.handle(om.Start("alice", 2 * BUFFER.nbytes), 0.0)  # the short last chunk is a chunk start


def test_a_chunk_may_start_at_any_piece_boundary() -> None:
    o = orchestrator_sm()
    assert o.handle(om.Start("alice", PIECE), 0.0).nbytes == BUFFER.nbytes


def test_enrolment_checks_piece_size_and_manifest_length() -> None:
    o = OrchestratorTravel(BUFFER)
    with pytest.raises(ProtocolError, match="piece size"):
        o.enrol(hello(piece=3 * PIECE))
    with pytest.raises(ProtocolError, match="piece size"):
        o.enrol(HolderHello("alice", len(DATASET), 0, (), "", "", 0, 0, True, bytes(32)))
    short = hello()
    with pytest.raises(ProtocolError, match="manifest"):
        o.enrol(HolderHello("alice", len(DATASET), PIECE, short.manifest[:-1], "", "", 0, 0, True, bytes(32)))
    for key in (b"", bytes(31), bytes(33)):  # the key of its entries in the public travel log: 32 bytes
        with pytest.raises(ProtocolError, match="travel-log key must be 32 bytes"):
            o.enrol(HolderHello("alice", len(DATASET), PIECE, short.manifest, "", "", 0, 0, True, key))
    assert o.holders == {}


def test_reply_to_another_travel_is_a_protocol_error() -> None:
    o, h = orchestrator_sm(), holder_sm()
    result = serve(h, go_away(o))
    stale = TravelResult(result.travel_id + 7, result.context, result.chunk, result.steps_ns, -1)
    with pytest.raises(ProtocolError, match="travel 8, expected 1"):
        o.handle(om.Replied(stale), 3.0)
    assert o.phase is Phase.ERROR
    with pytest.raises(IllegalTransition):  # the travel is over: not even the right reply is taken
        o.handle(om.Replied(result), 3.0)
    o.abort()
    assert go_away(o).travel_id == 2


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
        o.handle(om.Replied(TravelResult(result.travel_id, result.context, bad, result.steps_ns, -1)), 3.0)
    assert o.phase is Phase.ERROR


def test_holder_lying_about_its_data_is_caught_against_the_enrolled_manifest() -> None:
    """The holder enrolled one dataset and copies another: its chunk digest gives it away."""
    o = orchestrator_sm(hello("alice", DATASET))
    liar = holder_sm("alice", bytes(len(DATASET)))
    with pytest.raises(ProtocolError, match="manifest"):
        o.handle(om.Replied(serve(liar, go_away(o))), 3.0)


def test_verified_with_a_wrong_digest_is_a_protocol_error() -> None:
    o, h = orchestrator_sm(), holder_sm()
    come_home(o, serve(h, go_away(o)))
    wrong = chunk_digest(bytes(BUFFER.nbytes), PIECE)
    with pytest.raises(ProtocolError, match="VRAM does not hold"):
        o.handle(om.Verified(wrong), 4.0)
    assert o.phase is Phase.ERROR  # no report; the runtime recovers the GPU and aborts
    o.abort()
    o.handle(om.Start("alice", 0), 5.0)


def test_not_verifying_takes_the_holders_digest_without_a_read_back() -> None:
    o = OrchestratorTravel(BUFFER, verify=False)
    o.enrol(hello())
    report = come_home(o, serve(holder_sm(), go_away(o)))
    assert isinstance(report, TravelReport) and report.verify_ms == 0.0 and o.phase is Phase.IDLE


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
    act = h.handle(hs.Request(req), 7.0)
    assert act == hs.AwaitGpu()  # the context untouched; wait for the GPU, so the switch home comes after
    assert h.handle(hs.Attached(), 7.25) == hs.SwitchBack()  # and straight home, the GPU untouched
    reply = h.handle(hs.SwitchAsked(), 7.5)
    refused = reply.message
    assert isinstance(refused, TravelRefused)
    assert refused.travel_id == 4 and refused.context == BLOB
    assert refused.reason
    assert refused.steps_ns == {"dh_import": 0, "dh_switch": 250_000_000, "dh_copy": 0, "dh_export": 0,
                                "handler": 500_000_000}
    assert h.phase is HolderPhase.REPLY
    h.handle(hs.Replied(), 7.5)
    h.handle(hs.SwitchedHome(), 7.75)
    assert h.phase is HolderPhase.IDLE


def test_refused_travel_is_reported_without_a_chunk_or_verification() -> None:
    o = orchestrator_sm()
    req = go_away(o)
    refusal = over_tls(TravelRefused(req.travel_id, req.context, "disk on fire", {"handler": 500_000_000}))
    assert o.handle(om.Replied(refusal), 3.0) == om.AwaitGpu()
    assert o.handle(om.Home(), 3.125) == om.StartRotation()
    assert o.handle(om.RotationStarted(), 3.125) == om.ImportContext("alice", BLOB)
    o.handle(om.Imported(), 3.375)
    report = o.handle(om.Rotated(), 3.5)
    assert isinstance(report, TravelReport)
    assert report.refused == "disk on fire" and report.chunk is None and report.verify_ms == 0.0
    assert report.steps_ms["tls"] == 2000.0  # 2.5 s away (from the scrub), 0.5 s of it in the holder's handler
    assert report.total_ms == 3500.0
    assert o.phase is Phase.IDLE


def test_failed_copy_is_a_refusal_with_the_exported_context() -> None:
    o, h = orchestrator_sm(), holder_sm()
    h.handle(hs.Request(go_away(o)), 1.0)
    h.handle(hs.Imported(), 1.0)
    h.handle(hs.Attached(), 1.0)
    h.handle(hs.Granted(BUFFER.nbytes), 1.0)
    assert h.handle(hs.StepFailed("ChannelFaulted: user channel faulted"), 2.0) == hs.SwitchBack()
    assert h.handle(hs.SwitchAsked(), 2.0) == hs.ExportBlob()
    refused = h.handle(hs.Exported(b"\x03after-copy"), 2.0).message
    assert isinstance(refused, TravelRefused)
    assert refused.context == b"\x03after-copy"  # the channel moved on: the new context goes home
    assert "ChannelFaulted" in refused.reason


def test_a_context_that_will_not_import_goes_back_untouched() -> None:
    o, h = orchestrator_sm(), holder_sm()
    req = go_away(o)
    h.handle(hs.Request(req), 1.0)
    assert h.handle(hs.StepFailed("ContextBlobError: context blob is corrupted"), 1.25) == hs.AwaitGpu()
    assert h.handle(hs.Attached(), 1.5) == hs.SwitchBack()
    refused = h.handle(hs.SwitchAsked(), 1.75).message  # never imported: nothing to export
    assert isinstance(refused, TravelRefused) and refused.context == req.context and "corrupted" in refused.reason


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
    o.enrol(HolderHello("alice", len(data), PIECE, piece_digests(data, PIECE), "", "", 0, 0, True, bytes(32)))
    h = holder_sm("alice", data)
    alice, t = holders["alice"], iter(range(1000))
    for offset in range(0, len(data), buf.nbytes):
        scrub = o.handle(om.Start("alice", offset), next(t))
        assert o.handle(om.ScrubStarted(orch.start_scrub(scrub.offset, scrub.nbytes)), next(t)) == om.ExportContext()
        wait = o.handle(om.Exported(orch.export_for_travel()), next(t))
        switch = o.handle(om.Scrubbed(orch.finish_scrub(wait.release)), next(t))
        send = o.handle(om.SwitchAsked(), next(t))
        req = over_tls(send.request)
        o.handle(om.RequestSent(), next(t))
        act = h.handle(hs.Request(req), next(t))
        alice.import_context(act.blob)  # before the switch, as over a real link
        h.handle(hs.Imported(), next(t))
        gpu.switch(switch.holder)
        o.handle(om.Switched(), next(t))
        check = h.handle(hs.Attached(), next(t))
        copy = h.handle(hs.Granted(alice.query_buffer(check.buffer_offset).nbytes), next(t))
        alice.copy_to_vram(memoryview(data)[copy.dataset_offset : copy.dataset_offset + copy.nbytes],
                           copy.buffer_offset, buffer_bytes=copy.granted_bytes)
        h.handle(hs.Copied(copy.nbytes), next(t))
        h.handle(hs.SwitchAsked(), next(t))
        reply = over_tls(h.handle(hs.Exported(alice.export_context()), next(t)).message)
        h.handle(hs.Replied(), next(t))
        o.handle(om.Replied(reply), next(t))
        gpu.switch(ORCHESTRATOR)
        h.handle(hs.SwitchedHome(), next(t))
        o.handle(om.Home(), next(t))
        orch.start_rotation()
        back = o.handle(om.RotationStarted(), next(t))
        orch.import_returned(back.blob)
        o.handle(om.Imported(), next(t))
        orch.finish_rotation()
        verify = o.handle(om.Rotated(), next(t))
        report = o.handle(om.Verified(chunk_digest(gpu.vram_at(verify.offset, verify.nbytes), PIECE)), next(t))
        assert report.chunk.nbytes == min(buf.nbytes, len(data) - offset)
    assert gpu.core.epoch == 2 and gpu.core.stats.faults == []


# ============================================================================ regressions
def test_travel_messages_do_not_print_the_context_blob() -> None:
    gpu = InProcessGpu()
    orch, _ = gpu.boot()
    blob = orch.export_for_travel()
    from gputravel.driver.context import unpack_context

    ctx = unpack_context(blob, layout=TEST_LAYOUT.digest())
    keys = [b for s in ctx.senders + ctx.receivers for b in (s.key, s.iv_mask)]
    o = orchestrator_sm()
    o.handle(om.Start("alice", 0), 0.0)
    o.handle(om.ScrubStarted(7), 0.0)
    o.handle(om.Exported(blob), 0.0)
    o.handle(om.Scrubbed(), 0.0)
    send = o.handle(om.SwitchAsked(), 0.0)
    chunk = ChunkInfo(0, PIECE, b"\x00" * 32)
    texts = [repr(send), repr(send.request), repr(TravelResult(1, blob, chunk, {}, -1)),
             repr(TravelRefused(1, blob, "no", {})), repr(om.ImportContext("alice", blob)), repr(hs.ImportBlob(blob)),
             repr(om.Exported(blob)), repr(om.Scrubbed(blob)), repr(hs.Exported(blob)),
             repr(om.Replied(TravelResult(1, blob, chunk, {}, -1)))]
    for text in texts:
        assert not leaks(text, keys), text[:80]


def test_a_context_exported_again_after_the_scrub_is_the_one_that_travels() -> None:
    o = orchestrator_sm()
    o.handle(om.Start("alice", 0), 0.0)
    o.handle(om.ScrubStarted(7), 0.0)
    o.handle(om.Exported(BLOB), 0.25)
    o.handle(om.Scrubbed(reexported=b"\x05fresh"), 0.5)
    assert o.handle(om.SwitchAsked(), 0.5).request.context == b"\x05fresh"


def test_a_gpu_that_never_comes_is_a_refusal_that_still_returns_the_context() -> None:
    o, h = orchestrator_sm(), holder_sm()
    h.handle(hs.Request(go_away(o)), 1.0)
    h.handle(hs.Imported(), 1.5)
    assert h.handle(hs.StepFailed("PeerTimeout: the host never said"), 11.5) == hs.SwitchBack()
    assert h.handle(hs.SwitchAsked(), 11.5) == hs.ExportBlob()  # it imported the context: pack it again
    refused = h.handle(hs.Exported(b"\x04repacked"), 11.75).message
    assert isinstance(refused, TravelRefused) and refused.context == b"\x04repacked"
    assert "never came" in refused.reason and "never said" in refused.reason
    assert refused.steps_ns["dh_switch"] == 10_000_000_000
    h.handle(hs.Replied(), 11.75)
    h.handle(hs.SwitchedHome(), 12.0)

    req = TravelRequest(9, BUFFER.offset, BUFFER.nbytes, len(DATASET), BLOB)  # refused on sight
    assert h.handle(hs.Request(req), 20.0) == hs.AwaitGpu()
    assert h.next_deadline() == 50.0  # the device deadline (30 s by default)
    assert h.on_timeout(50.0) == hs.SwitchBack()  # the deadline passed: still a refusal
    refused = h.handle(hs.SwitchAsked(), 50.0).message  # never imported: the untouched context goes back
    assert isinstance(refused, TravelRefused) and refused.context == BLOB and "outside" in refused.reason
