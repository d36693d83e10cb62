"""Canaries: each holder's dataset is random bytes with its own 16-byte marker every 4 KiB (a leaked record
shows up many times), searched for, with 32-byte samples between markers, in whatever an attacker read."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

MARKER_BYTES = 16
SAMPLE_BYTES = 32
SAMPLES = 8
SPACING = 4096


@dataclass(frozen=True)
class Needles:
    holder: str
    marker: bytes = field(repr=False)
    samples: tuple[bytes, ...] = field(repr=False)


@dataclass(frozen=True)
class Found:
    marker_bytes: int = 0
    sample_bytes: int = 0
    scanned_bytes: int = 0

    @property
    def total(self) -> int:
        return self.marker_bytes + self.sample_bytes

    def __add__(self, other: Found) -> Found:
        return Found(self.marker_bytes + other.marker_bytes, self.sample_bytes + other.sample_bytes,
                     self.scanned_bytes + other.scanned_bytes)


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
            found += Found(data.count(n.marker) * MARKER_BYTES,
                           sum(data.count(s) for s in n.samples) * SAMPLE_BYTES)
    return found
