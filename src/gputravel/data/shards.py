"""llm.c token shards (version 1, as llm.c's `dev/data/data_common.py` writes them for GPT-2): a
header of 256 little-endian int32 (magic, version, token count) then the tokens as uint16. Shards
of llm.c's own scripts load here unchanged, and ours load in llm.c.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import IO

import numpy as np

from gputravel.errors import BadInput
from gputravel.files import atomic_write

MAGIC = 20240520
VERSION = 1  # llm.c: version 1 = uint16 tokens (GPT-2); version 2 = uint32 tokens (Llama 3)
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
MAX_TOKENS = 2**31 - 1  # the count is an int32 in the header
SHARD_GLOB = "*.bin"


def _as_tokens(path: Path, tokens: np.ndarray | Sequence[int]) -> np.ndarray:
    """`tokens` as little-endian uint16, once checked to fit a version 1 shard."""
    arr = np.asarray(tokens)
    if arr.size == 0:
        return np.empty(0, dtype=TOKEN_DTYPE)
    if arr.ndim != 1:
        raise BadInput(f"{path}: tokens must be a 1-D sequence, got shape {arr.shape}; flatten them first")
    if arr.dtype.kind not in "iu":
        raise BadInput(f"{path}: tokens must be integers, got dtype {arr.dtype}; convert them to integer ids")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > 65535:
        bad = lo if lo < 0 else hi
        raise BadInput(f"{path}: token {bad} does not fit a uint16 shard (0..65535); "
                       "use a tokenizer with at most 65536 ids")
    if arr.size > MAX_TOKENS:
        raise BadInput(f"{path}: {arr.size} tokens is more than a shard's int32 count holds; split them")
    return arr.astype(TOKEN_DTYPE, copy=False)


def write_shard(path: Path | str, tokens: np.ndarray | Sequence[int]) -> None:
    """Write `tokens` (ids in 0..65535) as an llm.c version 1 shard, atomically."""
    path = Path(path)
    arr = _as_tokens(path, tokens)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, arr.size)

    def write(f: IO[bytes]) -> None:
        f.write(header.tobytes())
        f.write(arr.tobytes())

    atomic_write(path, write)


def _read_header(path: Path) -> int:
    """The token count, once the header is checked against the file size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except FileNotFoundError:
        raise BadInput(f"shard {path} does not exist; check the path") from None
    except IsADirectoryError:
        raise BadInput(f"shard {path} is a directory; pass a .bin file (or use load_tokens for a directory)") from None
    if len(raw) < HEADER_BYTES:
        raise BadInput(f"{path}: {size} bytes is shorter than an llm.c shard header ({HEADER_BYTES} bytes); "
                       "the file is truncated or not a shard")
    # The header's fields are named, never quoted: a file that is no shard holds other bytes there,
    # and these words reach the launcher when a holder's data fails to load.
    magic, version, count = (int(v) for v in np.frombuffer(raw, dtype="<i4", count=3))
    if magic != MAGIC:
        raise BadInput(f"{path}: not an llm.c token shard (its first 4 bytes are not llm.c's magic {MAGIC}); "
                       "pass shards written by llm.c or `gputravel data prepare`")
    if version != VERSION:
        raise BadInput(f"{path}: the llm.c shard's version is not supported (only version {VERSION}, "
                       "uint16 GPT-2 tokens); re-export the data as version 1")
    if count < 0:
        raise BadInput(f"{path}: the header's token count is negative; the shard is corrupt, re-write it")
    expected = HEADER_BYTES + count * TOKEN_DTYPE.itemsize
    if size < expected:
        raise BadInput(f"{path}: truncated: the file has {size} bytes, fewer than its header's token count "
                       "needs; re-write the shard")
    if size > expected:
        raise BadInput(f"{path}: trailing bytes: the file has {size} bytes, more than its header's token count "
                       "needs; re-write the shard")
    return count


def read_shard(path: Path | str) -> np.ndarray:
    """Return a shard's tokens as a read-only uint16 array (memory-mapped: shards can be large)."""
    path = Path(path)
    count = _read_header(path)
    if count == 0:
        return np.empty(0, dtype=TOKEN_DTYPE)  # mmap cannot map zero bytes
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(count,))


def list_shards(directory: Path | str, pattern: str = SHARD_GLOB) -> list[Path]:
    """The shards in `directory`, sorted by file name (the training order)."""
    directory = Path(directory)
    if not directory.is_dir():
        what = "does not exist" if not directory.exists() else "is not a directory"
        raise BadInput(f"shard directory {directory} {what}; pass a directory of .bin shards")
    shards = sorted((p for p in directory.glob(pattern) if p.is_file()), key=lambda p: p.name)
    if not shards:
        raise BadInput(f"no {pattern} shards in {directory}; run `gputravel data prepare --out {directory}` "
                       "or point at the directory that holds them")
    return shards
