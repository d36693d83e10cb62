"""The red team's fast key guess (redteam/guess.py): it names exactly the IVs at which a kept key opens a
captured ciphertext, as trying each IV with a real decryption does (mallory then opens those for real)."""

from __future__ import annotations

import os

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from msgspec import structs

from gputravel.crypto.channel import Sender, derive_epoch_keys
from gputravel.redteam.guess import candidates, gf_mul
from gputravel.redteam.holder import MAX_IV_GUESSES, try_open

GUESSES = range(1, MAX_IV_GUESSES + 1)


def _sender(channel: int = 5) -> Sender:
    keys = derive_epoch_keys(os.urandom(32), 3, ["Lce00_h2d_user"])["Lce00_h2d_user"]
    return Sender(keys, channel_counter=channel)


def _opens_at(state, data: bytes) -> list[int]:
    return [m for m in GUESSES if try_open(state, m, data) is not None]


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 100, 4096, 1 << 20])
def test_the_guess_names_the_iv_a_real_decryption_opens_at_and_no_other(size: int) -> None:
    sender = _sender()
    sent = [sender.encrypt(os.urandom(size)) for _ in range(3)]
    state = sender.export_state()
    for k, data in enumerate(sent):
        assert candidates(state, GUESSES, data) == _opens_at(state, data) == [k + 1]


def test_a_tampered_ciphertext_another_key_or_channel_opens_nowhere() -> None:
    sender = _sender()
    data = sender.encrypt(os.urandom(4096))
    state = sender.export_state()
    flipped = bytearray(data)
    flipped[7] ^= 1
    other_key = structs.replace(state, key=os.urandom(32))
    other_channel = structs.replace(state, channel_counter=state.channel_counter + 1)
    for s, d in ((state, bytes(flipped)), (other_key, data), (other_channel, data)):
        assert candidates(s, GUESSES, d) == _opens_at(s, d) == []
    assert candidates(state, GUESSES, data[:10]) == []  # shorter than a tag
    assert candidates(state, [0, 2**32], data) == []  # counters no IV has


def test_gf_mul_is_gcms_multiplication() -> None:
    """GHASH of one block X under H is X*H: AES-GCM's tag of an empty message with X as associated
    data, less E_K(J0), equals the product computed here (and the field's unit is 1 << 127)."""
    key, nonce, x = os.urandom(32), os.urandom(12), os.urandom(16)
    aead = AESGCM(key)
    mask = int.from_bytes(aead.encrypt(nonce, b"", b""), "big")  # E_K(J0): GHASH of nothing is 0
    h = int.from_bytes(_ecb(key, bytes(16)), "big")
    length = 128 << 64  # one block of associated data, no ciphertext
    got = int.from_bytes(aead.encrypt(nonce, b"", x), "big") ^ mask
    assert got == gf_mul(gf_mul(int.from_bytes(x, "big"), h) ^ length, h)
    assert gf_mul(1 << 127, h) == h == gf_mul(h, 1 << 127)


def _ecb(key: bytes, block: bytes) -> bytes:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    enc = Cipher(algorithms.AES(key), modes.ECB()).encryptor()  # one block: H
    return enc.update(block) + enc.finalize()
