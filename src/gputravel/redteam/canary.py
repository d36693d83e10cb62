"""Canaries: each holder's dataset is random bytes with its own 16-byte marker every 4 KiB (a leaked record
shows up many times), searched for, with 32-byte samples between markers, in whatever an attacker read.

An image record dataset (issue 27) carries them as images: the shipped digits, each holder's own, with one
8x8 image in every 4 KiB replaced by the holder's canary image (64 random bytes); its samples are whole
digit images that only this holder holds."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gputravel.data.records import load_records, write_records

MARKER_BYTES = 16
SAMPLE_BYTES = 32
SAMPLES = 8
SPACING = 4096


@dataclass(frozen=True)
class Needles:
    holder: str
    marker: bytes = field(repr=False)  # each one found stands for the SPACING bytes of the dataset it marks
    samples: tuple[bytes, ...] = field(repr=False)


@dataclass(frozen=True)
class Found:
    marker_bytes: int = 0
    sample_bytes: int = 0
    scanned_bytes: int = 0
    markers: int = 0  # how many markers marker_bytes is

    @property
    def total(self) -> int:
        return self.marker_bytes + self.sample_bytes

    def __add__(self, other: Found) -> Found:
        return Found(self.marker_bytes + other.marker_bytes, self.sample_bytes + other.sample_bytes,
                     self.scanned_bytes + other.scanned_bytes, self.markers + other.markers)


def make_dataset(path: Path, holder: str, nbytes: int) -> Needles:
    """Write a marked random dataset; return what to search for."""
    data = bytearray(os.urandom(nbytes))
    marker = os.urandom(MARKER_BYTES)
    for off in range(0, nbytes - MARKER_BYTES + 1, SPACING):
        data[off : off + MARKER_BYTES] = marker
    step = max(nbytes // SAMPLES // SPACING, 1) * SPACING
    samples = tuple(bytes(data[off + 1024 : off + 1024 + SAMPLE_BYTES]) for off in range(0, nbytes - SPACING, step))
    path.write_bytes(data)
    return Needles(holder, marker, samples[:SAMPLES])


def search(files: Iterable[Path], needles: Iterable[Needles]) -> Found:
    """Bytes of the holders' data found in ``files`` (each read whole; they are tens of MiB)."""
    needles = list(needles)
    found = Found()
    for path in files:
        data = Path(path).read_bytes()
        found += Found(scanned_bytes=len(data))
        for n in needles:
            markers = count(data, n.marker)
            found += Found(markers * len(n.marker), sum(count(data, s) * len(s) for s in n.samples), markers=markers)
    return found


def count(data: bytes, needle: bytes) -> int:
    """``data.count(needle)`` (non-overlapping, from the left), found through the needle's longest run of
    non-zero bytes. CPython's search skips only past bytes the needle lacks, so a needle holding a zero byte
    (a digit image, or a random marker one time in 16) steps a byte at a time through zeroed memory, which
    most of what the host snoops is: ten times slower there."""
    core, at = _core(needle)
    if len(core) == len(needle) or not core:
        return data.count(needle)
    n, start, hit = 0, 0, data.find(core, at)
    while hit >= 0:
        begin = hit - at
        if data[begin : begin + len(needle)] == needle:
            n, start = n + 1, begin + len(needle)
            hit = data.find(core, start + at)
        else:
            hit = data.find(core, hit + 1)
    return n


def _core(needle: bytes) -> tuple[bytes, int]:
    """The needle's longest run without a zero byte, and where it starts."""
    best, at, off = b"", 0, 0
    for run in needle.split(b"\0"):
        if len(run) > len(best):
            best, at = run, off
        off += len(run) + 1
    return best, at


# ----------------------------------------------------------------------------- image records
IMAGE_BYTES = 64  # a digit, uint8[1,8,8]: the canary image is as large


def make_image_datasets(root: Path, holders: Sequence[str], nbytes: int) -> dict[str, Needles]:
    """Image record datasets ``root/HOLDER`` (the `image` demo's digits, dealt and packed as its holders'
    are, then repeated to `nbytes`), one canary image in every 4 KiB; return what to search for in each."""
    from gputravel.data.demo_records import demo_holders  # lazy: Pillow, for this data only

    packed = [load_records(path) for _, path in demo_holders("image", len(holders), root / "packed")]
    images = [{bytes(r) for r in np.ascontiguousarray(p.array["image"]).reshape(len(p), -1)} for p in packed]
    needles = {}
    for h, (holder, records) in enumerate(zip(holders, packed, strict=True)):
        array = np.resize(records.array, nbytes // records.schema.record_bytes)  # repeated to the size
        marker = os.urandom(IMAGE_BYTES)
        every = max(SPACING // records.schema.record_bytes, 1)
        image = array["image"]
        image[::every] = np.frombuffer(marker, np.uint8).reshape(image.shape[1:])
        others = set().union(*(s for k, s in enumerate(images) if k != h))
        write_records(root / holder, records.schema, array)
        needles[holder] = Needles(holder, marker, _own_images(images[h] - others))
    return needles


def _own_images(images: set[bytes]) -> tuple[bytes, ...]:
    """The holder's most varied images that no other holder holds: none is found by chance elsewhere."""
    return tuple(sorted(images, key=lambda b: (-len(set(b)), b))[:SAMPLES])
