"""Whole-or-nothing file writes, shared by every layer that leaves files behind (shards and
their tokenizer record, a training run's directory and report, the command line's ``--json``)."""

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
    """Write a file through a temporary sibling and os.replace, so a crash never leaves a
    half-written file under the final name (a reader would take it for a real shard)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The temporary name ends in .tmp, so data/shards.py list_shards never picks it up.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes it 0600; give it the mode open() would (a dataset is read by its
        # holder's CVM, which runs under a uid of its own: cohort/isolation.py).
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


#: What a data holder's dataset on disk is, the one definition (issue 26): "raw", one file
#: whose bytes travel as they are; "tokens", llm.c shards (a directory or one .bin shard) or
#: text, travelling as uint16 tokens. A cohort that only travels moves raw bytes unless told
#: (cohort/config.py HolderSpec, holder/cvm.py HolderConfig); a holder of the services feeds a
#: training job, so its config's default is tokens (service/config.py HolderService).
DatasetFormat = Literal["raw", "tokens"]
DATASET_FORMATS: tuple[DatasetFormat, ...] = get_args(DatasetFormat)
RAW: Final = "raw"
TOKENS: Final = "tokens"


def dataset_kind(fmt: str) -> str:
    """What must exist for a dataset of format `fmt`: "file" (raw) or "path" (tokens: a file or
    a directory). ValueError, saying the formats there are, for any other `fmt`."""
    if fmt not in DATASET_FORMATS:
        raise ValueError(f"unknown dataset format {fmt!r}: use {' or '.join(map(repr, DATASET_FORMATS))}")
    return "file" if fmt == RAW else "path"


#: What `not_data` says of a path that is not there.
MISSING = "does not exist"


def not_data(path: Path | str) -> str | None:
    """None if `path` is a regular file or a directory (links followed); else why it cannot be
    read as data: MISSING, "is not a regular file or directory" (a FIFO blocks its reader until a
    writer comes, a device may never end: refused before anything starts), or "cannot be read"."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return MISSING
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else "is not a regular file or directory"


def open_plain(path: Path) -> int:
    """A descriptor of `path` if it is a plain file, without following a link or blocking on a
    FIFO. For root reading files another account wrote (a party's own directory): a link or a
    FIFO left there must not send it to another file or stall it. OSError otherwise."""
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
    """Copy the plain file `src` (open_plain) to `dest`, replacing whatever is there, a link
    included, never writing through it; OSError if `src` is over `limit` bytes."""
    with os.fdopen(open_plain(Path(src)), "rb") as inp:
        if limit is not None and os.fstat(inp.fileno()).st_size > limit:
            raise OSError(f"{src} is over {limit} bytes")
        atomic_write(Path(dest), lambda out: shutil.copyfileobj(inp, out))
