"""Everything an attacker read, appended to ``ROOT/<attack>/<who>-<kind>.bin`` for the red team to search
(in the cohort's private directory, deleted with it, never printed). Snapshots keep each 64 KiB page once,
with the next 64 bytes, so a marker straddling a page boundary is still found whole."""

from __future__ import annotations

import hashlib
from pathlib import Path

PAGE = 64 * 1024
OVERLAP = 64  # longer than any needle the scanner looks for


class Loot:
    def __init__(self, root: Path, who: str) -> None:
        self.root = root
        self.who = who
        self.row = "boot"
        self._seen: set[bytes] = set()

    def mark(self, row: str) -> None:
        self.row = row
        self._seen = set()

    def path(self, kind: str) -> Path:
        d = self.root / self.row
        d.mkdir(parents=True, exist_ok=True)
        return d / f"{self.who}-{kind}.bin"

    def keep(self, kind: str, data: bytes | bytearray | memoryview) -> None:
        """Append raw bytes the attacker obtained (a read-back, a decryption, a blob)."""
        if len(data):
            with open(self.path(kind), "ab") as out:
                out.write(data)

    def snapshot(self, kind: str, mem: memoryview) -> None:
        """Append every page of ``mem`` not seen before in this attack."""
        with open(self.path(kind), "ab") as out:
            for start in range(0, len(mem), PAGE):
                piece = mem[start : start + PAGE + OVERLAP]
                digest = hashlib.blake2b(piece, digest_size=16).digest()
                if digest not in self._seen:
                    self._seen.add(digest)
                    out.write(piece)

