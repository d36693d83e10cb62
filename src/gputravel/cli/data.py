"""`gputravel data ...`: turn a holder's text into llm.c token shards, or its images and tables into a
record dataset (`data pack`), and show what a record dataset holds."""

from __future__ import annotations

import enum
from collections.abc import Callable
from pathlib import Path

import typer
from rich.markup import escape

from gputravel.cli.output import Commands, console, named_subcommand
from gputravel.cohort.stopping import catch_term
from gputravel.data.pack import class_counts, pack_images, pack_table
from gputravel.data.prepare import prepare as run_prepare
from gputravel.data.records import Records, load_records
from gputravel.data.tokenizer import get_tokenizer
from gputravel.errors import BadInput

data_app = typer.Typer(pretty_exceptions_show_locals=False, no_args_is_help=True, cls=Commands, callback=named_subcommand,
                       help="Training data: tokenize holders' text into llm.c shards; pack images and tables.")
pack_app = typer.Typer(pretty_exceptions_show_locals=False, no_args_is_help=True, cls=Commands,
                       help="Pack a holder's images, table or text where the data lives, for training.")
data_app.add_typer(pack_app, name="pack")


TokenizerChoice = enum.Enum("TokenizerChoice", {t: t for t in ("auto", "bytes", "gpt2")}, type=str)  # --tokenizer's


@data_app.command()
def prepare(
    inputs: list[Path] = typer.Option(..., "--input", "-i",
                                      help="A text file or a directory of .txt files; repeat for more."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the shards and tokenizer.json."),
    tokenizer: TokenizerChoice = typer.Option(TokenizerChoice.auto, help="auto = gpt2 when available offline, "
                                              "else bytes."),
    shard_tokens: int = typer.Option(10**8, min=1, help="Tokens per shard (llm.c uses 10^8); at most 1024 shards."),
    overwrite: bool = typer.Option(False, help="Replace the shards already in --out."),
) -> None:
    """Tokenize text into llm.c shards (each document preceded by end-of-text, as llm.c does)."""
    undo_term = catch_term("nothing was written")  # SIGTERM unwinds, deleting the unfinished shards
    try:
        tok = get_tokenizer(tokenizer.value)
        result = run_prepare(inputs, out, tok, shard_tokens, progress=True, overwrite=overwrite)
    finally:
        undo_term()
    shards = f"{len(result.shards)} shard{'s' if len(result.shards) != 1 else ''}"
    console.print(escape(f"prepared {result.files} files: {result.tokens:,} tokens in {shards} in {result.out} "
                         f"(tokenizer {result.tokenizer}, vocab {tok.vocab_size})"))
    if result.skipped:
        console.print(f"[yellow]skipped {len(result.skipped)} empty files[/yellow]")


# `data pack text` is `data prepare`: one way to turn text into tokens.
pack_app.command("text")(prepare)


@pack_app.command()
def images(
    folder: Path = typer.Argument(..., help="A folder with one sub-folder of PNG or JPEG images per class."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the record dataset (replaced whole)."),
    shape: str = typer.Option(..., help="C,H,W of every image: C 1 (grayscale) or 3 (RGB); images are resized."),
    classes: str | None = typer.Option(None, help="The classes in label order, comma-separated (default: the "
                                       "sorted folder names); every holder of a job must give the same."),
) -> None:
    """Pack images into records `image: uint8[C,H,W]; label: int64[]`."""
    dims = _numbers(shape, "--shape")
    _packed(lambda: pack_images(folder, out, shape=dims, classes=_names(classes)), out)


@pack_app.command()
def table(
    path: Path = typer.Argument(..., metavar="CSV", help="A CSV file with a header row (or .parquet, with pyarrow)."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the record dataset (replaced whole)."),
    label: str = typer.Option(..., help="The label column."),
    features: str | None = typer.Option(None, help="Feature columns, comma-separated (default: all but the label)."),
    classes: str | None = typer.Option(None, help="The classes in label order, comma-separated (default: the "
                                       "sorted distinct labels); a label outside them is refused."),
) -> None:
    """Pack a table into records: `features`, float32 values of the feature columns, and `label`, int64."""
    _packed(lambda: pack_table(path, out, label=label, features=_names(features), classes=_names(classes)), out)


@data_app.command()
def show(dataset: Path = typer.Argument(..., metavar="DIR", help="A record dataset directory.")) -> None:
    """Print a record dataset's schema, its digest, its record count and its records per class."""
    _describe(load_records(dataset))


def _packed(pack: Callable[[], Records], out: Path) -> None:
    undo_term = catch_term("nothing was written")  # SIGTERM unwinds; write_records leaves no half output
    try:
        records = pack()
    finally:
        undo_term()
    console.print(escape(f"packed {len(records):,} records into {out}"))
    _describe(records)


def _describe(records: Records) -> None:
    console.print(escape(f"schema  {records.schema.text()}"), soft_wrap=True)
    console.print(f"digest  {records.schema.digest()}")
    console.print(f"records {len(records):,}")
    for field, counts in class_counts(records).items():
        console.print(escape(f"{field}: " + ", ".join(f"{name} {n:,}" for name, n in counts.items())), soft_wrap=True)


def _names(text: str | None) -> list[str] | None:
    return None if text is None else text.split(",")


def _numbers(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise BadInput(f"{flag} is sizes separated by commas, e.g. 1,28,28; got {text!r}") from None
