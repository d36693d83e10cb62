"""What every command prints the same way: errors, right-aligned tables of figures, and
where its JSON went."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gputravel.errors import BadInput
from gputravel.files import write_json

console = Console()


def fail(exc: Exception) -> NoReturn:
    # escape: paths and lists are no markup; soft_wrap: a long path is never cut by a newline
    # (the terminal wraps it; a script or a test reads it whole)
    console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
    raise typer.Exit(1)


def check_output_dir(path: Path, flag: str) -> None:
    """BadInput naming `flag` unless `path` is a directory or can be made one (nothing there, and
    the nearest existing parent a directory): said before anything starts, not after."""
    _check_parents(path, flag)
    if path.exists() and not path.is_dir():
        raise BadInput(f"{flag} {path} exists and is not a directory")


def make_output_dir(path: Path, flag: str) -> None:
    """Create the directory `path` (and its parents) if need be, and write and delete a file in
    it: BadInput naming `flag` if that fails (/proc/self, a read-only mount), said before a run
    whose results go there starts, not when it ends."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".gputravel-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise BadInput(f"{flag} {path}: cannot write there ({exc.strerror or exc})") from None


def check_output_file(path: Path | None, flag: str) -> None:
    """BadInput naming `flag` if the file `path` (None: not asked for) could not be written
    there: it is a directory, or a parent of it is not one."""
    if path is None:
        return
    _check_parents(path, flag)
    if path.is_dir():
        raise BadInput(f"{flag} {path} is a directory; give a file name")


def _check_parents(path: Path, flag: str) -> None:
    for parent in Path(path).absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise BadInput(f"{flag} {path}: {parent} is not a directory")
            return


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
