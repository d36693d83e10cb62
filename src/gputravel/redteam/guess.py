"""Trying one kept key at many IVs on one captured ciphertext, at the cost of about one decryption.

AES-GCM's tag is ``E_K(J0) xor GHASH_H(ciphertext)`` (SP 800-38D): only ``E_K(J0)`` depends on the IV. So
GHASH is computed once per key and ciphertext (by AES-GCM itself, with the ciphertext as associated data,
then corrected for the length block), and each guessed IV costs one AES block. A guess whose tag matches is
then opened for real (:func:`gputravel.redteam.holder.try_open`), so this only skips the IVs that cannot open:
the attack tries every key at every IV as before, about 30 times faster (the red team's mallory spent most of
its CPU in failed decryptions of 1 MiB records)."""

from __future__ import annotations

from collections.abc import Sequence

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gputravel.crypto.channel import ChannelState, build_iv, gcm_nonce
from gputravel.protocol.layout import TAG_BYTES

_R = 0xE1 << 120  # GCM's reduction polynomial, in its bit-reflected order
_ZERO = bytes(16)


def gf_mul(x: int, y: int) -> int:
    """The product in GF(2^128) as GCM defines it (SP 800-38D, algorithm 1; bit 0 is the MSB)."""
    z, v = 0, y
    for i in range(127, -1, -1):
        if (x >> i) & 1:
            z ^= v
        v = (v >> 1) ^ _R if v & 1 else v >> 1
    return z


def _j0(nonce: bytes) -> bytes:
    return nonce + b"\x00\x00\x00\x01"  # a 96-bit nonce's pre-counter block


def candidates(state: ChannelState, messages: Sequence[int], data: bytes) -> list[int]:
    """The message counters among ``messages`` at which ``data`` (ciphertext||tag, no associated data)
    could open under ``state``'s key and channel counter: those whose GCM tag matches. A sound filter: every
    counter at which it opens is returned (a counter out of the IV's range cannot open and is not)."""
    if len(data) < TAG_BYTES:
        return []
    body, tag = memoryview(data)[:-TAG_BYTES], bytes(data[-TAG_BYTES:])
    valid = [m for m in messages if 1 <= m <= 0xFFFFFFFF and 0 <= state.channel_counter < 2**64]
    if not valid:
        return []
    nonces = [gcm_nonce(build_iv(m, state.channel_counter), state.iv_mask) for m in valid]
    blocks = Cipher(algorithms.AES(state.key), modes.ECB()).encryptor()  # single blocks: H and each E_K(J0)
    out = blocks.update(b"".join([_ZERO, *(_j0(n) for n in nonces)])) + blocks.finalize()
    h = int.from_bytes(out[:16], "big")
    masks = [int.from_bytes(out[16 * (k + 1) : 16 * (k + 2)], "big") for k in range(len(nonces))]
    # GHASH with the body as associated data: the same blocks, only the length block differs.
    as_aad = int.from_bytes(AESGCM(state.key).encrypt(nonces[0], b"", body), "big") ^ masks[0]
    bits = 8 * len(body)
    ghash = as_aad ^ gf_mul((bits << 64) ^ bits, h)
    want = int.from_bytes(tag, "big")
    return [m for m, mask in zip(valid, masks, strict=True) if mask ^ ghash == want]
