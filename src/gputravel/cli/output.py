"""What every command prints the same way: errors, right-aligned tables of figures, and
where its JSON went."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gputravel.files import write_json

console = Console()


def fail(exc: Exception) -> NoReturn:
    console.print(f"[red]error:[/red] {escape(str(exc))}")  # escape: paths and lists are no markup
    raise typer.Exit(1)


def numeric_table(title: str, columns: Iterable[str], **options) -> Table:
    """A table whose columns are figures (right-aligned)."""
    table = Table(title=title, **options)
    for col in columns:
        table.add_column(col, justify="right")
    return table


def write_results(path: Path | None, result: dict) -> None:
    """Write a command's results as JSON, when it was asked to, and say where."""
    if path is not None:
        write_json(path, result)
        console.print(f"results written to {path}")
