"""Context blobs: they carry the user channel's keys and IV state from CVM to CVM.

A blob must continue the channel exactly where it was exported, and anything else (corrupted,
truncated, from another epoch or layout, with other keys or rolled-back counters) must be
refused with ContextBlobError, before any field is trusted and without echoing a key.
"""

from __future__ import annotations

import pytest
from msgspec import structs

from gputravel.driver.context import CONTEXT_VERSION, DriverContext, SealedContext, pack_context, unpack_context
from gputravel.protocol.codec import decode
from gputravel.driver.driver import Driver
from gputravel.errors import ContextBlobError, GputravelError
from gputravel.protocol.layout import Layout, PushChannel
from gputravel.crypto.labels import KERNEL_LABELS, KEYS, USER_LABELS, Direction, Privilege, direction_of, is_h2d
from gputravel.protocol.push import SemaphoreRelease
from gputravel.testing import ORCHESTRATOR, TEST_LAYOUT, InProcessGpu, leaks

RECORD = TEST_LAYOUT.record_bytes
DIGEST = TEST_LAYOUT.digest()


@pytest.fixture
def gpu() -> InProcessGpu:
    return InProcessGpu()


@pytest.fixture
def booted(gpu: InProcessGpu):
    orch, holders = gpu.boot("alice", "bob")
    buf = orch.alloc_dataset_buffer(4 * RECORD)
    return gpu, orch, holders, buf


def ctx_of(blob: bytes) -> DriverContext:
    return unpack_context(blob, layout=DIGEST)


def states(ctx: DriverContext):
    return ctx.senders + ctx.receivers


def secrets_of(ctx: DriverContext) -> list[bytes]:
    return [b for s in states(ctx) for b in (s.key, s.iv_mask)]


def with_state(ctx: DriverContext, label: str, **changes) -> DriverContext:
    """A copy of ``ctx`` where the channel state ``label`` has ``changes``."""
    def edit(group):
        return tuple(structs.replace(s, **changes) if s.label == label else s for s in group)

    return structs.replace(ctx, senders=edit(ctx.senders), receivers=edit(ctx.receivers))


@pytest.fixture
def away(booted):
    """One full travel done (so every counter has moved), then a second one: the orchestrator
    exported ``sent``, bob imported it, copied, and exported ``returned``; GPU is back home."""
    gpu, orch, holders, buf = booted
    gpu.travel(holders["alice"], b"\x01" * (2 * RECORD), buf)
    # The orchestrator uses its user channel too (a push and an RPC, no data: a copy would
    # spend the epoch, driver/epochs.py), so every counter but the copy engine's moves.
    value = orch.next_release(PushChannel.USER)
    orch.submit(PushChannel.USER, SemaphoreRelease(release=value, interrupt=True))
    orch.wait_release(PushChannel.USER, value)
    orch.query_buffer(buf.offset)
    sent = orch.export_for_travel()
    gpu.switch("bob")
    holders["bob"].import_context(sent)
    holders["bob"].copy_to_vram(memoryview(b"\x02" * RECORD), buf.offset, buffer_bytes=buf.nbytes)
    returned = holders["bob"].export_context()
    gpu.switch(ORCHESTRATOR)
    return gpu, orch, holders, buf, sent, returned


# ============================================================================ round trips
def test_import_then_export_reproduces_the_context(booted) -> None:
    gpu, orch, holders, buf = booted
    blob = orch.export_for_travel()
    gpu.switch("alice")
    ctx = holders["alice"].import_context(blob)
    assert ctx == ctx_of(blob)
    assert ctx.version == CONTEXT_VERSION and ctx.layout == DIGEST and ctx.epoch == 0
    assert sorted(s.label for s in states(ctx)) == sorted(USER_LABELS)
    assert ctx_of(holders["alice"].export_context()) == ctx  # nothing used, nothing moved


def test_context_continues_the_stream_exactly_across_cvms(booted) -> None:
    """orchestrator -> alice -> bob -> orchestrator, a push accepted at every stop."""
    gpu, orch, holders, buf = booted
    blob = orch.export_for_travel()
    for i, name in enumerate(["alice", "bob"]):
        gpu.switch(name)
        holders[name].import_context(blob)
        data = bytes([i + 1]) * (RECORD + 7)
        holders[name].copy_to_vram(memoryview(data), buf.offset, buffer_bytes=buf.nbytes)
        assert gpu.vram_at(buf.offset, len(data)) == data
        assert holders[name].query_buffer(buf.offset).nbytes == buf.nbytes  # RPC queue continues too
        blob = holders[name].export_context()
    gpu.switch(ORCHESTRATOR)
    back = orch.import_returned(blob)
    assert back.semaphore == 4 and back.gpfifo_put == 4
    orch.rotate()
    assert not gpu.core.faulted(PushChannel.USER)
    assert gpu.core.stats.faults == []


def test_untouched_blob_can_come_straight_back(booted) -> None:
    gpu, orch, holders, buf = booted
    blob = orch.export_for_travel()
    assert orch.away
    orch.import_returned(blob)  # a holder that refused returns the context as it got it
    assert not orch.away
    assert orch.rotate() == 1
    gpu.travel(holders["alice"], b"\x07" * RECORD, buf)
    assert gpu.vram_at(buf.offset, RECORD) == b"\x07" * RECORD


def test_exporting_drops_the_keys(booted) -> None:
    gpu, orch, holders, buf = booted
    orch.export_for_travel()
    assert not orch.has_context
    assert not set(orch.keys.tx) & set(USER_LABELS) and not set(orch.keys.rx) & set(USER_LABELS)
    assert set(orch.keys.tx) | set(orch.keys.rx) == set(KERNEL_LABELS)  # the kernel channel stays


# ============================================================================ corruption
def test_every_single_byte_corruption_is_refused(booted) -> None:
    gpu, orch, holders, buf = booted
    blob = orch.export_for_travel()
    alice = holders["alice"]
    for i in range(len(blob)):
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(blob)
            bad[i] ^= mask
            with pytest.raises(ContextBlobError):
                alice.import_context(bytes(bad))
            assert not alice.has_context
    alice.import_context(blob)  # the genuine one still works afterwards
    assert alice.has_context


def test_truncated_or_extended_blob_is_refused(booted) -> None:
    gpu, orch, holders, buf = booted
    blob = orch.export_for_travel()
    for n in range(len(blob)):
        with pytest.raises(ContextBlobError):
            holders["alice"].import_context(blob[:n])
    for tail in (b"\x00", b"\xc0", blob):
        with pytest.raises(ContextBlobError):
            holders["alice"].import_context(blob + tail)
    for junk in (b"", b"not msgpack at all", b"\x80"):
        with pytest.raises(ContextBlobError):
            holders["alice"].import_context(junk)


def test_corrupted_returned_blob_leaves_the_orchestrator_waiting(away) -> None:
    gpu, orch, holders, buf, sent, returned = away
    bad = bytearray(returned)
    bad[len(bad) // 2] ^= 0x10
    with pytest.raises(ContextBlobError):
        orch.import_returned(bytes(bad))
    assert orch.away  # still waiting for a good one
    orch.import_returned(returned)
    orch.rotate()


# ============================================================================ validation
def test_blob_from_another_epoch_is_refused_by_import_returned(booted) -> None:
    gpu, orch, holders, buf = booted
    old = orch.export_for_travel()  # epoch 0
    orch.import_returned(old)
    orch.rotate()
    orch.export_for_travel()  # epoch 1 is away now
    with pytest.raises(ContextBlobError, match="epoch") as err:
        orch.import_returned(old)
    assert "0" in str(err.value) and "1" in str(err.value)
    assert orch.away


@pytest.mark.parametrize("field", ["key", "iv_mask"])
@pytest.mark.parametrize("label", USER_LABELS)
def test_returned_blob_with_other_key_bytes_is_refused(away, label: str, field: str) -> None:
    gpu, orch, holders, buf, sent, returned = away
    state = next(s for s in states(ctx_of(returned)) if s.label == label)
    other = bytes(b ^ 0x5A for b in getattr(state, field))
    forged = pack_context(with_state(ctx_of(returned), label, **{field: other}))
    with pytest.raises(ContextBlobError, match="keys"):
        orch.import_returned(forged)
    assert orch.away


@pytest.mark.parametrize("label", USER_LABELS)
def test_returned_blob_with_a_missing_channel_is_refused(away, label: str) -> None:
    gpu, orch, holders, buf, sent, returned = away
    ctx = ctx_of(returned)
    fewer = structs.replace(
        ctx,
        senders=tuple(s for s in ctx.senders if s.label != label),
        receivers=tuple(s for s in ctx.receivers if s.label != label),
    )
    with pytest.raises(ContextBlobError):
        orch.import_returned(pack_context(fewer))
    with pytest.raises(ContextBlobError):
        holders["alice"].import_context(pack_context(fewer))


def test_blob_smuggling_an_extra_kernel_channel_is_refused(away) -> None:
    gpu, orch, holders, buf, sent, returned = away
    ctx = ctx_of(returned)
    extra = structs.replace(ctx.senders[0], label="Lwlc_h2d_kernel")
    smuggled = structs.replace(ctx, senders=ctx.senders + (extra,))
    with pytest.raises(ContextBlobError):
        orch.import_returned(pack_context(smuggled))
    with pytest.raises(ContextBlobError):
        holders["alice"].import_context(pack_context(smuggled))


def test_every_key_label_names_its_own_record() -> None:
    """The label strings are HKDF inputs and never change; their records say the same thing."""
    for label, key in KEYS.items():
        assert label == key.label == f"L{key.keyspace}_{key.direction.value}_{key.privilege.value}"
    assert USER_LABELS == tuple(k for k in KEYS if KEYS[k].privilege is Privilege.USER)
    assert KERNEL_LABELS == ("Lwlc_h2d_kernel", "Llcic_d2h_kernel")
    assert [is_h2d(k) for k in USER_LABELS] == [True, False, True, False, True, False]
    assert direction_of("Lce00_d2h_user") is Direction.D2H and direction_of("Lfoo_h2d_user") is None
    with pytest.raises(KeyError):
        is_h2d("Lfoo_h2d_user")  # a key is never installed on a guessed side


def test_a_channel_on_the_wrong_side_is_refused(away) -> None:
    gpu, orch, holders, buf, sent, returned = away
    ctx = ctx_of(returned)
    swapped = structs.replace(ctx, senders=ctx.senders[:-1] + ctx.receivers[:1],
                              receivers=ctx.receivers[1:] + ctx.senders[-1:])
    with pytest.raises(ContextBlobError, match="wrong side"):
        ctx_of(pack_context(swapped))
    with pytest.raises(ContextBlobError, match="wrong side"):
        orch.import_returned(pack_context(swapped))
    with pytest.raises(ContextBlobError, match="wrong side"):
        holders["alice"].import_context(pack_context(swapped))


def test_a_channel_this_build_does_not_derive_is_refused_by_both_importers(away) -> None:
    gpu, orch, holders, buf, sent, returned = away
    ctx = ctx_of(returned)
    for stranger in ("Lfoo_h2d_user", "Lfoo_d2h_user"):  # what the label seems to say counts for nothing
        renamed = structs.replace(ctx, senders=(structs.replace(ctx.senders[0], label=stranger),) + ctx.senders[1:])
        with pytest.raises(ContextBlobError):
            orch.import_returned(pack_context(renamed))
        with pytest.raises(ContextBlobError):
            holders["alice"].import_context(pack_context(renamed))


#: Labels whose message counters moved before the export (the copy engine's move only with
#: copies, which the orchestrator may not make in an epoch it exports).
MOVED = tuple(label for label in USER_LABELS if KEYS[label].keyspace != "ce00")


@pytest.mark.parametrize("label", MOVED)
def test_returned_blob_with_counters_rolled_back_is_refused(away, label: str) -> None:
    gpu, orch, holders, buf, sent, returned = away
    was = next(s for s in states(ctx_of(sent)) if s.label == label)
    assert was.message_counter > 0  # the first travel and the orchestrator's own push moved it
    rolled = pack_context(with_state(ctx_of(returned), label, message_counter=was.message_counter - 1))
    with pytest.raises(ContextBlobError, match="stale"):
        orch.import_returned(rolled)
    assert orch.away


@pytest.mark.parametrize("label", USER_LABELS)
@pytest.mark.parametrize("delta", [-1, 1, 1 << 20])
def test_returned_blob_with_a_channel_counter_moved_either_way_is_refused(away, label: str, delta: int) -> None:
    """A holder that moves a channel counter forward would put the orchestrator's IVs out of
    step with the device for good (every later travel faults): refused, as a rollback is."""
    gpu, orch, holders, buf, sent, returned = away
    was = next(s for s in states(ctx_of(returned)) if s.label == label)
    moved = pack_context(with_state(ctx_of(returned), label, channel_counter=was.channel_counter + delta))
    with pytest.raises(ContextBlobError, match="channel counter changed"):
        orch.import_returned(moved)
    assert orch.away


@pytest.mark.parametrize("field", ["semaphore", "rpc_tx_seq"])
def test_returned_blob_with_semaphore_or_rpc_moved_too_far_is_refused(away, field: str) -> None:
    gpu, orch, holders, buf, sent, returned = away
    far = pack_context(structs.replace(ctx_of(returned), **{field: getattr(ctx_of(sent), field) + (1 << 40)}))
    with pytest.raises(ContextBlobError, match="too far"):
        orch.import_returned(far)


@pytest.mark.parametrize("field", ["semaphore", "rpc_tx_seq"])
def test_returned_blob_with_semaphore_or_rpc_rolled_back_is_refused(away, field: str) -> None:
    gpu, orch, holders, buf, sent, returned = away
    was = getattr(ctx_of(sent), field)
    assert was > 0
    rolled = pack_context(structs.replace(ctx_of(returned), **{field: was - 1}))
    with pytest.raises(ContextBlobError, match="stale"):
        orch.import_returned(rolled)


def test_returned_blob_equal_to_the_sent_one_is_accepted(away) -> None:
    """Counters may stay where they were (a refusing holder); only going backwards is refused."""
    gpu, orch, holders, buf, sent, returned = away
    assert orch.import_returned(sent) == ctx_of(sent)
    assert orch.rotate() == 2  # the device is ahead of `sent`: rotation resets the IVs


def test_blob_for_another_layout_is_refused(booted) -> None:
    gpu, orch, holders, buf = booted
    blob = orch.export_for_travel()
    other = InProcessGpu(Layout(record_bytes=2 * RECORD, staging_slots=4, gpfifo_entries=16))
    stranger = Driver(other.add_cvm("stranger"), clock=other.clock)
    with pytest.raises(ContextBlobError, match="layout"):
        stranger.import_context(blob)
    relabelled = pack_context(structs.replace(ctx_of(blob), layout=other.layout.digest()))
    with pytest.raises(ContextBlobError, match="layout"):
        holders["alice"].import_context(relabelled)
    with pytest.raises(ContextBlobError, match="layout"):
        orch.import_returned(relabelled)


def test_blob_of_another_version_is_refused(booted) -> None:
    gpu, orch, holders, buf = booted
    blob = orch.export_for_travel()
    future = pack_context(structs.replace(ctx_of(blob), version=CONTEXT_VERSION + 1))
    with pytest.raises(ContextBlobError, match="version"):
        holders["alice"].import_context(future)


def test_blob_with_another_work_token_is_refused_and_changes_nothing(away) -> None:
    gpu, orch, holders, buf, sent, returned = away
    ctx = ctx_of(returned)
    forged = pack_context(structs.replace(ctx, work_token=ctx.work_token ^ 0x2))
    with pytest.raises(ContextBlobError, match="token"):
        holders["alice"].import_context(forged)
    assert not holders["alice"].has_context
    with pytest.raises(ContextBlobError, match="token"):
        orch.import_returned(forged)
    assert orch.away and not orch.has_context
    orch.import_returned(returned)  # the genuine blob still brings everything home
    orch.rotate()
    gpu.travel(holders["alice"], b"\x0b" * RECORD, buf)
    assert gpu.vram_at(buf.offset, RECORD) == b"\x0b" * RECORD


# ============================================================================ secrets stay out of text
def test_repr_of_a_context_shows_no_key_bytes(booted) -> None:
    gpu, orch, holders, buf = booted
    ctx = ctx_of(orch.export_for_travel())
    secrets = secrets_of(ctx)
    assert len(secrets) == 2 * len(USER_LABELS)
    texts = [repr(ctx), str(ctx), f"{ctx!r}", f"{ctx}", repr([ctx]), repr({"ctx": ctx})]
    texts += [repr(s) for s in states(ctx)]
    for text in texts:
        assert not leaks(text, secrets), text
    # The sealed blob's body is the encoded context, keys and all.
    blob = pack_context(ctx)
    sealed = decode(blob)
    assert isinstance(sealed, SealedContext) and leaks(blob.hex(), secrets)
    for text in (repr(sealed), str(sealed), repr([sealed])):
        assert not leaks(text, secrets), text
    # Control: the check would catch a key dumped the way a default dataclass repr does.
    assert leaks(repr(ctx.senders[0].key), secrets)
    assert leaks(ctx.senders[0].key.hex(), secrets)


def test_error_messages_show_no_key_bytes(away) -> None:
    gpu, orch, holders, buf, sent, returned = away
    ctx = ctx_of(returned)
    secrets = secrets_of(ctx)
    alien_key = bytes(b ^ 0x5A for b in ctx.senders[0].key)
    secrets.append(alien_key)
    bad_blobs = [
        returned[:-3],
        returned[: len(returned) // 2] + bytes([returned[len(returned) // 2] ^ 1]) + returned[len(returned) // 2 + 1 :],
        pack_context(with_state(ctx, ctx.senders[0].label, key=alien_key)),
        pack_context(with_state(ctx, ctx.receivers[0].label, channel_counter=0)),
        pack_context(structs.replace(ctx, layout="0" * 16)),
        pack_context(structs.replace(ctx, version=99)),
        pack_context(structs.replace(ctx, epoch=ctx.epoch + 1)),
        pack_context(structs.replace(ctx, senders=ctx.senders[1:])),
    ]
    messages = []
    for blob in bad_blobs:
        with pytest.raises(ContextBlobError) as err:
            orch.import_returned(blob)
        messages += [str(err.value), repr(err.value), *map(str, err.value.args)]
        try:  # a holder cannot check keys, counters or epoch: only some of these fail there
            holders["alice"].import_context(blob)
        except ContextBlobError as exc:
            messages += [str(exc), repr(exc)]
    assert len(messages) > 3 * len(bad_blobs)
    for text in messages:
        assert not leaks(text, secrets), text


# ============================================================================ exported during the scrub
def test_a_context_exported_during_the_scrub_travels_on_when_the_device_stayed_put(booted) -> None:
    gpu, orch, holders, buf = booted
    pending = orch.start_scrub(buf.offset, buf.nbytes)
    sent = orch.export_for_travel()  # the device may still be scrubbing: the context is the user channel's
    orch.finish_scrub(pending)
    gpu.switch("alice")
    holders["alice"].import_context(sent)
    holders["alice"].copy_to_vram(memoryview(b"\x07" * RECORD), buf.offset, buffer_bytes=buf.nbytes)
    back = holders["alice"].export_context()
    gpu.switch(ORCHESTRATOR)
    orch.import_returned(back)
    orch.rotate()
    assert gpu.vram_at(buf.offset, RECORD) == b"\x07" * RECORD


@pytest.mark.parametrize("where", ["rpc", "gpfifo"])
def test_a_context_exported_during_the_scrub_is_exported_again_if_the_user_channel_moved(booted, where: str) -> None:
    """If anything moved the user channel between the export and the scrub's confirmation,
    the exported context no longer matches the device: a fresh one, continuing from where
    the device is, must travel instead (as if the scrub had come first)."""
    from gputravel.protocol.layout import U32, Bar0

    gpu, orch, holders, buf = booted
    pending = orch.start_scrub(buf.offset, buf.nbytes)
    first = ctx_of(orch.export_for_travel())
    reg = Bar0.RPC_GET if where == "rpc" else Bar0.get(PushChannel.USER)
    moved = U32.unpack_from(gpu.bar, reg)[0] + 1
    U32.pack_into(gpu.bar, reg, moved)  # the device ran something we did not submit
    fresh = ctx_of(orch.finish_scrub(pending))
    if where == "rpc":
        assert (fresh.rpc_tx_seq, fresh.rpc_rx_seq) == (moved, moved) != (first.rpc_tx_seq, first.rpc_rx_seq)
    else:
        assert fresh.gpfifo_put == moved != first.gpfifo_put
    assert secrets_of(fresh) == secrets_of(first) and fresh.epoch == first.epoch  # same keys, same stream
    assert orch.away  # and it is the fresh one that is expected back
    orch.import_returned(pack_context(fresh))
    orch.rotate()


def test_finish_scrub_returns_nothing_when_the_exported_context_still_holds(booted) -> None:
    gpu, orch, holders, buf = booted
    pending = orch.start_scrub(buf.offset, buf.nbytes)
    orch.export_for_travel()
    assert orch.finish_scrub(pending) is None


# ============================================================================ imported while the device rotates
def test_the_returned_context_is_imported_while_the_device_rotates(away) -> None:
    gpu, orch, holders, buf, sent, returned = away
    before = gpu.core.epoch
    epoch = orch.start_rotation()
    orch.import_returned(returned)  # checked against the epoch it left with, not the new one
    assert orch.finish_rotation() == epoch == before + 1 == gpu.core.epoch
    orch.copy_to_vram(memoryview(b"\x09" * RECORD), buf.offset, buffer_bytes=buf.nbytes)  # new keys work
    assert gpu.vram_at(buf.offset, RECORD) == b"\x09" * RECORD
    bob = holders["bob"]  # and the holder's kept ones do not
    bob.import_context(returned)
    gpu.switch("bob")
    with pytest.raises(GputravelError):
        bob.copy_to_vram(memoryview(b"\x0a" * RECORD), buf.offset, buffer_bytes=buf.nbytes, timeout=0.5)
    gpu.switch(ORCHESTRATOR)


def test_a_bad_returned_context_during_a_rotation_still_ends_in_the_new_epoch(away) -> None:
    gpu, orch, holders, buf, sent, returned = away
    orch.start_rotation()
    with pytest.raises(ContextBlobError):
        orch.import_returned(returned[:-1] + bytes([returned[-1] ^ 1]))
    assert orch.away and orch.rotating
    orch.finish_rotation()  # takes back what it exported, installs the new epoch
    assert not orch.away and not orch.rotating and orch.key_epoch == gpu.core.epoch
    orch.copy_to_vram(memoryview(b"\x0b" * RECORD), buf.offset, buffer_bytes=buf.nbytes)
    assert gpu.vram_at(buf.offset, RECORD) == b"\x0b" * RECORD


def test_rotations_do_not_overlap(booted) -> None:
    from gputravel.errors import IllegalTransition

    gpu, orch, holders, buf = booted
    with pytest.raises(IllegalTransition, match="not-rotating"):
        orch.finish_rotation()
    orch.start_rotation()
    with pytest.raises(IllegalTransition, match="rotating"):
        orch.start_rotation()
    with pytest.raises(IllegalTransition, match="rotating"):
        orch.rotate()
    orch.finish_rotation()
    orch.rotate()
