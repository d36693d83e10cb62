"""llm.c token shards: the on-disk format of a holder's training tokens.

A shard is what llm.c's `dev/data/data_common.py` writes for GPT-2 (version 1): a header of
256 little-endian int32 (magic 20240520, version 1, token count, the rest zero) followed by
the tokens as little-endian uint16. Shards written by llm.c's own scripts load here
unchanged, and ours load in llm.c.

`load_tokens` turns whatever a holder points at (a shard directory, one shard, text) into
one token array. Its concatenation order, shards sorted by file name, is part of the
training contract: a local loader and the travelling loader must see the same tokens.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

import numpy as np

from gputravel.errors import BadInput

if TYPE_CHECKING:
    from gputravel.data.tokenizer import Tokenizer

MAGIC = 20240520
VERSION = 1  # llm.c: version 1 = uint16 tokens (GPT-2); version 2 = uint32 tokens (Llama 3)
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
MAX_TOKENS = 2**31 - 1  # the count is an int32 in the header
SHARD_GLOB = "*.bin"


@dataclass(frozen=True, eq=False)  # eq=False: comparing arrays element-wise has no single truth value
class HolderTokens:
    """One holder's training tokens, ready for a loader.

    tokens: the concatenation of every shard (or text document), read-only uint16.
    tokenizer: the tokenizer's name ("gpt2", "bytes", ...); vocab_size and eot come with it
    so a trainer can size the embedding without loading the tokenizer itself.
    files: the files the tokens came from, in concatenation order.
    """

    tokens: np.ndarray
    tokenizer: str
    files: tuple[str, ...]
    vocab_size: int
    eot: int

    def __len__(self) -> int:
        return int(self.tokens.size)


# ----------------------------------------------------------------------------- writing
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
    # The temporary name ends in .tmp, so list_shards never picks it up.
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


def _as_tokens(path: Path, tokens: np.ndarray | Sequence[int]) -> np.ndarray:
    """Check that `tokens` fit a version 1 shard and return them as little-endian uint16."""
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


# ----------------------------------------------------------------------------- reading
def _read_header(path: Path) -> tuple[int, int]:
    """Validate the header against the file size; return (token count, file size)."""
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
    magic, version, count = (int(v) for v in np.frombuffer(raw, dtype="<i4", count=3))
    if magic != MAGIC:
        raise BadInput(f"{path}: not an llm.c token shard (magic {magic}, expected {MAGIC}); "
                       "pass shards written by llm.c or `gputravel data prepare`")
    if version != VERSION:
        raise BadInput(f"{path}: llm.c shard version {version} is not supported (only version {VERSION}, "
                       "uint16 GPT-2 tokens); re-export the data as version 1")
    if count < 0:
        raise BadInput(f"{path}: the header's token count is negative ({count}); the shard is corrupt, re-write it")
    _check_size(path, count, size)
    return count, size


def _check_size(path: Path, count: int, size: int) -> None:
    expected = HEADER_BYTES + count * TOKEN_DTYPE.itemsize
    if size < expected:
        raise BadInput(f"{path}: truncated: the header says {count} tokens ({expected} bytes in all) "
                       f"but the file has {size} bytes; re-write the shard")
    if size > expected:
        raise BadInput(f"{path}: {size - expected} trailing bytes: the header says {count} tokens "
                       f"({expected} bytes in all) but the file has {size} bytes; re-write the shard")


def read_shard(path: Path | str) -> np.ndarray:
    """Return a shard's tokens as a read-only uint16 array (memory-mapped: shards can be large)."""
    path = Path(path)
    count, _ = _read_header(path)
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


# ----------------------------------------------------------------------------- one holder
def load_tokens(path: Path | str, tokenizer: str | Tokenizer | None = None) -> HolderTokens:
    """Load a holder's tokens from a directory of shards, one `.bin` shard, a text file, or a
    directory of `.txt` files (tokenized on the fly, documents delimited as `prepare` does).

    The tokenizer of shards comes from `tokenizer.json` next to them. llm.c's own scripts do
    not write that record: then `tokenizer` names it, and without either "gpt2" is assumed,
    since GPT-2 tokens are what llm.c's version 1 shards hold. For text, `tokenizer` picks the
    tokenizer (default: `default_tokenizer()`, GPT-2 when available offline, else bytes).
    """
    path = Path(path)
    if not path.exists():
        raise BadInput(f"{path} does not exist; pass a shard directory, a .bin shard or text files")
    if path.is_dir() and any(path.glob(SHARD_GLOB)):
        return _load_shards(path, list_shards(path), tokenizer)
    if path.is_file() and path.suffix == ".bin":
        return _load_shards(path.parent, [path], tokenizer)
    return _load_text(path, tokenizer)


def _load_shards(directory: Path, shards: list[Path], tokenizer: str | Tokenizer | None) -> HolderTokens:
    # Imported here: the tokenizer module builds on this one (it writes its record atomically).
    from gputravel.data.tokenizer import resolve_record

    record = resolve_record(directory, tokenizer)
    parts = []
    for shard in shards:
        tokens = read_shard(shard)
        _check_vocab(shard, tokens, record.name, record.vocab_size)
        parts.append(tokens)
    return _holder(directory, parts, record.name, record.vocab_size, record.eot, shards)


def _load_text(path: Path, tokenizer: str | Tokenizer | None) -> HolderTokens:
    # Imported here: prepare and tokenizer build on this module, which stays free of cycles.
    from gputravel.data.prepare import encode_files, text_files
    from gputravel.data.tokenizer import default_tokenizer, get_tokenizer

    if tokenizer is None:
        tok = default_tokenizer()
    else:
        tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    encoded = list(encode_files(text_files([path]), tok))  # empty files add no document
    return _holder(path, [t for _, t in encoded], tok.name, tok.vocab_size, tok.eot, [f for f, _ in encoded])


def _check_vocab(shard: Path, tokens: np.ndarray, name: str, vocab_size: int) -> None:
    if tokens.size and int(tokens.max()) >= vocab_size:
        raise BadInput(f"{shard}: token {int(tokens.max())} is outside the {name} vocabulary ({vocab_size} ids); "
                       "the shards were written with another tokenizer: fix tokenizer.json or pass tokenizer=")


def _holder(source: Path, parts: list[np.ndarray], name: str, vocab_size: int, eot: int,
            files: Sequence[Path]) -> HolderTokens:
    # Copying out of the memory maps closes them and gives one contiguous array.
    tokens = np.concatenate(parts, dtype=np.uint16) if parts else np.empty(0, dtype=np.uint16)
    if tokens.size == 0:
        raise BadInput(f"{source} holds no tokens; point at non-empty shards or text")
    tokens.flags.writeable = False  # shared by loaders: nobody may change the training data
    return HolderTokens(tokens=tokens, tokenizer=name, files=tuple(str(f) for f in files),
                        vocab_size=vocab_size, eot=eot)
