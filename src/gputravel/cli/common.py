"""What the command-line modules share: writing a ``--json`` output."""

from __future__ import annotations

import json
from pathlib import Path

from gputravel.files import atomic_write_bytes


def write_json(path: Path, data: object) -> None:
    """Write ``data`` as indented JSON, creating the directory, whole or not at all."""
    atomic_write_bytes(Path(path), (json.dumps(data, indent=2) + "\n").encode())
