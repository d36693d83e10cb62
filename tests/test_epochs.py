"""One key epoch's user keys reach one party (driver/epochs.py), whatever the host writes.

The ledger alone, then the orchestrator driver on the in-process harness: the invariant is
enforced where the keys live, so these tests drive the driver directly, as a runtime that
forgets a step (or swallows a failure) would.
"""

from __future__ import annotations

import pytest

from gputravel.driver.context import unpack_context
from gputravel.driver.epochs import EpochLedger, EpochUse
from gputravel.errors import EpochSpent, GputravelError, PeerTimeout, TravelHalted
from gputravel.protocol.layout import FAULT_REG, U32, Bar0, PushChannel
from gputravel.testing import ORCHESTRATOR, TEST_LAYOUT, InProcessGpu

RECORD = 64 * 1024


# ============================================================================ the ledger alone
def test_an_epoch_is_exported_once() -> None:
    ledger = EpochLedger()
    ledger.new_session()
    assert ledger.export() == 0
    with pytest.raises(EpochSpent, match="already exported"):
        ledger.export()
    ledger.rotated(1)
    assert ledger.export() == 1


def test_the_orchestrator_never_shares_an_epoch_with_a_holder() -> None:
    ledger = EpochLedger()
    ledger.new_session()
    ledger.use_for_copy()
    ledger.use_for_copy()  # its own copies, as often as it likes
    with pytest.raises(EpochSpent, match="used by the orchestrator"):
        ledger.export()
    ledger.rotated(1)
    ledger.export()
    with pytest.raises(EpochSpent, match="exported to a holder"):
        ledger.use_for_copy()


def test_epochs_only_move_forward() -> None:
    ledger = EpochLedger()
    ledger.new_session()
    ledger.rotated(3)
    for older in (3, 2, 0):
        with pytest.raises(EpochSpent):
            ledger.rotated(older)
    assert ledger.epoch == 3


@pytest.mark.parametrize("cleared_by", ["new session", "confirmed rotation"])
def test_a_halt_is_cleared_only_by_a_new_session_or_a_confirmed_rotation(cleared_by: str) -> None:
    ledger = EpochLedger()
    ledger.new_session()
    ledger.halt("the rotation was not confirmed")
    ledger.halt("a second reason does not replace the first")
    for act in (ledger.export, ledger.use_for_copy):
        with pytest.raises(TravelHalted, match="not confirmed"):
            act()
    assert not ledger.fresh
    if cleared_by == "new session":
        ledger.new_session()
        assert ledger.session == 2 and ledger.epoch == 0
    else:
        ledger.rotated(1)
        assert ledger.session == 1 and ledger.epoch == 1
    assert ledger.fresh and ledger.use is EpochUse.FRESH


# ============================================================================ the orchestrator driver
@pytest.fixture
def booted():
    gpu = InProcessGpu()
    orch, holders = gpu.boot("alice", "bob")
    buf = orch.alloc_dataset_buffer(4 * RECORD)
    return gpu, orch, holders, buf


def test_the_driver_refuses_to_export_an_epoch_twice(booted) -> None:
    gpu, orch, holders, buf = booted
    blob = orch.export_for_travel()
    orch.import_returned(blob)  # the holder refused, say: the keys came back untouched
    with pytest.raises(EpochSpent):
        orch.export_for_travel()  # a runtime that skips the rotation still cannot export them
    orch.rotate()
    orch.export_for_travel()


def test_a_baseline_copy_spends_the_epoch(booted) -> None:
    """The orchestrator's own copy (the TLS baseline) may not be followed by an export of the
    same epoch: the holder would open the orchestrator's bounce buffers with it."""
    gpu, orch, holders, buf = booted
    orch.copy_to_vram(memoryview(b"\x07" * RECORD), buf.offset, buffer_bytes=buf.nbytes)
    assert not orch.epoch_fresh
    with pytest.raises(EpochSpent, match="used by the orchestrator"):
        orch.export_for_travel()
    orch.rotate()
    assert orch.epoch_fresh
    orch.export_for_travel()


def test_the_orchestrator_does_not_copy_under_an_exported_epoch(booted) -> None:
    gpu, orch, holders, buf = booted
    blob = orch.export_for_travel()
    orch.import_returned(blob)
    with pytest.raises(EpochSpent, match="exported to a holder"):
        orch.copy_to_vram(memoryview(b"\x07" * RECORD), buf.offset, buffer_bytes=buf.nbytes)


def _forge_kernel_ring_full(gpu: InProcessGpu) -> None:
    """The host writes BAR0: the kernel GPFIFO's get sits right after put (the ring looks full)."""
    put = U32.unpack_from(gpu.bar, Bar0.put(PushChannel.KERNEL))[0]
    U32.pack_into(gpu.bar, Bar0.get(PushChannel.KERNEL), (put + 1) % gpu.layout.gpfifo_entries)


def test_a_forged_full_ring_halts_travel_until_a_new_session(booted) -> None:
    """Issue 12, finding 1: the host fakes a full kernel ring so the rotation after mallory's
    travel is never submitted. The same epoch used to be exported to the next holder."""
    gpu, orch, holders, buf = booted
    blob = orch.export_for_travel()  # mallory's travel; it keeps these keys
    orch.import_returned(blob)
    _forge_kernel_ring_full(gpu)
    with pytest.raises(PeerTimeout, match="GPFIFO space"):
        orch.rotate()
    U32.pack_into(gpu.bar, Bar0.get(PushChannel.KERNEL), U32.unpack_from(gpu.bar, Bar0.put(PushChannel.KERNEL))[0])
    # A recovery that swallowed the failure and went on: the driver still refuses.
    with pytest.raises(TravelHalted, match="could not be submitted"):
        orch.export_for_travel()
    with pytest.raises(TravelHalted):
        orch.copy_to_vram(memoryview(b"\x07" * RECORD), buf.offset, buffer_bytes=buf.nbytes)
    # The way out: a new SPDM session, which wipes VRAM.
    gpu.vram[buf.offset : buf.offset + 4] = b"left"
    orch.rekey()
    assert bytes(gpu.vram[buf.offset : buf.offset + 4]) == bytes(4)
    again = orch.alloc_dataset_buffer(4 * RECORD)
    assert (again.offset, again.nbytes) == (buf.offset, buf.nbytes)
    data = bytes(range(256)) * (RECORD // 256)
    gpu.travel(holders["bob"], data, again)
    assert gpu.vram_at(again.offset, RECORD) == data
    assert orch.key_epoch == gpu.core.epoch == 1


def test_an_unconfirmed_rotation_halts_travel(booted) -> None:
    """The host drops the rotation's doorbell: the driver has the next epoch's keys, but the
    device has not shown that it moved, so nothing leaves until a confirmed rotation."""
    gpu, orch, holders, buf = booted
    orch.import_returned(orch.export_for_travel())
    link = gpu.links[ORCHESTRATOR]
    link.before_service = lambda _: False
    with pytest.raises(PeerTimeout, match="semaphore"):
        orch.rotate(timeout=3)
    link.before_service = None
    with pytest.raises(TravelHalted, match="not confirmed"):
        orch.export_for_travel()
    orch.rekey()
    assert orch.epoch_fresh
    orch.alloc_dataset_buffer(4 * RECORD)
    orch.export_for_travel()


def test_a_confirmed_rotation_after_a_halt_resumes_travel(booted) -> None:
    """The dropped rotation runs late (the host lets the doorbell through): the next rotation
    is confirmed under a kernel key only the device has, so the device is provably on an
    epoch no holder had, and travel resumes without a new session."""
    gpu, orch, holders, buf = booted
    orch.import_returned(orch.export_for_travel())
    link = gpu.links[ORCHESTRATOR]
    link.before_service = lambda _: False
    with pytest.raises(PeerTimeout):
        orch.rotate(timeout=3)
    link.before_service = None
    assert orch.rotate() == 2  # the device runs the pending rotation first, in order
    assert gpu.core.epoch == orch.key_epoch == 2
    data = b"\x5a" * RECORD
    gpu.travel(holders["alice"], data, buf)
    assert gpu.vram_at(buf.offset, RECORD) == data


def test_rekey_joins_a_moved_rpc_queue(booted) -> None:
    """A holder (or the host) moved the RPC queue: the new session still opens."""
    gpu, orch, holders, buf = booted
    blob = orch.export_for_travel()
    gpu.switch("alice")
    holders["alice"].import_context(blob)
    holders["alice"].query_buffer(buf.offset)
    holders["alice"].export_context()
    gpu.switch(ORCHESTRATOR)
    orch.abandon_travel()
    orch.rekey()
    assert orch.epoch_fresh and gpu.core.epoch == 0


# ============================================================================ every register the host can write
def _register(gpu: InProcessGpu, name: str) -> int:
    if name.startswith("rpc"):
        return {"rpc_get": Bar0.RPC_GET, "rpc_put": Bar0.RPC_PUT}[name]
    channel = PushChannel.KERNEL if name.startswith("kernel") else PushChannel.USER
    kind = name.split("_", 1)[1]
    return {"get": Bar0.get(channel), "put": Bar0.put(channel), "fault": Bar0.put(channel) + FAULT_REG,
            "doorbell": Bar0.doorbell(channel)}[kind]


REGISTERS = ("kernel_get", "kernel_put", "kernel_fault", "kernel_doorbell", "user_get", "user_put", "user_fault",
             "rpc_get", "rpc_put")


@pytest.mark.parametrize("value", [0, 1, 7, 0xFFFFFFFF])
@pytest.mark.parametrize("register", REGISTERS)
def test_a_forged_register_at_the_rotation_never_lets_an_epoch_travel_twice(booted, register: str, value: int) -> None:
    """The host writes any BAR0 register while the orchestrator rotates after a travel. The
    worst it gets is a refused travel: either the rotation is confirmed (a fresh epoch) or the
    driver refuses to export until a new session; a new session then restores travel."""
    gpu, orch, holders, buf = booted
    spent = orch.export_for_travel()
    orch.import_returned(spent)
    forged = _register(gpu, register)
    link = gpu.links[ORCHESTRATOR]
    link.before_service = lambda _: U32.pack_into(gpu.bar, forged, value)
    U32.pack_into(gpu.bar, forged, value)
    try:
        orch.rotate(timeout=3)
    except GputravelError:
        pass
    link.before_service = None
    try:
        blob = orch.export_for_travel()
    except (EpochSpent, TravelHalted):  # refused only while the spent epoch stands, or halted
        assert orch.ledger.halted or orch.ledger.epoch == 0
    else:  # the rotation went through: a new epoch, other keys
        assert orch.key_epoch == gpu.core.epoch == 1
        assert _user_keys(blob) != _user_keys(spent)
        orch.import_returned(blob)
    try:  # as the runtime recovers: rotate, or else re-key
        orch.rotate()
    except GputravelError:
        orch.rekey()
        buf = orch.alloc_dataset_buffer(4 * RECORD)
    data = b"\x33" * RECORD
    gpu.travel(holders["alice"], data, buf)
    assert gpu.vram_at(buf.offset, RECORD) == data


def _user_keys(blob: bytes) -> set[bytes]:
    ctx = unpack_context(blob, layout=TEST_LAYOUT.digest())
    return {s.key for s in ctx.senders + ctx.receivers}


def test_a_refused_context_is_both_a_lost_holder_and_a_context_blob_error() -> None:
    """The loader skips a HolderLost (train/loader.py), so a refused context must be one; and
    still a ContextBlobError for whoever asks what went wrong."""
    from gputravel.errors import ContextBlobError, ContextRefused, HolderLost

    exc = ContextRefused("mallory", "a channel counter changed during the travel")
    assert isinstance(exc, HolderLost) and isinstance(exc, ContextBlobError)
    assert exc.holder == "mallory"


@pytest.mark.parametrize("value", [17, 31, 1 << 20, 0xFFFFFFFF])
def test_a_wild_user_get_stays_inside_the_user_ring(booted, value: int) -> None:
    """The host writes a user `get` outside the ring right after a confirmed rotation (the
    orchestrator resyncs from it). Found by review: the value went into the exported context
    and the next user push was written over the kernel ring's slot, or crashed the holder with
    a ValueError. Now it is brought into the ring: at worst a refused push."""
    gpu, orch, holders, buf = booted
    orch.import_returned(orch.export_for_travel())
    link = gpu.links[ORCHESTRATOR]

    def forge_after_service(_link) -> bool:
        gpu.core.service()
        U32.pack_into(gpu.bar, Bar0.get(PushChannel.USER), value)
        return False  # serviced here already

    link.before_service = forge_after_service
    orch.rotate()
    link.before_service = None
    kernel_slots = bytes(gpu.sysmem(ORCHESTRATOR)[TEST_LAYOUT.pushbuf_offset(PushChannel.KERNEL, 0):
                                                  TEST_LAYOUT.pushbuf_offset(PushChannel.KERNEL, 15)])
    blob = orch.export_for_travel()
    assert 0 <= unpack_context(blob, layout=TEST_LAYOUT.digest()).gpfifo_put < TEST_LAYOUT.gpfifo_entries
    gpu.switch("alice")
    alice = holders["alice"]
    alice.import_context(blob)
    try:
        alice.copy_to_vram(memoryview(b"\x44" * RECORD), buf.offset, buffer_bytes=buf.nbytes, timeout=3)
    except GputravelError:
        pass  # a refused push is the worst
    alice.export_context()
    assert bytes(gpu.sysmem(ORCHESTRATOR)[TEST_LAYOUT.pushbuf_offset(PushChannel.KERNEL, 0):
                                          TEST_LAYOUT.pushbuf_offset(PushChannel.KERNEL, 15)]) == kernel_slots


def test_a_returned_context_outside_the_ring_or_with_rpc_rx_rolled_back_is_refused(booted) -> None:
    from msgspec import structs

    from gputravel.driver.context import pack_context
    from gputravel.errors import ContextBlobError

    gpu, orch, holders, buf = booted
    orch.query_buffer(buf.offset)
    sent = orch.export_for_travel()
    ctx = unpack_context(sent, layout=TEST_LAYOUT.digest())
    for bad in (structs.replace(ctx, gpfifo_put=TEST_LAYOUT.gpfifo_entries),
                structs.replace(ctx, rpc_rx_seq=ctx.rpc_rx_seq - 1)):
        with pytest.raises(ContextBlobError):
            orch.import_returned(pack_context(bad))
        assert orch.away
    orch.import_returned(sent)


@pytest.mark.parametrize("state", ["rotating", "halted"])
def test_the_gpu_is_not_lent_while_the_device_may_be_on_an_epoch_a_holder_had(booted, state: str) -> None:
    """A booting holder borrows the GPU (orchestrator/membership.py): never while a rotation is
    pending or travel is halted, when the device may still be on an epoch that holder had."""
    from types import SimpleNamespace

    from gputravel.errors import IllegalTransition
    from gputravel.orchestrator.membership import Membership

    gpu, orch, holders, buf = booted
    orch.import_returned(orch.export_for_travel())
    if state == "rotating":
        orch.start_rotation()
    else:
        orch.ledger.halt("the rotation was not confirmed")
    switched = []
    fake = SimpleNamespace(driver=orch, switch=switched.append)
    with pytest.raises(IllegalTransition, match="not-rotated"):
        Membership(fake).lend("mallory")
    assert switched == []
