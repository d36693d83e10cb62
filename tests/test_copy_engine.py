"""The copy path, kept as strict as one record at a time (issue 17, part 2).

- The device reads a record out of the host-writable staging slot once, a piece at a time
  into its own memory, and verifies and decrypts only those copies (device/memory.open_record,
  crypto/channel.Receiver.decrypt_once_into): a host rewriting the slot while the device works
  cannot change what is decrypted. The driver's read-back (copy_from_vram) does the same.
- The driver never seals into a staging slot before the device has released the record in
  it (a regression test for the pipelined copy's slot reuse).
- A batch of records (the device running everything queued at once, as a busy device does)
  lands exactly as one record at a time; a tampered record in the middle of it writes nothing
  of itself or of what follows, and the records before it are in VRAM and released.
"""

from __future__ import annotations

import pytest

from gputravel.crypto import channel
from gputravel.crypto.channel import KeyMaterial, Receiver, Sender
from gputravel.errors import BadInput, ChannelFaulted, IntegrityError
from gputravel.protocol.layout import TAG_BYTES, PushChannel
from gputravel.protocol.push import CopyToVram
from gputravel.testing import TEST_LAYOUT, InProcessGpu

USER = PushChannel.USER
RECORD = TEST_LAYOUT.record_bytes
SLOTS = TEST_LAYOUT.staging_slots
BUFFER = 8 * RECORD


def data_of(nbytes: int, seed: int = 1) -> bytes:
    """Non-zero, position-dependent bytes (so a misplaced or missing record shows)."""
    block = bytes((seed * 7 + i) % 251 + 1 for i in range(251))
    return (block * (nbytes // 251 + 1))[:nbytes]


@pytest.fixture
def gpu() -> InProcessGpu:
    return InProcessGpu()


def boot(gpu: InProcessGpu):
    orch, holders = gpu.boot("alice")
    buf = orch.alloc_dataset_buffer(BUFFER)
    blob = orch.export_for_travel()
    gpu.switch("alice")
    holders["alice"].import_context(blob)
    return orch, holders["alice"], buf


def late_device(gpu: InProcessGpu) -> None:
    """Doorbells are held back; the device runs only while the holder waits, so it gets every
    record queued so far as one batch (as a busy device does)."""
    link = gpu.links["alice"]
    link.before_service = lambda link: False
    link.while_waiting = lambda link: gpu.core.service()


# ============================================================================ copy-then-verify
def racing_host(monkeypatch, scribbled: list) -> None:
    """The host rewrites a record's bytes in its staging slot right after the device has read
    them and before they are checked and decrypted: the tag when the decryption starts, then
    each piece of ciphertext once it is in the device's own buffer. A device that read the
    slot again (to check it, or to decrypt it) would see zeros."""
    real_open, real_cipher = Receiver.decrypt_once_into, channel.Cipher

    def decrypt_once_into(self, data, out, piece, aad=None):
        slot = memoryview(data)
        consumed = [0]

        class Racing:
            def __init__(self, real):
                self.real = real

            def authenticate_additional_data(self, aad):
                slot[len(slot) - TAG_BYTES :] = bytes(TAG_BYTES)  # the tag was read first
                self.real.authenticate_additional_data(aad)

            def update_into(self, data, buf):
                start = consumed[0]
                slot[start : start + len(data)] = bytes(len(data))  # this piece was just read
                consumed[0] += len(data)
                scribbled.append(len(data))
                return self.real.update_into(data, buf)

            def finalize(self):
                return self.real.finalize()

        monkeypatch.setattr(channel, "Cipher", lambda *a: type("C", (), {
            "decryptor": lambda _: Racing(real_cipher(*a).decryptor())})())
        try:
            return real_open(self, data, out, piece, aad)
        finally:
            monkeypatch.setattr(channel, "Cipher", real_cipher)

    monkeypatch.setattr(Receiver, "decrypt_once_into", decrypt_once_into)



def test_a_host_write_to_the_slot_while_the_device_opens_it_changes_nothing(gpu, monkeypatch) -> None:
    orch, alice, buf = boot(gpu)
    data = data_of(3 * RECORD)
    scribbled = []
    racing_host(monkeypatch, scribbled)
    alice.copy_to_vram(memoryview(data), buf.offset, buffer_bytes=buf.nbytes)
    assert scribbled and gpu.core.stats.faults == []
    assert gpu.vram_at(buf.offset, len(data)) == data


def test_control_decrypting_straight_from_the_slot_would_see_the_host_write(gpu) -> None:
    """Control for the test above: the same scribble before the device's read faults."""
    orch, alice, buf = boot(gpu)
    off = gpu.layout.staging_slot_offset(0)
    gpu.links["alice"].before_service = lambda link: gpu.sysmem("alice").__setitem__(
        slice(off, off + RECORD + TAG_BYTES), bytes(RECORD + TAG_BYTES))
    with pytest.raises(ChannelFaulted):
        alice.copy_to_vram(memoryview(data_of(RECORD)), buf.offset, buffer_bytes=buf.nbytes)
    assert gpu.vram_at(buf.offset, BUFFER) == bytes(BUFFER)


def test_a_host_write_to_the_slot_while_the_driver_reads_back_changes_nothing(gpu, monkeypatch) -> None:
    """The same for the way back (copy_from_vram, the arrival audit): the CVM opens its own copy."""
    orch, alice, buf = boot(gpu)
    data = data_of(2 * RECORD, seed=2)
    alice.copy_to_vram(memoryview(data), buf.offset, buffer_bytes=buf.nbytes)
    real = Receiver.decrypt_into
    off = gpu.layout.staging_slot_offset(0)

    def host_races(self, ciphertext, out, aad=None):
        gpu.sysmem("alice")[off : off + RECORD + TAG_BYTES] = bytes(RECORD + TAG_BYTES)
        return real(self, ciphertext, out, aad)

    monkeypatch.setattr(Receiver, "decrypt_into", host_races)
    assert alice.copy_from_vram(buf.offset, len(data)) == data


@pytest.mark.parametrize("nbytes", [0, 1, 16, 4095, 4096, 4097, 3 * 4096 + 5])
@pytest.mark.parametrize("aad", [None, b"seq"])
def test_decrypt_once_into_opens_what_decrypt_into_opens(nbytes, aad) -> None:
    keys = KeyMaterial("Lce00_h2d_user", bytes(range(32)), bytes(12))
    plain = data_of(nbytes, seed=nbytes % 7)
    tx = Sender(keys)
    sealed = [tx.encrypt(plain, aad), tx.encrypt(plain[::-1], aad)]
    rx, out = Receiver(keys), bytearray(nbytes)
    rx.decrypt_once_into(sealed[0], out, bytearray(4096), aad)
    assert out == plain and rx.message_counter == 1
    rx.decrypt_once_into(memoryview(sealed[1]), out, bytearray(1000), aad)  # a piece of any size
    assert out == plain[::-1] and rx.message_counter == 2


@pytest.mark.parametrize("flip", [0, 4096, -1], ids=["first-byte", "second-piece", "tag"])
def test_decrypt_once_into_rejects_a_flipped_bit_zeroes_out_and_stays_put(flip) -> None:
    keys = KeyMaterial("Lce00_h2d_user", bytes(range(32)), bytes(12))
    sealed = bytearray(Sender(keys).encrypt(data_of(3 * 4096)))
    sealed[flip] ^= 1
    rx, out = Receiver(keys), bytearray(3 * 4096)
    with pytest.raises(IntegrityError):
        rx.decrypt_once_into(sealed, out, bytearray(4096))
    assert out == bytes(len(out)) and rx.message_counter == 0
    sealed[flip] ^= 1
    rx.decrypt_once_into(sealed, out, bytearray(4096))  # the same IV still waits for the real record
    assert out == data_of(3 * 4096)


def test_decrypt_once_into_zeroes_out_whatever_stops_it(monkeypatch) -> None:
    """Review finding (issue 17): an error other than a bad tag (here a MemoryError in the
    middle of the record) must not leave unverified plaintext in ``out``, nor move the IV."""
    keys = KeyMaterial("Lce00_h2d_user", bytes(range(32)), bytes(12))
    sealed = bytearray(Sender(keys).encrypt(data_of(3 * 4096)))
    real = channel.Cipher

    class Failing:
        def __init__(self, inner) -> None:
            self.inner, self.calls = inner, 0

        def authenticate_additional_data(self, aad) -> None:
            self.inner.authenticate_additional_data(aad)

        def update_into(self, data, out) -> int:
            self.calls += 1
            if self.calls == 2:
                raise MemoryError("simulated")
            return self.inner.update_into(data, out)

    monkeypatch.setattr(channel, "Cipher", lambda *a: type("C", (), {"decryptor": lambda _: Failing(real(*a).decryptor())})())
    rx, out = Receiver(keys), bytearray(3 * 4096)
    with pytest.raises(MemoryError):
        rx.decrypt_once_into(sealed, out, bytearray(4096))
    assert out == bytes(len(out)) and rx.message_counter == 0


def test_decrypt_once_into_refuses_a_read_only_out_or_piece() -> None:
    keys = KeyMaterial("Lce00_h2d_user", bytes(range(32)), bytes(12))
    sealed = bytes(Sender(keys).encrypt(b"x" * 64))
    with pytest.raises(BadInput):
        Receiver(keys).decrypt_once_into(sealed, bytes(64), bytearray(16))
    with pytest.raises(BadInput):
        Receiver(keys).decrypt_once_into(sealed, bytearray(64), bytes(16))


# ============================================================================ batches
def test_a_batch_lands_exactly_as_one_record_at_a_time(gpu) -> None:
    orch, alice, buf = boot(gpu)
    late_device(gpu)
    data = data_of(7 * RECORD + 999)
    alice.copy_to_vram(memoryview(data), buf.offset, buffer_bytes=buf.nbytes)
    assert gpu.vram_at(buf.offset, len(data)) == data
    assert gpu.vram_at(buf.offset + len(data), BUFFER - len(data)) == bytes(BUFFER - len(data))
    assert gpu.core.stats.records_in == 8 and gpu.core.stats.faults == []


def test_any_error_of_ours_while_opening_a_record_faults_the_channel(gpu, monkeypatch) -> None:
    """Review (issue 17): the device's loop faults the channel on any of the project's errors
    (here a BadInput out of the record's opening), not only on a bad tag: nothing is written,
    the channel is faulted, and the device goes on serving instead of dying."""
    from gputravel.device import core as device_core  # lazy: patched for this test only

    orch, alice, buf = boot(gpu)

    def refuse(*args):
        raise BadInput("simulated")

    monkeypatch.setattr(device_core, "open_record", refuse)
    with pytest.raises(ChannelFaulted):
        alice.copy_to_vram(memoryview(data_of(RECORD)), buf.offset, buffer_bytes=buf.nbytes)
    assert gpu.vram_at(buf.offset, BUFFER) == bytes(BUFFER)
    assert gpu.core.faulted(USER) and gpu.core.stats.records_in == 0


def test_a_tampered_record_in_a_batch_writes_nothing_of_it_or_after_it(gpu) -> None:
    orch, alice, buf = boot(gpu)
    data = data_of(6 * RECORD)
    link = gpu.links["alice"]
    link.before_service = lambda link: False
    tampered = []

    def device_with_a_flipped_bit(link):
        if not tampered:  # records 0..3 are queued in slots 0..3; the host flips a bit of record 2
            tampered.append(True)
            off = gpu.layout.staging_slot_offset(2) + 100
            gpu.sysmem("alice")[off] ^= 1
        gpu.core.service()

    link.while_waiting = device_with_a_flipped_bit
    base = alice.semaphore(USER)
    with pytest.raises(ChannelFaulted):
        alice.copy_to_vram(memoryview(data), buf.offset, buffer_bytes=buf.nbytes)
    assert gpu.vram_at(buf.offset, 2 * RECORD) == data[: 2 * RECORD]  # the records before it
    assert gpu.vram_at(buf.offset + 2 * RECORD, BUFFER - 2 * RECORD) == bytes(BUFFER - 2 * RECORD)
    assert gpu.core.stats.records_in == 2 and gpu.core.faulted(USER)
    assert alice.semaphore(USER) == base + 2  # records 0 and 1 were released before the fault


# ============================================================================ slot reuse
@pytest.mark.parametrize("slots", [2, 3, 4, 8])
@pytest.mark.parametrize("records", [1, 2, 5, 9, 17])
def test_the_driver_reuses_a_slot_only_after_the_release_of_its_record(slots, records, monkeypatch) -> None:
    """The driver against a device that is done exactly up to the release waited for: a slot
    is sealed into again only once the record in it is released."""
    from gputravel.protocol.layout import Layout
    gpu = InProcessGpu(Layout(record_bytes=4096, staging_slots=slots, gpfifo_entries=64), vram_bytes=1 << 20)
    orch, holders = gpu.boot("alice")
    buf = orch.alloc_dataset_buffer(records * 4096)
    blob = orch.export_for_travel()
    gpu.switch("alice")
    alice = holders["alice"]
    alice.import_context(blob)
    base = alice.semaphore(USER)
    pushes: list[CopyToVram] = []
    state = {"done": base}

    def submit(channel, push, timeout=10.0):
        k = len(pushes)
        if k >= slots:  # slot k % slots last held record k - slots
            assert state["done"] >= base + k - slots + 1, "a slot was reused before its record was released"
        pushes.append(push)

    def wait_release(channel, value, timeout=10.0, *, poll=True):
        assert value in {p.release for p in pushes}, "waits only for a release it asked for"
        state["done"] = max(state["done"], value)

    monkeypatch.setattr(alice, "submit", submit)
    monkeypatch.setattr(alice, "semaphore", lambda channel: state["done"])
    monkeypatch.setattr(alice, "wait_release", wait_release)
    alice.copy_to_vram(memoryview(bytes(records * 4096)), buf.offset, buffer_bytes=buf.nbytes)
    assert [p.dst_offset for p in pushes] == [buf.offset + k * 4096 for k in range(records)]
    assert [p.release for p in pushes] == [base + k + 1 for k in range(records)]
    assert state["done"] == base + records


# ============================================================================ the bench's limit
@pytest.mark.integration
def test_the_pipeline_limit_runs_both_passes_and_reports_the_slower(processes) -> None:
    from gputravel.bench.pipeline import pipeline_limit
    result = pipeline_limit(64 * 1024, 4, total_bytes=4 << 20, rounds=2)
    pipe = result["pipeline"]
    assert result["pipeline_limit_gbps"] == min(pipe["seal_gbps"], pipe["open_gbps"]) > 0
    assert pipe["lockstep_gbps"] > 0 and pipe["balanced_gbps"] >= result["pipeline_limit_gbps"]
    assert len(pipe["rounds"]) == 2 and pipe["record_bytes"] == 64 * 1024 and pipe["slots"] == 4
