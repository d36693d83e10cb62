"""Whole-or-nothing file writes, and reads that follow no link, for every layer that keeps files."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Final, Literal, get_args


def _umask() -> int:
    """This process's umask, read without setting it (os.umask would race other threads)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    return 0o022


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write through a temporary sibling and os.replace: a crash never leaves a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The temporary name ends in .tmp, so data/shards.py list_shards never picks it up.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # The mode open() would give (mkstemp's 0600): a holder's CVM runs under its own uid.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """``atomic_write`` of a whole byte string: readers see the old file or the new one."""
    atomic_write(path, lambda f: f.write(data))


def write_json(path: Path, data: object) -> None:
    """Write ``data`` as indented JSON, creating the directory, whole or not at all."""
    atomic_write_bytes(Path(path), (json.dumps(data, indent=2) + "\n").encode())


#: A holder's dataset on disk: "raw", one file whose bytes travel as they are; "tokens", llm.c
#: shards or text, travelling as uint16 tokens; "records", a record dataset's directory
#: (data/records.py), travelling as whole records in manifest pieces.
DatasetFormat = Literal["raw", "tokens", "records"]
DATASET_FORMATS: tuple[DatasetFormat, ...] = get_args(DatasetFormat)
RAW: Final = "raw"
TOKENS: Final = "tokens"
RECORDS: Final = "records"


def dataset_kind(fmt: str) -> str:
    """What must exist for a dataset of format `fmt`: "file" (raw) or "path" (tokens, records); else ValueError."""
    if fmt not in DATASET_FORMATS:
        known = ", ".join(map(repr, DATASET_FORMATS[:-1]))
        raise ValueError(f"unknown dataset format {fmt!r}: use {known} or {DATASET_FORMATS[-1]!r}")
    return "file" if fmt == RAW else "path"


#: A "records" holder's held-out share unless its config says otherwise: records kept for
#: evaluation, never trained on, chosen by a permutation seeded with its eval_seed (data/records.py).
EVAL_SHARE = 0.2


def check_split(share: float, seed: int) -> None:
    """A holder's held-out share and seed, checked before anything boots; else ValueError."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
        raise ValueError(f"eval_share must be at least 0 and below 1, got {share!r}")
    if type(seed) is not int or seed < 0:
        raise ValueError(f"eval_seed must be a non-negative integer, got {seed!r}")


#: What `not_data` says of a path that is not there.
MISSING = "does not exist"


def not_data(path: Path | str) -> str | None:
    """None if `path` is a regular file or directory (links followed), else why it cannot be data:
    a FIFO would block its reader and a device may never end, so both are refused up front."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return MISSING
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else "is not a regular file or directory"


def open_plain(path: Path) -> int:
    """A descriptor of the plain file `path`, not following a link nor blocking on a FIFO (root
    reading another account's files must not be redirected or stalled); OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a plain file")
    return fd


def read_plain(path: Path, limit: int = -1, offset: int = 0) -> bytes:
    """Up to `limit` bytes (-1: all) of the plain file at `path`, from `offset` (open_plain)."""
    with os.fdopen(open_plain(Path(path)), "rb") as f:
        f.seek(offset)
        return f.read(limit)


def copy_plain(src: Path, dest: Path, limit: int | None = None) -> None:
    """Copy the plain file `src` to `dest`, replacing (never writing through) a link; OSError over `limit`."""
    with os.fdopen(open_plain(Path(src)), "rb") as inp:
        if limit is not None and os.fstat(inp.fileno()).st_size > limit:
            raise OSError(f"{src} is over {limit} bytes")
        atomic_write(Path(dest), lambda out: shutil.copyfileobj(inp, out))
