"""Tokenize a holder's text files into llm.c shards plus a `tokenizer.json` record.

Each text file is one document. As in llm.c's data scripts, every document is *preceded*
by the end-of-text token, so the token stream starts with EOT and EOT separates documents;
`load_tokens` on text uses the same convention, so text and its shards give equal tokens.
Shards are filled to `shard_tokens` and a document may continue in the next shard, as llm.c
does; they are named `<prefix>_000000.bin`, ... after the output directory.

The output is built in a temporary sibling directory and renamed into place at the end, so
an interrupted run never leaves a mix of old and new shards behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
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
    """What `prepare` wrote: shards in training order, and the counts behind them."""

    out: Path
    shards: tuple[Path, ...]
    files: int  # documents tokenized
    tokens: int  # including one EOT per document
    tokenizer: str
    skipped: tuple[Path, ...] = ()  # empty files, which add nothing


# ----------------------------------------------------------------------------- text input
def text_files(inputs: Sequence[Path | str]) -> list[Path]:
    """The text files named by `inputs`, in order: a file as given, a directory as its
    `*.txt` files (recursively, sorted by relative path, hidden ones skipped)."""
    files: list[Path] = []
    for item in map(Path, inputs):
        why = not_data(item)  # a FIFO, socket or device is refused, not read
        if why is not None:
            raise BadInput(f"input {item} {why + '; check the path' if why == MISSING else why}")
        if item.is_dir():
            found = sorted((p for p in item.rglob("*.txt") if p.is_file() and not _hidden(p, item)),
                           key=lambda p: p.relative_to(item).as_posix())
            if not found:
                raise BadInput(f"no .txt files in {item}; put the holder's text there as .txt files")
            files.extend(found)
        else:
            files.append(item)
    _reject_duplicates(files)
    return files


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _reject_duplicates(files: list[Path]) -> None:
    # The same text twice would silently double its weight in training.
    seen: dict[Path, Path] = {}
    for f in files:
        key = f.resolve()
        if key in seen:
            raise BadInput(f"{f} is given twice (also as {seen[key]}); list each input once")
        seen[key] = f


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                       "convert it to UTF-8 or leave it out") from None


def encode_file(path: Path, tok: Tokenizer) -> np.ndarray | None:
    """EOT followed by the file's tokens, or None for an empty file (it adds nothing)."""
    text = read_text(path)
    if not text:
        return None
    return np.concatenate([np.array([tok.eot], dtype=np.uint16), tok.encode(text)])


def encode_files(files: Sequence[Path], tok: Tokenizer) -> Iterator[tuple[Path, np.ndarray]]:
    """(file, tokens) per non-empty file, in order."""
    for f in files:
        tokens = encode_file(f, tok)
        if tokens is not None:
            yield f, tokens


# ----------------------------------------------------------------------------- shard output
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


def _check_shard_tokens(shard_tokens: int) -> None:
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or not 0 < shard_tokens <= MAX_TOKENS:
        raise BadInput(f"--shard-tokens must be an integer in 1..{MAX_TOKENS}, got {shard_tokens!r}")


def _check_shard_count(files: list[Path], shard_tokens: int) -> None:
    """At most MAX_SHARDS shards, whatever the text: a token is at least a byte (the byte
    tokenizer's one a byte, GPT-2's byte pairs more), and every file adds its EOT."""
    most = sum(f.stat().st_size for f in files) + len(files)
    if -(-most // shard_tokens) > MAX_SHARDS:
        raise BadInput(f"--shard-tokens {shard_tokens:,} would cut the input's up to {most:,} tokens into more than "
                       f"{MAX_SHARDS:,} shards: use --shard-tokens {-(-most // MAX_SHARDS):,} or more")


# ----------------------------------------------------------------------------- prepare
def prepare(inputs: Sequence[Path | str], out: Path | str, tokenizer: Tokenizer | str, shard_tokens: int = 10**8,
            *, progress: bool = False, overwrite: bool = False) -> PrepareResult:
    """Tokenize `inputs` (text files, or directories of .txt files) into shards in `out`.

    `overwrite` lets `out` be a directory of earlier shards, replaced as a whole; `progress`
    shows a bar when there are many files.
    """
    out = Path(out)
    tokenizer = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    _check_shard_tokens(shard_tokens)
    if not inputs:
        raise BadInput("no inputs given; pass at least one text file or directory of .txt files")
    files = text_files(inputs)
    _check_shard_count(files, shard_tokens)
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
    used: list[Path] = []
    with _progress(show, len(files), f"tokenizing ({tok.name})") as advance:
        for f in files:
            tokens = encode_file(f, tok)
            if tokens is not None:
                writer.add(tokens)
                used.append(f)
            advance()
    return used


@contextlib.contextmanager
def _progress(show: bool, total: int, what: str) -> Iterator[Callable[[], None]]:
    """A transient rich progress bar, or a no-op when `show` is false."""
    if not show:
        yield lambda: None
        return
    from rich.progress import Progress  # only imported when a bar is actually shown

    with Progress(transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda: bar.advance(task)
