"""What every command does the same way: its errors, its output paths checked before it runs,
right-aligned tables of figures, and where its JSON went."""

from __future__ import annotations

import inspect
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NoReturn

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from gputravel.errors import BadInput, GputravelError, one_line
from gputravel.files import write_json

console = Console()


def fail(exc: Exception | str) -> NoReturn:
    # escape: paths and lists are no markup; soft_wrap: a long path is never cut by a newline
    console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
    raise typer.Exit(1)


class Commands(TyperGroup):
    """Every command group: a typed error, an OSError on a path and a RecursionError (input nested too
    deeply) end as one line, exit 1; any other exception is a bug and keeps its traceback."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _reflow_help(self)  # the group's whole tree: typer builds the subcommands first

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (GputravelError, OSError, RecursionError) as exc:
            if (line := one_line(exc)) is None:
                raise
            fail(line)


def reflow(text: str) -> str:
    """A docstring's paragraphs each on one line. typer's rich help keeps the source's line breaks
    after the first paragraph, which wrapped at the terminal's width leave ragged lines."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


def _reflow_help(cmd: click.Command) -> None:
    if cmd.help:
        cmd.help = reflow(cmd.help)
    for sub in getattr(cmd, "commands", {}).values():
        _reflow_help(sub)


def named_subcommand() -> None:
    """A sub-app's callback: it keeps the app's only command a named subcommand."""


def hex_bytes(text: str, size: int, error: str) -> bytes:
    """`text` as `size` bytes written in hex, else BadInput(`error`)."""
    try:
        value = bytes.fromhex(text)
    except ValueError:
        value = b""
    if len(value) != size:
        raise BadInput(error)
    return value


def check_output_dir(path: Path, flag: str) -> None:
    """BadInput naming `flag` unless `path` is a directory or can be made one: said before anything starts."""
    _check_parents(path, flag)
    if path.exists() and not path.is_dir():
        raise BadInput(f"{flag} {path} exists and is not a directory")


def make_output_dir(path: Path, flag: str) -> None:
    """Make `path` and write a file in it, else BadInput naming `flag` (/proc/self, a read-only mount)."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".gputravel-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise BadInput(f"{flag} {path}: cannot write there ({exc.strerror or exc})") from None


def check_output_file(path: Path | None, flag: str) -> None:
    """BadInput naming `flag` if the file `path` (None: not asked for) could not be written there."""
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
    table = Table(title=title, **options)
    for col in columns:
        table.add_column(col, justify="right")
    return table


def write_results(path: Path | None, result: dict, what: str = "results") -> None:
    """Write a command's results (`what` they are) as JSON, when it was asked to, and say where."""
    if path is not None:
        write_json(path, result)
        console.print(f"{what} written to {path}")


def name_values(items: Sequence[str], flag: str) -> dict[str, str]:
    """A repeatable NAME=VALUE option's values by name; BadInput if one is not that, or names one twice."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value or name in out:
            raise BadInput(f"{flag} takes NAME=VALUE, each name once, got {item!r}")
        out[name] = value
    return out
