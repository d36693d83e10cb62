"""Tokenizers for holders' text, and the `tokenizer.json` record kept next to shards (which carry
only ids). GPT-2 BPE through tiktoken counts as available only when its BPE file loads offline;
the byte tokenizer always works.
"""

from __future__ import annotations

import functools
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gputravel.errors import BadInput
from gputravel.files import atomic_write_bytes

RECORD_NAME = "tokenizer.json"
MAX_VOCAB = 65536  # shards store uint16 ids


class Tokenizer(ABC):
    """Text to token ids and back. `eot` is the end-of-text id that delimits documents."""

    name: str
    vocab_size: int
    eot: int

    @abstractmethod
    def encode(self, text: str) -> np.ndarray:
        """uint16 ids of `text`, taken literally, never as special tokens."""

    @abstractmethod
    def decode(self, tokens: Sequence[int] | np.ndarray) -> str:
        """Text of `tokens`, end-of-text tokens dropped."""

    def _ids(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """`tokens` as int64 without the eot, once checked to be in the vocabulary."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise BadInput(f"token {bad} is outside the {self.name} vocabulary (0..{self.vocab_size - 1}); "
                           "decode with the tokenizer that produced the tokens")
        return ids[ids != self.eot]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, plus 256 as end-of-text: tiny, exact, needs no files."""

    name = "bytes"
    vocab_size = 257
    eot = 256

    def encode(self, text: str) -> np.ndarray:
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadInput(f"text is not encodable as UTF-8 ({exc.reason} at character {exc.start}); "
                           "remove lone surrogates from it") from None
        return np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)

    def decode(self, tokens: Sequence[int] | np.ndarray) -> str:
        # A window cut out of a stream can split a character: replace it rather than fail.
        return self._ids(tokens).astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class Gpt2Tokenizer(Tokenizer):
    """GPT-2 BPE (tiktoken's "gpt2" encoding), the tokenizer llm.c's GPT-2 shards use."""

    name = "gpt2"
    vocab_size = 50257
    eot = 50256

    def __init__(self, encoding: Any | None = None) -> None:
        if encoding is None:
            encoding, why = _gpt2_encoding()
            if encoding is None:
                raise BadInput(f"the gpt2 tokenizer is not available: {why}; use the bytes tokenizer instead")
        self._encoding = encoding

    def encode(self, text: str) -> np.ndarray:
        # encode_ordinary: a literal "<|endoftext|>" in a document is text, not a delimiter.
        return np.asarray(self._encoding.encode_ordinary(text), dtype=np.uint16)

    def decode(self, tokens: Sequence[int] | np.ndarray) -> str:
        return self._encoding.decode(self._ids(tokens).tolist(), errors="replace")


@functools.lru_cache(maxsize=1)
def _gpt2_encoding() -> tuple[Any | None, str]:
    """tiktoken's gpt2 encoding, or (None, why not). Cached: loading parses a 1 MB BPE file."""
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed (pip install 'gputravel[bpe]')"
    try:
        enc = tiktoken.get_encoding("gpt2")
    except Exception as exc:  # noqa: BLE001 -- no network, no cache, a proxy page: all mean "not offline"
        return None, (f"tiktoken could not load its gpt2 BPE file ({type(exc).__name__}: {exc}); "
                      "fetch it once with network access or set TIKTOKEN_CACHE_DIR to a cache that has it")
    if enc.n_vocab != Gpt2Tokenizer.vocab_size or enc.eot_token != Gpt2Tokenizer.eot:
        return None, f"tiktoken's gpt2 encoding has {enc.n_vocab} ids and eot {enc.eot_token}, not GPT-2's"
    return enc, ""


def default_tokenizer() -> Tokenizer:
    """GPT-2 when tiktoken and its BPE file are available offline, else bytes."""
    return Gpt2Tokenizer() if _gpt2_encoding()[0] is not None else ByteTokenizer()


def get_tokenizer(name: str) -> Tokenizer:
    """The tokenizer called `name`: "bytes", "gpt2", or "auto" for `default_tokenizer()`."""
    if name == "auto":
        return default_tokenizer()
    if name == ByteTokenizer.name:
        return ByteTokenizer()
    if name == Gpt2Tokenizer.name:
        return Gpt2Tokenizer()
    raise BadInput(f"unknown tokenizer {name!r}; choose one of auto, bytes, gpt2")


@dataclass(frozen=True)
class TokenizerRecord:
    name: str
    vocab_size: int
    eot: int

    @classmethod
    def of(cls, tok: Tokenizer) -> TokenizerRecord:
        return cls(name=tok.name, vocab_size=tok.vocab_size, eot=tok.eot)


# The known tokenizers' records, usable without loading them (reading gpt2 shards needs no tiktoken).
KNOWN = {t.name: TokenizerRecord(t.name, t.vocab_size, t.eot) for t in (ByteTokenizer, Gpt2Tokenizer)}
LLMC_DEFAULT = "gpt2"  # llm.c's scripts write GPT-2 tokens and no record


def write_tokenizer_record(directory: Path | str, tok: Tokenizer | TokenizerRecord) -> Path:
    """`directory`/tokenizer.json for `tok`, written atomically."""
    record = tok if isinstance(tok, TokenizerRecord) else TokenizerRecord.of(tok)
    path = Path(directory) / RECORD_NAME
    atomic_write_bytes(path, (json.dumps(asdict(record), indent=2) + "\n").encode())
    return path


def read_tokenizer_record(directory: Path | str) -> TokenizerRecord:
    path = Path(directory) / RECORD_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"no {RECORD_NAME} in {directory}: the shards' tokenizer is unknown; "
                       "re-run `gputravel data prepare` or name the tokenizer explicitly") from None
    except UnicodeDecodeError as exc:  # where, never the byte: the file is a holder's
        raise BadInput(f"{path} is not UTF-8 (at byte offset {exc.start}); re-run `gputravel data prepare` to "
                       "rewrite it") from None
    except (json.JSONDecodeError, RecursionError) as exc:  # a position, no text; RecursionError: nested too deeply
        raise BadInput(f"{path} is not valid JSON ({exc}); re-run `gputravel data prepare` to rewrite it") from None
    return _record_from(path, data)


def _record_from(path: Path, data: Any) -> TokenizerRecord:
    if not isinstance(data, dict):
        raise BadInput(f"{path} must hold a JSON object with name, vocab_size and eot; fix or rewrite it")
    missing = [k for k in ("name", "vocab_size", "eot") if k not in data]
    if missing:
        raise BadInput(f"{path} lacks {', '.join(missing)}; it needs name, vocab_size and eot")
    name, vocab, eot = data["name"], data["vocab_size"], data["eot"]
    # bool is an int subclass in Python; `true` is no vocabulary size.
    if not isinstance(name, str) or not name or any(isinstance(v, bool) or not isinstance(v, int) for v in (vocab, eot)):
        raise BadInput(f"{path}: name must be a non-empty string and vocab_size, eot integers; fix it")
    if not 0 < vocab <= MAX_VOCAB or not 0 <= eot < vocab:
        raise BadInput(f"{path}: vocab_size {vocab} and eot {eot} do not fit uint16 shards "
                       f"(need 0 <= eot < vocab_size <= {MAX_VOCAB}); fix it")
    record = TokenizerRecord(name=name, vocab_size=vocab, eot=eot)
    if name in KNOWN and record != KNOWN[name]:
        known = KNOWN[name]
        raise BadInput(f"{path}: {name} has vocab_size {known.vocab_size} and eot {known.eot}, "
                       f"but the record says {vocab} and {eot}; fix it")
    return record


def resolve_record(directory: Path, tokenizer: str | Tokenizer | None) -> TokenizerRecord:
    """The shards' tokenizer: their record (which `tokenizer` may not contradict), else `tokenizer`,
    else llm.c's gpt2."""
    asked = tokenizer if isinstance(tokenizer, str) or tokenizer is None else tokenizer.name
    if (directory / RECORD_NAME).exists():
        record = read_tokenizer_record(directory)
        if asked is not None and asked != "auto" and asked != record.name:
            raise BadInput(f"{directory / RECORD_NAME} says the shards are {record.name} tokens, but tokenizer "
                           f"{asked!r} was asked for; drop the tokenizer argument or fix the record")
        return record
    if tokenizer is not None and not isinstance(tokenizer, str):
        return TokenizerRecord.of(tokenizer)
    name = LLMC_DEFAULT if asked in (None, "auto") else asked
    if name not in KNOWN:
        raise BadInput(f"unknown tokenizer {name!r} for the shards in {directory}; choose one of bytes, gpt2")
    return KNOWN[name]
