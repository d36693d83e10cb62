"""The red team's canary count (redteam/canary.count): exactly ``bytes.count``, for needles with zero bytes
(digit images), found through their longest zero-free run."""

from __future__ import annotations

import os
import random

import pytest

from gputravel.redteam.canary import count

IMAGE = bytes([0, 0, 5, 13, 9, 1, 0, 0, 0, 0, 13, 15, 10, 15, 5, 0, 0, 3, 15, 2, 0, 11, 8, 0] * 2)


@pytest.mark.parametrize("seed", range(4))
def test_count_is_bytes_count_on_small_alphabets(seed: int) -> None:
    """Many zeros and few other bytes: overlaps, near misses and runs of the needle's core abound."""
    rng = random.Random(seed)
    for _ in range(2000):
        needle = bytes(rng.choice((0, 0, 1, 2, 255)) for _ in range(rng.randint(1, 12)))
        data = bytes(rng.choice((0, 0, 0, 1, 2, 255)) for _ in range(rng.randint(0, 160)))
        assert count(data, needle) == data.count(needle), (needle, data)


def test_count_finds_images_in_zeroed_memory_as_bytes_count_does() -> None:
    memory = bytearray(1 << 20)
    for at in (0, 4096, 4096 + len(IMAGE), 77777, len(memory) - len(IMAGE)):
        memory[at : at + len(IMAGE)] = IMAGE
    memory[9000 : 9000 + len(IMAGE)] = IMAGE[:10] + b"\x0e" + IMAGE[11:]  # one byte off: not an image
    random_part = os.urandom(4096)
    for data in (bytes(memory), bytearray(memory), bytes(memory) + random_part):
        assert count(data, IMAGE) == data.count(IMAGE) == 5
    assert count(random_part, os.urandom(16)) == 0 and count(b"", IMAGE) == 0
