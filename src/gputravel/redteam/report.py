"""Printing a red-team report: a table for people, JSON for machines."""

from __future__ import annotations


from rich.console import Console
from rich.table import Table

from gputravel.redteam.run import RedTeamReport


def table(report: RedTeamReport) -> Table:
    t = Table(title="gputravel red team: every attack against a live cohort", show_lines=True)
    for col, kw in (("attack", {"no_wrap": True}), ("adversary", {"no_wrap": True}), ("tried", {"ratio": 3}),
                    ("stopped by", {"ratio": 3}), ("plaintext bytes", {"justify": "right"}), ("outcome", {})):
        t.add_column(col, **kw)
    for r in report.attacks:
        style = {"defeated": "green", "skipped": "yellow"}.get(r.outcome, "bold red")
        t.add_row(r.name, r.adversary, r.tried, r.stopped_by, str(r.plaintext_bytes_obtained),
                  f"[{style}]{r.outcome}[/{style}]")
    return t


def print_report(report: RedTeamReport, console: Console, *, evidence: bool = False) -> None:
    """A table on a wide terminal; one block per attack on a narrow one (the texts are long)."""
    if console.width >= 150:
        console.print(table(report))
    for r in report.attacks:
        if console.width < 150:
            style = {"defeated": "green", "skipped": "yellow"}.get(r.outcome, "bold red")
            console.print(f"[bold]{r.name}[/bold] ({r.adversary}): {r.plaintext_bytes_obtained} bytes of plaintext "
                          f"obtained, [{style}]{r.outcome}[/{style}]", highlight=False)
            console.print(f"  tried:      {r.tried}", highlight=False)
            console.print(f"  stopped by: {r.stopped_by}", highlight=False)
        elif evidence:
            console.print(f"[bold]{r.name}[/bold]")
        if evidence:
            for line in r.evidence:
                console.print(f"  - {line}", highlight=False)
    n, bad = len(report.attacks), len(report.failed)
    verdict = "[green]every attack defeated, 0 bytes of plaintext obtained[/green]" if not bad else \
        f"[bold red]{bad} of {n} attacks NOT defeated: {', '.join(r.name for r in report.failed)}[/bold red]"
    if report.skipped:
        verdict += (f" [yellow]({len(report.skipped)} not run, process isolation off: "
                    f"{', '.join(r.name for r in report.skipped)})[/yellow]")
    console.print(verdict)

