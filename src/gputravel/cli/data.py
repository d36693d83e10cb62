"""`gputravel data ...`: turn a holder's text into llm.c token shards."""

from __future__ import annotations

import enum
from pathlib import Path

import typer
from rich.markup import escape

from gputravel.cli.output import Commands, console, named_subcommand
from gputravel.cohort.stopping import catch_term
from gputravel.data.prepare import prepare as run_prepare
from gputravel.data.tokenizer import get_tokenizer

data_app = typer.Typer(no_args_is_help=True, cls=Commands, callback=named_subcommand,
                       help="Training data: tokenize holders' text into llm.c shards.")


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
