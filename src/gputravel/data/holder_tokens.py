"""One data holder's training tokens, from a directory of llm.c shards, one shard, a text file or
a directory of text files. Shards concatenate in file-name order: the loaders rely on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gputravel.data.prepare import encode_files, text_files
from gputravel.data.shards import SHARD_GLOB, list_shards, read_shard
from gputravel.data.tokenizer import Tokenizer, default_tokenizer, get_tokenizer, resolve_record
from gputravel.errors import BadInput
from gputravel.files import not_data


@dataclass(frozen=True, eq=False)  # eq=False: comparing arrays element-wise has no single truth value
class HolderTokens:
    """One holder's training tokens (read-only uint16), with its tokenizer's name, size and eot."""

    tokens: np.ndarray
    tokenizer: str
    files: tuple[str, ...]  # in concatenation order
    vocab_size: int
    eot: int

    def __len__(self) -> int:
        return int(self.tokens.size)


def load_tokens(path: Path | str, tokenizer: str | Tokenizer | None = None) -> HolderTokens:
    """A holder's tokens from shards (their tokenizer.json, else `tokenizer`, else llm.c's gpt2) or
    text tokenized as `prepare` does (with `tokenizer`, else `default_tokenizer()`)."""
    path = Path(path)
    why = not_data(path)  # a FIFO, socket or device is refused, not read
    if why is not None:
        raise BadInput(f"{path} {why}; pass a shard directory, a .bin shard or text files")
    if path.is_dir() and any(path.glob(SHARD_GLOB)):
        return _load_shards(path, list_shards(path), tokenizer)
    if path.is_file() and path.suffix == ".bin":
        return _load_shards(path.parent, [path], tokenizer)
    return _load_text(path, tokenizer)


def _load_shards(directory: Path, shards: list[Path], tokenizer: str | Tokenizer | None) -> HolderTokens:
    record = resolve_record(directory, tokenizer)
    parts = []
    for shard in shards:
        tokens = read_shard(shard)
        _check_vocab(shard, tokens, record.name, record.vocab_size)
        parts.append(tokens)
    return _holder(directory, parts, record.name, record.vocab_size, record.eot, shards)


def _load_text(path: Path, tokenizer: str | Tokenizer | None) -> HolderTokens:
    tok = (default_tokenizer() if tokenizer is None
           else get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer)
    encoded = list(encode_files(text_files([path]), tok))  # empty files add no document
    return _holder(path, [t for _, t in encoded], tok.name, tok.vocab_size, tok.eot, [f for f, _ in encoded])


def _check_vocab(shard: Path, tokens: np.ndarray, name: str, vocab_size: int) -> None:
    if tokens.size and int(tokens.max()) >= vocab_size:
        raise BadInput(f"{shard}: a token is outside the {name} vocabulary ({vocab_size} ids); "
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
