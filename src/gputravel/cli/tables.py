"""`gputravel bench tables`: write docs/benchmarks.md's tables from the JSON behind them, or
check (`--check`) that none has drifted from its data (bench/tables.py)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from gputravel.bench import tables
from gputravel.errors import GputravelError

console = Console()


def bench_tables(
    doc: Path = typer.Option(Path("docs/benchmarks.md"), help="The document whose table markers to fill."),
    check: bool = typer.Option(False, "--check", help="Change nothing; exit 1 if a table differs from its data, "
                                                      "a figure is missing or a table has no data behind it."),
) -> None:
    """Write the benchmark tables from their JSON files (docs/results/), between the markers
    `<!-- table: SOURCE KIND OPTIONS -->` and `<!-- /table -->`."""
    try:
        if check:
            problems = tables.check(doc)
            for p in problems:
                console.print(f"[red]{escape(str(doc))}:[/red] {escape(p)}")
            if problems:
                raise typer.Exit(1)
            console.print(f"{doc}: {len(tables.blocks(doc.read_text()))} tables agree with their data")
            return
        changed, problems = tables.write(doc)
    except GputravelError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from None
    for m in changed:
        console.print(f"  line {m.line}: {m.kind} table rewritten from {escape(m.source)}")
    for p in problems:
        console.print(f"[yellow]{escape(str(doc))}:[/yellow] {escape(p)}")
    console.print(f"{doc}: {len(changed)} table(s) rewritten")
    if problems:
        raise typer.Exit(1)
