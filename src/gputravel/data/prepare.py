"""Tokenize a holder's text files into llm.c shards plus a `tokenizer.json` record.

As llm.c's data scripts do, each file is one document *preceded* by the end-of-text token, and
a document may continue in the next shard. The output is built in a temporary sibling directory
and renamed into place, so an interrupted run never leaves a mix of old and new shards.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gputravel.errors import BadInput
from gputravel.files import MISSING, not_data
from gputravel.data.shards import MAX_TOKENS, SHARD_GLOB, write_shard
from gputravel.data.tokenizer import RECORD_NAME, Tokenizer, get_tokenizer, write_tokenizer_record

PROGRESS_MIN_FILES = 10  # below this a progress bar only flickers
#: The most shards one prepare may write: each is a file with a 1 KiB header, so a tiny
#: --shard-tokens would write a file (a few KiB on disk) for a handful of tokens.
MAX_SHARDS = 1024


@dataclass(frozen=True)
class PrepareResult:
    out: Path
    shards: tuple[Path, ...]
    files: int  # documents tokenized
    tokens: int  # including one EOT per document
    tokenizer: str
    skipped: tuple[Path, ...] = ()  # empty files, which add nothing


def text_files(inputs: Sequence[Path | str]) -> list[Path]:
    """The text files `inputs` name: a file as given, a directory's `*.txt` (recursively, sorted,
    hidden ones skipped)."""
    files: list[Path] = []
    for item in map(Path, inputs):
        why = not_data(item)  # a FIFO, socket or device is refused, not read
        if why is not None:
            raise BadInput(f"input {item} {why + '; check the path' if why == MISSING else why}")
        if item.is_dir():
            found = sorted((p for p in item.rglob("*.txt")
                            if p.is_file() and not any(s.startswith(".") for s in p.relative_to(item).parts)),
                           key=lambda p: p.relative_to(item).as_posix())
            if not found:
                raise BadInput(f"no .txt files in {item}; put the holder's text there as .txt files")
            files.extend(found)
        else:
            files.append(item)
    _reject_duplicates(files)
    return files


def _reject_duplicates(files: list[Path]) -> None:
    # The same text twice would silently double its weight in training.
    seen: dict[Path, Path] = {}
    for f in files:
        key = f.resolve()
        if key in seen:
            raise BadInput(f"{f} is given twice (also as {seen[key]}); list each input once")
        seen[key] = f


def encode_file(path: Path, tok: Tokenizer) -> np.ndarray | None:
    """EOT followed by the file's tokens, or None for an empty file (it adds nothing)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path} is not UTF-8 text (at byte offset {exc.start}); "
                       "convert it to UTF-8 or leave it out") from None
    if not text:
        return None
    return np.concatenate([np.array([tok.eot], dtype=np.uint16), tok.encode(text)])


def encode_files(files: Sequence[Path], tok: Tokenizer) -> Iterator[tuple[Path, np.ndarray]]:
    """(file, tokens) per non-empty file, in order."""
    for f in files:
        tokens = encode_file(f, tok)
        if tokens is not None:
            yield f, tokens


class _ShardWriter:
    """Cuts a token stream into shards of exactly `size` tokens (the last one shorter)."""

    def __init__(self, directory: Path, prefix: str, size: int) -> None:
        self.directory, self.prefix, self.size = directory, prefix, size
        self.pending: list[np.ndarray] = []
        self.count = 0
        self.names: list[str] = []
        self.total = 0

    def add(self, tokens: np.ndarray) -> None:
        while tokens.size:
            take = tokens[: self.size - self.count]
            self.pending.append(take)
            self.count += take.size
            self.total += take.size
            tokens = tokens[take.size:]
            if self.count == self.size:
                self.flush()

    def flush(self) -> None:
        if self.count:
            name = f"{self.prefix}_{len(self.names):06d}.bin"
            write_shard(self.directory / name, np.concatenate(self.pending))
            self.names.append(name)
            self.pending, self.count = [], 0


def shard_prefix(out: Path) -> str:
    """File name prefix of the shards: the output directory's name, made file-name safe."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", out.resolve().name).strip("_") or "shard"


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise BadInput(f"output {out} exists and is a file; pass a directory for the shards")
    if not out.is_dir():
        return
    existing = sorted(p.name for p in out.iterdir())
    if existing and not overwrite:
        raise BadInput(f"output directory {out} is not empty ({_few(existing)}); "
                       "choose a new directory, or overwrite earlier shards with --overwrite")
    foreign = [n for n in existing if not (Path(n).match(SHARD_GLOB) or n == RECORD_NAME)]
    if foreign:
        # Overwriting replaces the whole directory: never take someone's other files with it.
        raise BadInput(f"output directory {out} holds files prepare did not write ({_few(foreign)}); "
                       "choose a directory that holds only shards")


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` directory to `out`, replacing earlier shards there."""
    if out.is_dir() and any(out.iterdir()):
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
        os.replace(out, old / out.name)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)  # rename(2) replaces an empty directory


def prepare(inputs: Sequence[Path | str], out: Path | str, tokenizer: Tokenizer | str, shard_tokens: int = 10**8,
            *, progress: bool = False, overwrite: bool = False) -> PrepareResult:
    """Tokenize `inputs` (text files, or directories of .txt files) into shards in `out`;
    `overwrite` replaces a directory of earlier shards as a whole."""
    out = Path(out)
    tokenizer = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    if type(shard_tokens) is not int or not 0 < shard_tokens <= MAX_TOKENS:
        raise BadInput(f"--shard-tokens must be an integer in 1..{MAX_TOKENS}, got {shard_tokens!r}")
    if not inputs:
        raise BadInput("no inputs given; pass at least one text file or directory of .txt files")
    files = text_files(inputs)
    # At most MAX_SHARDS, whatever the text: a token is at least a byte, and every file adds its EOT.
    most = sum(f.stat().st_size for f in files) + len(files)
    if -(-most // shard_tokens) > MAX_SHARDS:
        raise BadInput(f"--shard-tokens {shard_tokens:,} would cut the input's up to {most:,} tokens into more than "
                       f"{MAX_SHARDS:,} shards: use --shard-tokens {-(-most // MAX_SHARDS):,} or more")
    _check_out(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    # os.mkdir, not mkdtemp: the published directory should get the umask's permissions, not 0700.
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        writer = _ShardWriter(tmp, shard_prefix(out), shard_tokens)
        used = _tokenize(files, tokenizer, writer, progress and len(files) >= PROGRESS_MIN_FILES)
        if not used:
            raise BadInput(f"no text found in {', '.join(map(str, inputs))}: every file is empty")
        writer.flush()
        write_tokenizer_record(tmp, tokenizer)
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful publish
    had_text = set(used)
    skipped = tuple(f for f in files if f not in had_text)
    return PrepareResult(out=out, shards=tuple(out / n for n in writer.names), files=len(used),
                         tokens=writer.total, tokenizer=tokenizer.name, skipped=skipped)


def _tokenize(files: list[Path], tok: Tokenizer, writer: _ShardWriter, show: bool) -> list[Path]:
    """Feed every file's tokens to `writer`; return the files that had text."""
    from rich.progress import track  # the CLI's, already loaded there

    used: list[Path] = []
    for f in track(files, f"tokenizing ({tok.name})", transient=True, disable=not show):
        tokens = encode_file(f, tok)
        if tokens is not None:
            writer.add(tokens)
            used.append(f)
    return used
