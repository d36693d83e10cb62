"""The channel crypto recipe: known answers, IV layout, counters, state, rotation."""

from __future__ import annotations

import hashlib

import pytest
from cryptography.hazmat.primitives import hashes
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples  # tests/profiles.py: counts for the thorough profile

from gputravel.crypto import channel as ch
from gputravel.crypto.channel import (
    MAX_CHANNEL_COUNTER,
    TAG_BYTES,
    ChannelState,
    KeyMaterial,
    Receiver,
    Sender,
    build_iv,
    derive_epoch_keys,
    gcm_nonce,
)
from gputravel.errors import BadInput, CounterExhausted, IntegrityError

SECRET = bytes(range(48))
LABELS = ("Lce00_h2d_user", "Lce00_d2h_user")


def keys(label: str = "Lce00_h2d_user", epoch: int = 0, secret: bytes = SECRET) -> KeyMaterial:
    return derive_epoch_keys(secret, epoch, [label])[label]


def pair(max_message_counter: int = ch.MAX_MESSAGE_COUNTER, channel_counter: int = 1):
    k = keys()
    return (
        Sender(k, channel_counter, max_message_counter=max_message_counter),
        Receiver(k, channel_counter, max_message_counter=max_message_counter),
    )


def xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


# ----------------------------------------------------------------------------- known answers
# "The Galois/Counter Mode of Operation (GCM)", McGrew & Viega, test cases 15 and 16
# (AES-256, 96-bit IV); the same vectors NIST's GCM validation uses.
GCM_KEY = bytes.fromhex("feffe9928665731c6d6a8f9467308308feffe9928665731c6d6a8f9467308308")
GCM_IV = bytes.fromhex("cafebabefacedbaddecaf888")
GCM_P15 = bytes.fromhex(
    "d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a72"
    "1c3c0c95956809532fcf0e2449a6b525b16aedf5aa0de657ba637b391aafd255"
)
GCM_C15 = bytes.fromhex(
    "522dc1f099567d07f47f37a32a84427d643a8cdcbfe5c0c97598a2bd2555d1aa"
    "8cb08e48590dbb3da7b08b1056828838c5f61e6393ba7a0abcc9f662898015ad"
)
GCM_T15 = bytes.fromhex("b094dac5d93471bdec1a502270e3cc6c")
GCM_P16 = GCM_P15[:60]
GCM_A16 = bytes.fromhex("feedfacedeadbeeffeedfacedeadbeefabaddad2")
GCM_C16 = GCM_C15[:60]
GCM_T16 = bytes.fromhex("76fc6ece0f4e1768cddf8853bb2d551b")


def kat_endpoints(channel_counter: int = 7):
    # Pick the mask so that the first message (counter 1) lands exactly on the test nonce.
    mask = xor(GCM_IV, build_iv(1, channel_counter))
    km = KeyMaterial("kat", GCM_KEY, mask)
    return Sender(km, channel_counter), Receiver(km, channel_counter)


@pytest.mark.parametrize(
    ("plaintext", "aad", "ciphertext", "tag"),
    [(GCM_P15, None, GCM_C15, GCM_T15), (GCM_P16, GCM_A16, GCM_C16, GCM_T16)],
    ids=["gcm-tc15", "gcm-tc16"],
)
def test_gcm_known_answer(plaintext, aad, ciphertext, tag):
    sender, receiver = kat_endpoints()
    assert sender.encrypt(plaintext, aad) == ciphertext + tag
    assert receiver.decrypt(ciphertext + tag, aad) == plaintext


def test_gcm_known_answer_into_buffers():
    sender, receiver = kat_endpoints()
    out = bytearray(len(GCM_P16) + TAG_BYTES)
    sender.encrypt_into(GCM_P16, out, GCM_A16)
    assert bytes(out) == GCM_C16 + GCM_T16
    plain = bytearray(len(GCM_P16))
    receiver.decrypt_into(memoryview(out), plain, GCM_A16)
    assert bytes(plain) == GCM_P16


def test_hkdf_expand_rfc5869_case1():
    prk = bytes.fromhex("077709362c2e32df0ddc3f0dc47bba6390b6c73bb50f9c3122ec844ad7c2b3e5")
    okm = ch._hkdf_expand(hashes.SHA256(), prk, bytes.fromhex("f0f1f2f3f4f5f6f7f8f9"), 42)
    assert okm == bytes.fromhex(
        "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865"
    )


def test_derive_epoch_keys_follows_documented_recipe():
    e = 5
    epoch_secret = ch._hkdf_expand(hashes.SHA256(), SECRET, b"gputravel/epoch/" + e.to_bytes(8, "big"), 32)
    km = keys(epoch=e)
    assert km.key == ch._hkdf_expand(hashes.SHA256(), epoch_secret, b"Lce00_h2d_user", 32)
    assert km.iv_mask == ch._hkdf_expand(hashes.SHA256(), epoch_secret, b"gputravel/ivmask/Lce00_h2d_user", 12)


# ----------------------------------------------------------------------------- IV layout
def test_build_iv_layout():
    assert build_iv(1, 0x0102030405060708) == bytes.fromhex("01000000 0807060504030201")
    assert build_iv(0xDEADBEEF, 0) == bytes.fromhex("efbeadde 0000000000000000")


def test_build_iv_range():
    with pytest.raises(CounterExhausted):
        build_iv(2**32, 1)
    with pytest.raises(CounterExhausted):
        build_iv(1, 2**64)
    with pytest.raises(CounterExhausted):
        build_iv(-1, 1)


def test_gcm_nonce_is_xor():
    iv = build_iv(1, 0x0102030405060708)
    mask = bytes(range(0xA0, 0xAC))
    assert gcm_nonce(iv, mask) == xor(iv, mask)
    assert gcm_nonce(gcm_nonce(iv, mask), mask) == iv


def test_key_material_validation_and_repr():
    with pytest.raises(BadInput):
        KeyMaterial("x", b"k" * 31, b"m" * 12)
    with pytest.raises(BadInput):
        KeyMaterial("x", b"k" * 32, b"m" * 11)
    km = keys()
    state = Sender(km).export_state()
    for obj in (km, state, Sender(km), Receiver(km)):
        text = repr(obj) + str(obj)
        assert km.key.hex() not in text and repr(km.key) not in text
        assert repr(km.iv_mask) not in text


# ----------------------------------------------------------------------------- counters
def test_first_message_uses_counter_one_and_receiver_tracks():
    sender, receiver = pair()
    km = keys()
    ct = sender.encrypt(b"hello")
    assert sender.message_counter == 1 and sender.channel_counter == 1
    # The known-answer tests pin the nonce of the first message to build_iv(1, cc) ^ mask;
    # here: a sender resumed after counter 1 produces something else for the same input.
    assert Sender(km, 1, 1).encrypt(b"hello") != ct
    assert receiver.decrypt(ct) == b"hello"
    assert receiver.message_counter == 1
    for i in range(2, 6):
        assert receiver.decrypt(sender.encrypt(bytes([i]))) == bytes([i])
    assert receiver.message_counter == sender.message_counter == 5


def test_replay_fails_and_does_not_advance():
    sender, receiver = pair()
    first = sender.encrypt(b"one")
    receiver.decrypt(first)
    with pytest.raises(IntegrityError):
        receiver.decrypt(first)
    assert receiver.message_counter == 1
    assert receiver.decrypt(sender.encrypt(b"two")) == b"two"


def test_reordering_fails():
    sender, receiver = pair()
    a, b = sender.encrypt(b"a"), sender.encrypt(b"b")
    with pytest.raises(IntegrityError):
        receiver.decrypt(b)
    assert receiver.decrypt(a) == b"a"
    assert receiver.decrypt(b) == b"b"


@pytest.mark.parametrize("index", [0, 5, -TAG_BYTES, -1])
def test_tamper_fails(index):
    sender, receiver = pair()
    ct = bytearray(sender.encrypt(b"some payload"))
    ct[index] ^= 0x01
    with pytest.raises(IntegrityError) as info:
        receiver.decrypt(bytes(ct))
    assert str(info.value) == "authenticated decryption failed"
    assert receiver.message_counter == 0


def test_wrong_aad_and_short_data_fail():
    sender, receiver = pair()
    ct = sender.encrypt(b"rpc", aad=b"seq=1")
    with pytest.raises(IntegrityError):
        receiver.decrypt(ct, aad=b"seq=2")
    with pytest.raises(IntegrityError):
        receiver.decrypt(ct)
    with pytest.raises(IntegrityError):
        receiver.decrypt(b"short")
    assert receiver.decrypt(ct, aad=b"seq=1") == b"rpc"


def test_implicit_rollover_bumps_channel_counter():
    sender, receiver = pair(max_message_counter=3, channel_counter=10)
    seen = []
    for i in range(7):
        msg = f"m{i}".encode()
        assert receiver.decrypt(sender.encrypt(msg)) == msg
        seen.append((sender.channel_counter, sender.message_counter))
        assert (receiver.channel_counter, receiver.message_counter) == seen[-1]
    assert seen == [(10, 1), (10, 2), (10, 3), (11, 1), (11, 2), (11, 3), (12, 1)]


def test_rollover_uses_the_new_channel_iv():
    km = keys()
    sender = Sender(km, 4, 3, max_message_counter=3)
    ct = sender.encrypt(b"x")
    assert Sender(km, 5, 0).encrypt(b"x") == ct


def test_counter_exhausted_at_channel_max():
    km = keys()
    sender = Sender(km, MAX_CHANNEL_COUNTER, 2, max_message_counter=3)
    sender.encrypt(b"last one")  # counter 3 on the last channel counter is still fine
    with pytest.raises(CounterExhausted):
        sender.encrypt(b"one too many")
    assert sender.message_counter == 3
    receiver = Receiver(km, MAX_CHANNEL_COUNTER, 3, max_message_counter=3)
    with pytest.raises(CounterExhausted):
        receiver.decrypt(b"\x00" * 20)


def test_bad_constructor_arguments():
    km = keys()
    with pytest.raises(BadInput):
        Sender(km, -1)
    with pytest.raises(BadInput):
        Sender(km, 1, 5, max_message_counter=3)
    with pytest.raises(BadInput):
        Sender(km, max_message_counter=0)
    with pytest.raises(BadInput):
        Sender(km).encrypt_into(b"abc", bytearray(3))


# ----------------------------------------------------------------------------- state
def test_export_import_continues_stream():
    sender, receiver = pair()
    for i in range(3):
        receiver.decrypt(sender.encrypt(bytes([i])))
    state = sender.export_state()
    assert isinstance(state, ChannelState)
    assert (state.label, state.channel_counter, state.message_counter) == ("Lce00_h2d_user", 1, 3)
    resumed = Sender.from_state(state)
    moved = Receiver.from_state(receiver.export_state())
    for i in range(3, 6):
        assert moved.decrypt(resumed.encrypt(bytes([i]))) == bytes([i])
    assert moved.message_counter == 6


def test_from_state_keeps_rollover_policy():
    sender, receiver = pair(max_message_counter=2)
    receiver.decrypt(sender.encrypt(b"a"))
    receiver.decrypt(sender.encrypt(b"b"))
    resumed = Sender.from_state(sender.export_state(), max_message_counter=2)
    resumed.encrypt(b"c")
    assert (resumed.channel_counter, resumed.message_counter) == (2, 1)


# ----------------------------------------------------------------------------- rotation
def test_epochs_labels_determinism():
    e0 = derive_epoch_keys(SECRET, 0, LABELS)
    e1 = derive_epoch_keys(SECRET, 1, LABELS)
    assert e0 == derive_epoch_keys(SECRET, 0, LABELS)
    for label in LABELS:
        assert e0[label].key != e1[label].key
        assert e0[label].iv_mask != e1[label].iv_mask
    assert e0[LABELS[0]].key != e0[LABELS[1]].key
    assert e0[LABELS[0]].iv_mask != e0[LABELS[1]].iv_mask
    assert derive_epoch_keys(bytes(48), 0, LABELS)[LABELS[0]].key != e0[LABELS[0]].key


def test_old_epoch_sender_is_rejected_by_new_epoch_receiver():
    old = Sender(keys(epoch=0))
    new = Receiver(keys(epoch=1))
    with pytest.raises(IntegrityError):
        new.decrypt(old.encrypt(b"stale holder"))


def test_retained_keys_cannot_follow_rotation():
    # A holder keeps everything it saw in epoch 0 but never the session secret.
    old = derive_epoch_keys(SECRET, 0, LABELS)
    new = derive_epoch_keys(SECRET, 1, LABELS)
    sha = hashes.SHA256()
    for label in LABELS:
        k0 = old[label]
        ratchets = {
            # H100's ratchet: HKDF-Expand(SHA256(old key), label).
            ch._hkdf_expand(sha, hashlib.sha256(k0.key).digest(), label.encode(), 32),
            ch._hkdf_expand(sha, k0.key, label.encode(), 32),
            hashlib.sha256(k0.key).digest(),
            ch._hkdf_expand(sha, hashlib.sha256(k0.key + k0.iv_mask).digest(), label.encode(), 32),
        }
        assert new[label].key not in ratchets
        assert new[label].key not in {k.key for k in old.values()}


def test_derive_epoch_keys_input_checks():
    with pytest.raises(BadInput):
        derive_epoch_keys(b"x" * 31, 0, LABELS)
    with pytest.raises(BadInput):
        derive_epoch_keys(SECRET, -1, LABELS)
    with pytest.raises(BadInput):
        derive_epoch_keys(SECRET, 0, ["gputravel/ivmask/x"])
    with pytest.raises(BadInput):
        derive_epoch_keys(SECRET, 0, ["é"])


# ----------------------------------------------------------------------------- accept_at
def test_accept_at_newer_only():
    km = keys("Lsem_d2h")
    sender, receiver = Sender(km), Receiver(km)
    payloads = []
    for i in range(4):
        ct = sender.encrypt(i.to_bytes(4, "little"))
        payloads.append((sender.message_counter, sender.channel_counter, ct))
    # The CPU missed updates 1 and 2: jumping ahead is fine.
    m, c, ct = payloads[2]
    assert receiver.accept_at(m, c, ct) == (2).to_bytes(4, "little")
    assert (receiver.channel_counter, receiver.message_counter) == (1, 3)
    for m, c, ct in payloads[:3]:  # equal or older: rejected
        with pytest.raises(IntegrityError):
            receiver.accept_at(m, c, ct)
    m, c, ct = payloads[3]
    with pytest.raises(IntegrityError):
        receiver.accept_at(m, c, ct[:-1] + bytes([ct[-1] ^ 0x80]))
    with pytest.raises(IntegrityError):  # right bytes, lying index
        receiver.accept_at(m + 1, c, ct)
    assert receiver.message_counter == 3
    assert receiver.accept_at(m, c, ct) == (3).to_bytes(4, "little")


def test_accept_at_newer_channel_counter_wins():
    km = keys("Lsem_d2h")
    receiver = Receiver(km, 1, 50)
    sender = Sender(km, 2, 0)
    ct = sender.encrypt(b"sem")
    assert receiver.accept_at(1, 2, ct) == b"sem"
    with pytest.raises(IntegrityError):
        receiver.accept_at(0, 3, ct)  # message counter 0 is never used


# ----------------------------------------------------------------------------- decrypt_into
def test_decrypt_into_failure_zeroes_out():
    sender, receiver = pair()
    ct = bytearray(sender.encrypt(b"A" * 64))
    ct[3] ^= 0xFF
    out = bytearray(b"\x55" * 64)
    with pytest.raises(IntegrityError):
        receiver.decrypt_into(bytes(ct), out)
    assert out == bytearray(64)
    assert receiver.message_counter == 0


# ----------------------------------------------------------------------------- property
@settings(max_examples=examples(60), deadline=None)
@given(
    plaintext=st.binary(max_size=256),
    aad=st.none() | st.binary(max_size=32),
    bit=st.integers(min_value=0),
)
def test_roundtrip_and_any_bit_flip_rejected(plaintext, aad, bit):
    sender, receiver = pair()
    ct = sender.encrypt(plaintext, aad)
    assert len(ct) == len(plaintext) + TAG_BYTES
    bit %= len(ct) * 8
    forged = bytearray(ct)
    forged[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(IntegrityError):
        receiver.decrypt(bytes(forged), aad)
    assert receiver.decrypt(ct, aad) == plaintext
