"""Security properties of a travel, on the real device core and drivers paired in process.

Every test sets up the cohort the way the paper boots it (holders probe, then the
orchestrator establishes the SPDM session), then plays the honest parties and the
untrusted host (the PCIe MUX, everything in unprotected memory and BAR0, the doorbell).
Where a property could hold vacuously, a control shows that the attack or the check would
have worked without the defence.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import pytest
from msgspec import structs

from gputravel.driver.context import pack_context, unpack_context
from gputravel.crypto.channel import KeyMaterial, Sender, derive_epoch_keys
from gputravel.driver.driver import Driver
from gputravel.device import memory
from gputravel.driver.orchestrator import OrchestratorDriver
from gputravel.errors import BadInput, ChannelFaulted, IllegalTransition, IntegrityError, PeerTimeout
from gputravel.protocol.layout import GPFIFO_ENTRY, SEMAPHORE_HEADER, TAG_BYTES, U32, Bar0, PushChannel
from gputravel.crypto.labels import KERNEL_LABELS, USER_LABELS
from gputravel.testing import ORCHESTRATOR, TEST_LAYOUT, InProcessGpu

USER = PushChannel.USER
KERNEL = PushChannel.KERNEL
RECORD = TEST_LAYOUT.record_bytes
SLOTS = TEST_LAYOUT.staging_slots
BUFFER = 8 * RECORD
CANARY = b"\xc4N4RY-7e1d-\x00\xffZQ!"  # 16 bytes, never produced by chance
assert len(CANARY) == 16


@dataclass
class Cohort:
    gpu: InProcessGpu
    orch: OrchestratorDriver
    holders: dict[str, Driver]
    buf: object  # BufferInfo

    @property
    def alice(self) -> Driver:
        return self.holders["alice"]

    @property
    def bob(self) -> Driver:
        return self.holders["bob"]

    def send(self, name: str) -> bytes:
        """Export for travel, switch the GPU to ``name``, import there. Returns the blob."""
        blob = self.orch.export_for_travel()
        self.gpu.switch(name)
        self.holders[name].import_context(blob)
        return blob

    def home(self, name: str, *, rotate: bool = True) -> bytes:
        """The holder exports, the GPU comes back, the orchestrator imports (and rotates)."""
        back = self.holders[name].export_context()
        self.gpu.switch(ORCHESTRATOR)
        self.orch.import_returned(back)
        if rotate:
            self.orch.rotate()
        return back

    def vram(self, nbytes: int | None = None, offset: int = 0) -> bytes:
        n = self.buf.nbytes if nbytes is None else nbytes
        return self.gpu.vram_at(self.buf.offset + offset, n)


@pytest.fixture
def cohort() -> Cohort:
    gpu = InProcessGpu()
    orch, holders = gpu.boot("alice", "bob")
    return Cohort(gpu, orch, holders, orch.alloc_dataset_buffer(BUFFER))


def data_of(nbytes: int, seed: int = 1) -> bytes:
    """Non-zero, position-dependent bytes (so a misplaced or missing record shows)."""
    block = bytes((seed * 7 + i) % 251 + 1 for i in range(251))
    return (block * (nbytes // 251 + 1))[:nbytes]


def canaried(nbytes: int) -> bytes:
    data = bytearray(os.urandom(nbytes))
    for off in range(0, nbytes - len(CANARY) + 1, 4096):
        data[off : off + len(CANARY)] = CANARY
    return bytes(data)


def bar_u32(gpu: InProcessGpu, offset: int) -> int:
    return U32.unpack_from(gpu.bar, offset)[0]


def host_resubmit(gpu: InProcessGpu, channel: PushChannel, push_ct: bytes) -> None:
    """The host re-submits an old encrypted push at the current put, as a driver would, and
    rings. It can do all of this: push buffers sit in unprotected memory, the GPFIFO in BAR0,
    and the work submission token is no secret."""
    lay = gpu.layout
    put = bar_u32(gpu, Bar0.put(channel))
    slot = lay.pushbuf_offset(channel, put)
    gpu.sysmem(gpu.current)[slot : slot + len(push_ct)] = push_ct
    GPFIFO_ENTRY.pack_into(gpu.bar, Bar0.gpfifo_entry(lay, channel, put), lay.iova(slot), len(push_ct), 0)
    U32.pack_into(gpu.bar, Bar0.put(channel), (put + 1) % lay.gpfifo_entries)
    gpu.core.service()


def last_push(gpu: InProcessGpu, cvm: str, channel: PushChannel) -> bytes:
    """Ciphertext of the push most recently submitted on ``channel`` from ``cvm``'s memory."""
    lay = gpu.layout
    index = (bar_u32(gpu, Bar0.put(channel)) - 1) % lay.gpfifo_entries
    _, length, _ = GPFIFO_ENTRY.unpack_from(gpu.bar, Bar0.gpfifo_entry(lay, channel, index))
    slot = lay.pushbuf_offset(channel, index)
    return bytes(gpu.sysmem(cvm)[slot : slot + length])


def staging_slot(gpu: InProcessGpu, cvm: str, slot: int, nbytes: int) -> memoryview:
    off = gpu.layout.staging_slot_offset(slot)
    return memoryview(gpu.sysmem(cvm))[off : off + nbytes + TAG_BYTES]


def once(action):
    """A before_service hook that runs ``action(link)`` on the first ring only."""
    fired = []

    def hook(link):
        if not fired:
            fired.append(True)
            return action(link)
        return None

    return hook


# ============================================================================ happy path
def test_multi_record_copy_lands_exactly_in_vram(cohort: Cohort) -> None:
    data = data_of(6 * RECORD + 1234)
    assert len(data) > SLOTS * RECORD  # staging slots are reused
    cohort.send("alice")
    cohort.alice.copy_to_vram(memoryview(data), cohort.buf.offset, buffer_bytes=cohort.buf.nbytes)
    cohort.home("alice")
    assert cohort.vram(len(data)) == data
    assert cohort.vram(offset=len(data), nbytes=BUFFER - len(data)) == bytes(BUFFER - len(data))
    assert cohort.gpu.core.stats.records_in == 7
    assert cohort.gpu.core.stats.faults == []
    assert cohort.gpu.core.epoch == cohort.orch.key_epoch == 1


def test_many_travels_wrap_the_gpfifo_and_rotate_every_time(cohort: Cohort) -> None:
    submitted = 0
    for i, name in enumerate(["alice", "bob", "alice", "bob", "alice"]):
        data = data_of(3 * RECORD + 17 * (i + 1), seed=i)
        cohort.gpu.travel(cohort.holders[name], data, cohort.buf)
        submitted += 4
        assert cohort.vram(len(data)) == data
        assert cohort.gpu.core.epoch == cohort.orch.key_epoch == i + 1
    assert submitted > TEST_LAYOUT.gpfifo_entries  # the ring wrapped at least once
    assert cohort.gpu.core.stats.faults == []


# ============================================================================ confidentiality
def test_no_plaintext_canary_ever_reaches_unprotected_memory(cohort: Cohort) -> None:
    data = canaried(5 * RECORD + 999)
    planted = data.count(CANARY)
    assert planted == len(range(0, len(data) - 15, 4096)) > 0  # control: the scan finds them
    cohort.send("alice")
    cohort.alice.copy_to_vram(memoryview(data), cohort.buf.offset, buffer_bytes=cohort.buf.nbytes)
    assert CANARY not in cohort.gpu.snoop()
    cohort.home("alice")
    # Same data flowing device -> CVM (a holder auditing the buffer) is encrypted too.
    cohort.send("bob")
    assert bytes(cohort.bob.copy_from_vram(cohort.buf.offset, len(data))) == data
    cohort.home("bob")
    assert CANARY not in cohort.gpu.snoop()
    assert cohort.vram(len(data)).count(CANARY) == planted  # the canaries did travel, in VRAM
    # Control: had a driver staged plaintext, the host's view would have shown it.
    staging_slot(cohort.gpu, "alice", 0, 4096)[:4096] = data[:4096]
    assert CANARY in cohort.gpu.snoop()


# ============================================================================ integrity: replays
def test_replayed_copy_to_vram_push_is_rejected(cohort: Cohort) -> None:
    gpu = cohort.gpu
    cohort.send("alice")
    cohort.alice.copy_to_vram(memoryview(data_of(RECORD, seed=3)), cohort.buf.offset, buffer_bytes=BUFFER)
    captured = last_push(gpu, "alice", USER)
    # Overwrite the buffer legitimately, then have the host replay the first copy's push.
    newer = data_of(RECORD, seed=4)
    cohort.alice.copy_to_vram(memoryview(newer), cohort.buf.offset, buffer_bytes=BUFFER)
    get_before = bar_u32(gpu, Bar0.get(USER))
    host_resubmit(gpu, USER, captured)
    assert gpu.core.faulted(USER)
    assert cohort.alice.faulted(USER)
    assert bar_u32(gpu, Bar0.get(USER)) == get_before  # the replayed entry never completed
    assert cohort.vram(RECORD) == newer
    assert gpu.core.stats.records_in == 2


def test_replayed_copy_from_vram_push_is_rejected(cohort: Cohort) -> None:
    """A replayed read-back would make the device write VRAM out again: it must not."""
    gpu = cohort.gpu
    cohort.send("alice")
    cohort.alice.copy_to_vram(memoryview(data_of(RECORD)), cohort.buf.offset, buffer_bytes=BUFFER)
    cohort.alice.copy_from_vram(cohort.buf.offset, RECORD)
    captured = last_push(gpu, "alice", USER)
    out_before = gpu.core.stats.records_out
    slot_before = bytes(staging_slot(gpu, "alice", 0, RECORD))
    host_resubmit(gpu, USER, captured)
    assert gpu.core.faulted(USER)
    assert gpu.core.stats.records_out == out_before == 1
    assert bytes(staging_slot(gpu, "alice", 0, RECORD)) == slot_before


def test_replayed_staging_record_is_rejected(cohort: Cohort) -> None:
    gpu = cohort.gpu
    first, second = data_of(RECORD, seed=5), data_of(RECORD, seed=6)
    cohort.send("alice")
    cohort.alice.copy_to_vram(memoryview(first), cohort.buf.offset, buffer_bytes=BUFFER)
    old_record = bytes(staging_slot(gpu, "alice", 0, RECORD))
    link = gpu.links["alice"]

    def replay(link):
        staging_slot(gpu, "alice", 0, RECORD)[:] = old_record

    link.before_service = once(replay)
    with pytest.raises(ChannelFaulted):
        cohort.alice.copy_to_vram(memoryview(second), cohort.buf.offset, buffer_bytes=BUFFER)
    assert gpu.core.faulted(USER)
    assert cohort.vram(RECORD) == first  # neither the replayed nor any garbage record landed
    assert gpu.core.stats.records_in == 1


# ============================================================================ integrity: tampering
@pytest.mark.parametrize("where", ["first byte", "middle", "tag"])
def test_tampered_record_faults_channel_and_writes_nothing(cohort: Cohort, where: str) -> None:
    gpu = cohort.gpu
    before = data_of(RECORD, seed=7)
    cohort.gpu.travel(cohort.alice, before, cohort.buf)
    cohort.send("alice")
    position = {"first byte": 0, "middle": RECORD // 2, "tag": RECORD + TAG_BYTES - 1}[where]

    def flip(link):
        staging_slot(gpu, "alice", 0, RECORD)[position] ^= 0x01

    gpu.links["alice"].before_service = once(flip)
    with pytest.raises(ChannelFaulted):
        cohort.alice.copy_to_vram(memoryview(data_of(RECORD, seed=8)), cohort.buf.offset, buffer_bytes=BUFFER)
    assert gpu.core.faulted(USER)
    assert "IntegrityError" in gpu.core.stats.faults[-1]
    assert cohort.vram(RECORD) == before
    # A waiter on the faulted channel is told so at once, it does not sit out its timeout.
    with pytest.raises(ChannelFaulted):
        cohort.alice.wait_release(USER, cohort.alice.next_release(USER))


def test_tampered_record_mid_copy_stops_at_that_record(cohort: Cohort) -> None:
    gpu = cohort.gpu
    data = data_of(6 * RECORD, seed=9)
    cohort.send("alice")
    rings = []

    def flip_third(link):
        rings.append(1)
        if len(rings) == 3:  # the third record's doorbell: slot 2 holds it
            staging_slot(gpu, "alice", 2, RECORD)[100] ^= 0x80

    gpu.links["alice"].before_service = flip_third
    with pytest.raises(ChannelFaulted):
        cohort.alice.copy_to_vram(memoryview(data), cohort.buf.offset, buffer_bytes=BUFFER)
    assert cohort.vram(2 * RECORD) == data[: 2 * RECORD]  # authenticated records landed
    assert cohort.vram(offset=2 * RECORD, nbytes=BUFFER - 2 * RECORD) == bytes(BUFFER - 2 * RECORD)
    assert gpu.core.stats.records_in == 2


def test_rotation_recovers_a_faulted_channel(cohort: Cohort) -> None:
    gpu = cohort.gpu
    cohort.send("alice")
    def flip(link: object) -> None:  # a flip, not a zero: a ciphertext byte is already 0 one time in 256
        slot = staging_slot(gpu, "alice", 0, 16)
        slot[0] ^= 0xFF

    gpu.links["alice"].before_service = once(flip)
    with pytest.raises(ChannelFaulted):
        cohort.alice.copy_to_vram(memoryview(data_of(RECORD)), cohort.buf.offset, buffer_bytes=BUFFER)
    gpu.links["alice"].before_service = None
    cohort.home("alice")  # the holder still exports; the orchestrator imports and rotates
    assert not gpu.core.faulted(USER) and not cohort.orch.faulted(USER)
    data = data_of(5 * RECORD + 3, seed=10)
    for name in ("bob", "alice"):
        gpu.travel(cohort.holders[name], data, cohort.buf)
        assert cohort.vram(len(data)) == data
    assert not gpu.core.faulted(USER)


# ============================================================================ key rotation
def _malicious_driver(gpu: InProcessGpu, cvm: str, blob: bytes) -> Driver:
    """The host gives the GPU to ``cvm``, where a fresh driver loads a blob kept from earlier."""
    gpu.switch(cvm)
    mallory = Driver(gpu.links[cvm], clock=gpu.clock)
    mallory.probe()  # the work submission token is public: without it the doorbell is ignored
    mallory.import_context(blob)
    return mallory


@pytest.fixture(params=["imported", "returned", "returned-realigned"])
def kept(request, cohort: Cohort):
    """Alice travels once and keeps both the blob she imported and the one she returned
    (the latter's counters are exactly where the device stood at the end of her epoch).
    Then Bob travels with his secret data, under fresh keys.

    "returned-realigned" is the strongest holder: knowing that a rotation restarts message
    counters, she rewrites her kept blob to the device's post-rotation IV state and GPFIFO
    position (read from BAR0), so only the keys themselves can stop her.
    """
    imported = cohort.send("alice")
    cohort.alice.copy_to_vram(memoryview(data_of(2 * RECORD, seed=11)), cohort.buf.offset, buffer_bytes=BUFFER)
    returned = cohort.home("alice")
    secret = canaried(2 * RECORD)
    cohort.gpu.travel(cohort.bob, secret, cohort.buf)
    if request.param == "imported":
        blob = imported
    elif request.param == "returned":
        blob = returned
    else:
        ctx = unpack_context(returned, layout=TEST_LAYOUT.digest())
        reset = lambda group: tuple(structs.replace(s, message_counter=0) for s in group)  # noqa: E731
        blob = pack_context(structs.replace(
            ctx, senders=reset(ctx.senders), receivers=reset(ctx.receivers),
            gpfifo_put=bar_u32(cohort.gpu, Bar0.put(USER)), rpc_tx_seq=0, rpc_rx_seq=0,
        ))
    return cohort, blob, secret


def test_kept_keys_cannot_push_after_rotation(kept) -> None:
    cohort, blob, secret = kept
    gpu = cohort.gpu
    mallory = _malicious_driver(gpu, "alice", blob)
    try:
        mallory.copy_to_vram(memoryview(b"\x66" * RECORD), cohort.buf.offset, buffer_bytes=BUFFER)
    except (ChannelFaulted, PeerTimeout):
        pass  # with the returned blob the driver notices; with the imported one it may not:
        # old semaphore records in alice's memory still authenticate under the kept key, so
        # mallory's own driver can fool itself. What matters is what the device did.
    assert gpu.core.faulted(USER)
    assert cohort.vram(len(secret)) == secret
    assert gpu.core.stats.records_in == 4  # alice's 2 + bob's 2, nothing from mallory


def test_kept_keys_cannot_read_vram_after_rotation(kept) -> None:
    cohort, blob, secret = kept
    gpu = cohort.gpu
    out_before = gpu.core.stats.records_out
    mallory = _malicious_driver(gpu, "alice", blob)
    # Fails in the driver: ChannelFaulted/PeerTimeout, or IntegrityError when a stale
    # semaphore fooled it into decrypting a staging slot the device never wrote.
    with pytest.raises((ChannelFaulted, PeerTimeout, IntegrityError)):
        mallory.copy_from_vram(cohort.buf.offset, RECORD)
    assert gpu.core.faulted(USER)
    assert gpu.core.stats.records_out == out_before
    assert CANARY not in gpu.snoop()


def test_control_without_rotation_kept_keys_would_work(cohort: Cohort) -> None:
    """Shows the two tests above are not vacuous: skip the rotation and the attack succeeds."""
    gpu = cohort.gpu
    cohort.send("alice")
    secret = canaried(RECORD)
    cohort.alice.copy_to_vram(memoryview(secret), cohort.buf.offset, buffer_bytes=BUFFER)
    returned = cohort.home("alice", rotate=False)
    mallory = _malicious_driver(gpu, "alice", returned)
    assert bytes(mallory.copy_from_vram(cohort.buf.offset, RECORD)) == secret
    mallory.copy_to_vram(memoryview(b"\x66" * RECORD), cohort.buf.offset, buffer_bytes=BUFFER)
    assert cohort.vram(RECORD) == b"\x66" * RECORD


def test_blob_never_carries_kernel_keys_or_the_session_secret(cohort: Cohort) -> None:
    kernel_keys = [cohort.orch.keys.tx["Lwlc_h2d_kernel"].export_state(), cohort.orch.keys.rx["Llcic_d2h_kernel"].export_state()]
    blob = cohort.orch.export_for_travel()
    ctx = unpack_context(blob, layout=TEST_LAYOUT.digest())
    labels = [s.label for s in ctx.senders + ctx.receivers]
    assert sorted(labels) == sorted(USER_LABELS)
    assert not set(labels) & set(KERNEL_LABELS)
    for state in kernel_keys:
        assert state.key not in blob and state.iv_mask not in blob
    assert gpu_session_secret(cohort.gpu) not in blob


def gpu_session_secret(gpu: InProcessGpu) -> bytes:
    secret = gpu.core._session_secret  # inspection only: what the device and orchestrator share
    assert secret is not None
    return secret


def _forge_kernel_semaphore(gpu: InProcessGpu, keys: KeyMaterial, value: int) -> None:
    """Write an encrypted kernel-channel semaphore record into the orchestrator's memory,
    at the IV index the orchestrator expects next after a rotation (channel 1, message 1)."""
    lay = gpu.layout
    payload = Sender(keys, channel_counter=1).encrypt(value.to_bytes(8, "little"))
    off = lay.semaphore_offset(KERNEL)
    mem = gpu.sysmem(ORCHESTRATOR)
    (notifier,) = struct.unpack_from("<Q", mem, off)
    SEMAPHORE_HEADER.pack_into(mem, off, notifier + 2, 1, 1, 0)
    mem[off + SEMAPHORE_HEADER.size : off + SEMAPHORE_HEADER.size + len(payload)] = payload


@pytest.mark.parametrize("forge_with", [*USER_LABELS, "control: the real new kernel key"])
def test_kept_keys_cannot_forge_a_rotation_confirmation(cohort: Cohort, forge_with: str) -> None:
    """The host drops the rotate push and forges its completion with a key a holder kept.

    The orchestrator must not believe the rotation happened (it would go on while the device
    still accepts the old keys). The control forges with the real new-epoch kernel key, which
    only the orchestrator and the device can derive, to show the forged record is well formed.
    """
    gpu, orch = cohort.gpu, cohort.orch
    blob = cohort.send("alice")
    cohort.home("alice", rotate=False)
    ctx = unpack_context(blob, layout=TEST_LAYOUT.digest())
    states = {s.label: s for s in ctx.senders + ctx.receivers}
    if forge_with in states:
        s = states[forge_with]
        keys = KeyMaterial(s.label, s.key, s.iv_mask)
    else:
        epoch = orch.key_epoch + 1
        keys = derive_epoch_keys(gpu_session_secret(gpu), epoch, ["Llcic_d2h_kernel"])["Llcic_d2h_kernel"]
    value = orch.next_release(KERNEL)

    def drop_and_forge(link):
        _forge_kernel_semaphore(gpu, keys, value)
        return False  # the device never sees the doorbell

    gpu.links[ORCHESTRATOR].before_service = once(drop_and_forge)
    if forge_with in states:
        with pytest.raises(PeerTimeout):
            orch.rotate()
    else:
        assert orch.rotate() == 1  # fooled: only possible with the session secret
    assert gpu.core.epoch == 0  # the device never rotated either way


def test_withheld_rotation_doorbell_times_out_then_catches_up(cohort: Cohort) -> None:
    """The host sits on the rotate doorbell: the orchestrator does not go on (PeerTimeout).
    The push itself stays queued in the GPFIFO, so when the host lets the next doorbell
    through, the device runs both rotations in order and the two sides meet at the same
    epoch. (A push the host erases from the GPFIFO instead leaves the kernel channel out of
    step for good: see OrchestratorDriver.rotate.)"""
    gpu, orch = cohort.gpu, cohort.orch
    gpu.links[ORCHESTRATOR].before_service = lambda link: False
    with pytest.raises(PeerTimeout):
        orch.rotate()
    assert gpu.core.epoch == 0 and orch.key_epoch == 1
    gpu.links[ORCHESTRATOR].before_service = None
    assert orch.rotate() == 2
    assert gpu.core.epoch == 2 and gpu.core.stats.faults == []
    data = data_of(2 * RECORD, seed=17)
    gpu.travel(cohort.alice, data, cohort.buf)
    assert cohort.vram(len(data)) == data


# ============================================================================ clean-up
@pytest.mark.parametrize("scrub", [True, False], ids=["scrubbed", "control-unscrubbed"])
def test_buffer_is_scrubbed_before_the_next_holder(cohort: Cohort, scrub: bool) -> None:
    alice_data = data_of(3 * RECORD + 5, seed=12)
    cohort.gpu.travel(cohort.alice, alice_data, cohort.buf)
    if scrub:
        cohort.orch.scrub(cohort.buf.offset, cohort.buf.nbytes)
    cohort.send("bob")
    seen = bytes(cohort.bob.copy_from_vram(cohort.buf.offset, cohort.buf.nbytes))
    cohort.home("bob")
    if scrub:
        assert seen == bytes(BUFFER)
    else:
        assert seen[: len(alice_data)] == alice_data


def test_new_spdm_session_wipes_vram(cohort: Cohort) -> None:
    gpu = cohort.gpu
    secret = canaried(2 * RECORD)
    gpu.travel(cohort.alice, secret, cohort.buf)
    assert cohort.vram(len(secret)) == secret  # control
    intruder_link = gpu.add_cvm("intruder")
    gpu.switch("intruder")
    intruder = OrchestratorDriver(intruder_link, clock=gpu.clock)
    intruder.establish_session()
    assert not any(gpu.vram)
    assert gpu.core.epoch == 0
    # The intruder's session knows nothing of the old buffer; the old orchestrator's keys are dead.
    gpu.switch(ORCHESTRATOR)
    with pytest.raises((ChannelFaulted, PeerTimeout)):
        cohort.orch.scrub(cohort.buf.offset, cohort.buf.nbytes)


# ============================================================================ the MUX
@pytest.mark.parametrize("attached", [None, "bob"], ids=["detached", "other-cvm"])
def test_doorbell_of_a_cvm_the_mux_switched_away_from_faults(cohort: Cohort, attached: str | None) -> None:
    gpu = cohort.gpu
    before = data_of(RECORD, seed=13)
    gpu.travel(cohort.alice, before, cohort.buf)
    cohort.send("alice")
    gpu.switch(attached)
    with pytest.raises(ChannelFaulted):
        cohort.alice.copy_to_vram(memoryview(data_of(RECORD, seed=14)), cohort.buf.offset, buffer_bytes=BUFFER)
    assert gpu.core.faulted(USER)
    fault = gpu.core.stats.faults[-1]
    assert ("DmaFault" in fault) if attached is None else ("IntegrityError" in fault)
    assert cohort.vram(RECORD) == before


# ============================================================================ bad input
@pytest.mark.parametrize("size", [BUFFER + 1, 0], ids=["larger-than-buffer", "empty"])
def test_bad_chunk_is_refused_before_anything_is_submitted(cohort: Cohort, size: int) -> None:
    gpu = cohort.gpu
    cohort.send("alice")
    bar_before, vram_before = bytes(gpu.bar), bytes(gpu.vram)
    sysmem_before = bytes(gpu.sysmem("alice"))
    rings = gpu.links["alice"].rings
    with pytest.raises(BadInput):
        cohort.alice.copy_to_vram(memoryview(data_of(size)), cohort.buf.offset, buffer_bytes=BUFFER)
    assert bytes(gpu.bar) == bar_before  # put, GPFIFO: untouched
    assert bytes(gpu.vram) == vram_before
    assert bytes(gpu.sysmem("alice")) == sysmem_before  # nothing staged
    assert gpu.links["alice"].rings == rings
    # No IV was consumed: the next good copy still lines up with the device.
    good = data_of(RECORD, seed=15)
    cohort.alice.copy_to_vram(memoryview(good), cohort.buf.offset, buffer_bytes=BUFFER)
    assert cohort.vram(RECORD) == good


def test_copy_without_a_context_is_an_illegal_transition(cohort: Cohort) -> None:
    with pytest.raises(IllegalTransition):
        cohort.alice.copy_to_vram(memoryview(b"x"), cohort.buf.offset, buffer_bytes=BUFFER)
    cohort.send("alice")
    cohort.home("alice")  # exported: the holder gave the context back
    with pytest.raises(IllegalTransition):
        cohort.alice.copy_from_vram(cohort.buf.offset, 16)


# ============================================================================ the harness itself
def test_harness_refuses_a_holder_booting_after_the_session() -> None:
    gpu = InProcessGpu()
    gpu.holder("alice")
    gpu.orchestrator()
    with pytest.raises(IllegalTransition, match="boot holder 'late'"):
        gpu.holder("late")
    with pytest.raises(BadInput, match="already taken"):
        gpu.add_cvm("alice")
    with pytest.raises(BadInput, match="registered: alice, orchestrator"):
        gpu.switch("nobody")


def test_harness_snoop_sees_sysmem_and_bar_but_never_vram(cohort: Cohort) -> None:
    gpu = cohort.gpu
    gpu.vram[:16] = CANARY
    assert CANARY not in gpu.snoop()
    gpu.sysmem("bob")[-16:] = CANARY
    assert CANARY in gpu.snoop()


def test_silent_device_is_a_timeout_not_a_hang(cohort: Cohort) -> None:
    cohort.send("alice")
    cohort.gpu.links["alice"].before_service = lambda link: False
    with pytest.raises(PeerTimeout, match="semaphore"):
        cohort.alice.copy_to_vram(memoryview(data_of(RECORD)), cohort.buf.offset, buffer_bytes=BUFFER, timeout=600)


# ============================================================================ regressions and known gaps
@pytest.mark.parametrize("desync", ["holder-vanished", "host-replayed-entry", "holder-returned-stale-blob"])
def test_rotation_realigns_the_user_channel(cohort: Cohort, desync: str) -> None:
    gpu = cohort.gpu
    if desync == "holder-vanished":
        # Alice copies, then never returns the context: the orchestrator abandons and rotates,
        # exactly what orchestrator/cvm.py _recover does.
        cohort.send("alice")
        cohort.alice.copy_to_vram(memoryview(data_of(RECORD)), cohort.buf.offset, buffer_bytes=BUFFER)
        gpu.switch(ORCHESTRATOR)
        cohort.orch.abandon_travel()
        cohort.orch.rotate()
    elif desync == "holder-returned-stale-blob":
        # Alice copies but hands back the blob she was sent; its counters did not go backwards,
        # so import_returned accepts it (test_context), and the rotation should realign the rest.
        sent = cohort.send("alice")
        cohort.alice.copy_to_vram(memoryview(data_of(RECORD)), cohort.buf.offset, buffer_bytes=BUFFER)
        gpu.switch(ORCHESTRATOR)
        cohort.orch.import_returned(sent)
        cohort.orch.rotate()
    else:
        # The host replays an old push (rejected, channel faulted); then an honest cycle + rotate.
        cohort.send("alice")
        cohort.alice.copy_to_vram(memoryview(data_of(RECORD)), cohort.buf.offset, buffer_bytes=BUFFER)
        host_resubmit(gpu, USER, last_push(gpu, "alice", USER))
        assert gpu.core.faulted(USER)
        cohort.home("alice")
    assert not gpu.core.faulted(USER)
    data = data_of(2 * RECORD, seed=16)
    gpu.travel(cohort.bob, data, cohort.buf)  # the docstring of RotateKeys promises this works
    assert cohort.vram(len(data)) == data


@pytest.mark.parametrize("direction", ["read", "write"])
def test_holder_cannot_touch_vram_outside_the_dataset_buffer(cohort: Cohort, direction: str) -> None:
    gpu = cohort.gpu
    other = cohort.orch.alloc_buffer(RECORD)  # e.g. model weights, or a second dataset buffer
    private = canaried(RECORD)
    gpu.vram[other.offset : other.offset + RECORD] = private
    cohort.send("alice")
    try:
        if direction == "read":
            leaked = bytes(cohort.alice.copy_from_vram(other.offset, RECORD))
            assert leaked != private
        else:
            cohort.alice.copy_to_vram(memoryview(b"\x66" * RECORD), other.offset, buffer_bytes=BUFFER)
    except (ChannelFaulted, PeerTimeout):
        pass
    assert gpu.vram_at(other.offset, RECORD) == private
    assert CANARY not in gpu.snoop()


def test_copies_need_a_granted_window() -> None:
    """Before the orchestrator grants the dataset buffer, no user copy reaches VRAM at all."""
    gpu = InProcessGpu()
    orch, holders = gpu.boot("alice")
    buf = orch.alloc_buffer(BUFFER)  # allocated, never granted
    orch_blob = orch.export_for_travel()
    gpu.switch("alice")
    holders["alice"].import_context(orch_blob)
    with pytest.raises(ChannelFaulted):
        holders["alice"].copy_to_vram(memoryview(data_of(RECORD)), buf.offset, buffer_bytes=BUFFER)
    assert gpu.vram_at(buf.offset, RECORD) == bytes(RECORD)


def test_a_holder_cannot_grant_itself_a_window(cohort: Cohort) -> None:
    from gputravel.protocol.push import GrantWindow

    gpu = cohort.gpu
    other = cohort.orch.alloc_buffer(RECORD)
    private = canaried(RECORD)
    gpu.vram[other.offset : other.offset + RECORD] = private
    cohort.send("alice")
    value = cohort.alice.next_release(USER)
    cohort.alice.submit(USER, GrantWindow(offset=0, nbytes=len(gpu.vram), release=value, interrupt=True))
    assert gpu.core.faulted(USER)  # a kernel method on the user channel
    with pytest.raises((ChannelFaulted, PeerTimeout)):
        cohort.alice.copy_from_vram(other.offset, RECORD)
    assert gpu.vram_at(other.offset, RECORD) == private
    assert CANARY not in gpu.snoop()


@pytest.mark.parametrize("nbytes", [4096, (1 << 20) + 3, 3 * 4096 + 1])
def test_a_scrub_split_across_threads_zeroes_exactly_its_range(monkeypatch, nbytes: int) -> None:
    """Large scrubs run on several threads; each piece must land, and nothing outside."""
    monkeypatch.setattr(memory, "FILL_SPLIT_BYTES", 4096)
    monkeypatch.setattr(memory, "_FILL_THREADS", 3)
    mem = bytearray(b"\x5a") * (nbytes + 2)
    memory.fill(memoryview(mem)[1 : nbytes + 1], 0)
    assert mem[0] == mem[-1] == 0x5A
    assert mem[1 : nbytes + 1].count(0) == nbytes


# ============================================================================ RPC order and doorbell tokens
def test_a_replayed_or_skipped_rpc_is_dropped_and_the_queue_goes_on(cohort: Cohort) -> None:
    """The device answers only the next RPC sequence number: a request the host replays (old
    bytes, old number) or one that skips ahead is dropped without an answer."""
    gpu, orch = cohort.gpu, cohort.orch
    sysmem = gpu.links[ORCHESTRATOR].sysmem
    req = slice(TEST_LAYOUT.rpc_request_offset, TEST_LAYOUT.rpc_response_offset)
    resp = slice(TEST_LAYOUT.rpc_response_offset, TEST_LAYOUT.rpc_response_offset + 4096)
    orch.query_buffer(cohort.buf.offset)
    old_request, old_seq = bytes(sysmem[req]), bar_u32(gpu, Bar0.RPC_GET)
    orch.query_buffer(cohort.buf.offset)
    answered, answer = bar_u32(gpu, Bar0.RPC_GET), bytes(sysmem[resp])
    for seq, body in ((old_seq, old_request), (answered + 2, bytes(sysmem[req]))):
        sysmem[req] = body
        struct.pack_into(">I", sysmem, TEST_LAYOUT.rpc_request_offset, seq)  # the header's sequence number
        U32.pack_into(gpu.bar, Bar0.RPC_PUT, seq)
        faults = len(gpu.core.stats.faults)
        gpu.core.service()
        assert gpu.core.stats.faults[faults:] == ["rpc: ProtocolError"]
        assert bar_u32(gpu, Bar0.RPC_GET) == answered and bytes(sysmem[resp]) == answer  # no answer
    orch._rpc_tx = orch._rpc_rx = answered  # the driver's own numbering was never disturbed
    assert orch.query_buffer(cohort.buf.offset).nbytes == cohort.buf.nbytes


def test_a_doorbell_without_the_channels_token_is_ignored(cohort: Cohort) -> None:
    """Work is run only when the doorbell register holds the channel's work submission token:
    a ring with anything else there does nothing (no copy, no fault)."""
    cohort.send("alice")
    link = cohort.gpu.links["alice"]
    before = cohort.vram()

    def wrong_token(_link) -> None:
        U32.pack_into(cohort.gpu.bar, Bar0.doorbell(PushChannel.USER), 0xBADBAD)

    link.before_service = wrong_token
    with pytest.raises(PeerTimeout):
        cohort.alice.copy_to_vram(memoryview(data_of(RECORD)), cohort.buf.offset, buffer_bytes=BUFFER, timeout=5)
    assert cohort.vram() == before and cohort.gpu.core.stats.records_in == 0
    assert cohort.gpu.core.stats.faults == [] and not cohort.alice.faulted(PushChannel.USER)
