"""`gputravel audit verify`: check the orchestrator's signed travel log (orchestrator/audit);
its exit statuses are in the command's help."""

from __future__ import annotations

import datetime
import os
import stat
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from gputravel.cli.output import Commands, console, hex_bytes, named_subcommand
from gputravel.orchestrator.audit import AuditError, AuditSummary, Entry, entry_hash, verify_log
from gputravel.orchestrator.audit.entries import HASH_BYTES
from gputravel.errors import BadInput, GputravelError
from gputravel.files import write_json

audit_app = typer.Typer(pretty_exceptions_show_locals=False, add_completion=False, no_args_is_help=True, cls=Commands, callback=named_subcommand,
                        help="The orchestrator's hash-chained, signed log of travels.")
NOT_CLOSED = 3  # the exit status of a log that verifies but is not closed
CONTINUES = 4  # the exit status of a closed log that continues an earlier one: not its job's whole log
# The largest log read (in memory: about a million travels) and key (a PEM is a few KiB).
MAX_LOG_BYTES, MAX_KEY_BYTES = 256 << 20, 64 << 10


def _table(summary: AuditSummary) -> Table:
    who = summary.holder or "every holder"
    gpu = f" by GPU {escape(summary.gpu)}" if summary.gpu is not None else ""
    table = Table(title=f"travels of {escape(who)}{gpu}", pad_edge=False)
    for col in ("seq", "time (UTC)", "event", "holder", "offset", "bytes", "epoch", "chunk MAC", "hash"):
        table.add_column(col, justify="right" if col in ("seq", "offset", "bytes") else "left")
    for e in summary.entries:
        color = {"travel": "green", "refused": "yellow", "aborted": "red"}[e.event.value]
        when = datetime.datetime.fromtimestamp(e.time, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(str(e.seq), when, f"[{color}]{e.event.value}[/{color}]", e.holder,
                      str(e.chunk.dataset_offset), str(e.chunk.nbytes), f"{e.epoch_before}→{e.epoch_after}",
                      e.chunk_mac.hex()[:16] or "-", entry_hash(e).hex()[:16])
    return table


def _notes_table(summary: AuditSummary) -> Table:
    """The approvals, release signatures and releases (issue 28), with the digest each names."""
    table = Table(title="approvals and release", pad_edge=False)
    for col in ("seq", "time (UTC)", "event", "holder", "digest", "recipients", "signers"):
        table.add_column(col, justify="right" if col == "seq" else "left")
    for e in summary.notes:
        assert e.note is not None  # the summary's notes carry one each
        when = datetime.datetime.fromtimestamp(e.time, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(str(e.seq), when, e.event.value, escape(e.holder) or "-", e.note.digest.hex()[:16],
                      escape(", ".join(e.note.recipients)) or "-", escape(", ".join(e.note.signers)) or "-")
    return table


def _note_json(e: Entry) -> dict[str, object]:
    assert e.note is not None
    return {"seq": e.seq, "time": e.time, "event": e.event.value, "holder": e.holder, "digest": e.note.digest.hex(),
            "recipients": list(e.note.recipients), "signers": list(e.note.signers), "hash": entry_hash(e).hex()}


def _entry_json(e: Entry) -> dict[str, object]:
    assert e.chunk is not None  # the summary's entries are travel attempts, never the closing entry
    return {"seq": e.seq, "time": e.time, "gpu": e.gpu, "event": e.event.value, "holder": e.holder,
            "dataset_offset": e.chunk.dataset_offset, "nbytes": e.chunk.nbytes,
            "epoch_before": e.epoch_before, "epoch_after": e.epoch_after,
            "chunk_mac": e.chunk_mac.hex(), "prev_hash": e.prev_hash.hex(), "hash": entry_hash(e).hex()}


def _summary_json(s: AuditSummary) -> dict[str, object]:
    return {"ok": True, "closed": s.closed, "count": s.count, "job": s.job.hex() if s.job is not None else None,
            "continues": s.continues.hex() if s.continues is not None else None, "travels": s.travels,
            "head": {"seq": s.head_seq, "hash": s.head_hash.hex(), "signature": s.head_signature.hex()},
            "holder": s.holder, "gpu": s.gpu, "truncated_tail": s.truncated_tail,
            "entries": [_entry_json(e) for e in s.entries], "notes": [_note_json(e) for e in s.notes]}


def _regular(path: Path, what: str, limit: int) -> None:
    """BadInput unless `path` is a regular file (a link followed) within `limit`: a FIFO or a device may never end."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise BadInput(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise BadInput(f"{what} {path} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(f"{what} {path} is not a regular file")
    if st.st_size > limit:
        raise BadInput(f"{what} {path} is {st.st_size:,} bytes, above the {limit:,} it may be")


def _read_key(path: Path) -> bytes:
    _regular(path, "--key", MAX_KEY_BYTES)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # replaced by a FIFO since: no wait
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise BadInput(f"--key {path} is not a regular file")
        data = f.read(MAX_KEY_BYTES + 1)
    if len(data) > MAX_KEY_BYTES:
        raise BadInput(f"--key {path} is above the {MAX_KEY_BYTES:,} bytes it may be")
    return data


@audit_app.command()
def verify(
    log: Path = typer.Argument(..., help="The audit log file the orchestrator writes."),
    key: Path = typer.Option(..., "--key", help="The orchestrator's certificate or public key (PEM)."),
    holder: str | None = typer.Option(None, "--holder", help="Show only this holder's entries."),
    gpu: str | None = typer.Option(None, "--gpu", help="Require every entry to name this GPU (its serial, "
                                                      "as the holder saw it attested)."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the result as JSON here."),
    allow_truncated_tail: bool = typer.Option(False, "--allow-truncated-tail",
                                              help="Verify the intact prefix of a log whose last entry is torn."),
    head: str | None = typer.Option(None, "--head", metavar="HEX",
                                    help="The hash of an entry you saw before (a head you kept: the full hash "
                                         "this command prints): fail unless the log still holds it."),
) -> None:
    """Check the hash chain, every signature, seq contiguity, one GPU (--gpu's) and --head; say
    whether the log is closed (by the orchestrator's signed entry); list the holder's travels.

    Exit status: 0 verified and closed; 1 it does not verify, or does not hold --head; 3 it
    verifies but is not closed, or is empty: entries may be missing at its end (a job still
    running, or a log cut short); 4 closed, but it continues an earlier log of its job.
    """
    try:
        _regular(log, "audit log", MAX_LOG_BYTES)  # before it is read whole: no FIFO, device or giant
        known = None if head is None else hex_bytes(head, HASH_BYTES,
                                                    f"--head is the hash of an entry: {2 * HASH_BYTES} hex digits")
        summary = verify_log(log, _read_key(key), holder, gpu=gpu, allow_truncated_tail=allow_truncated_tail,
                             known_head=known)
    except (GputravelError, OSError) as exc:
        if json_out is not None:
            failure = {"failure": exc.failure.value, "seq": exc.seq} if isinstance(exc, AuditError) else {}
            write_json(json_out, {"ok": False, "error": str(exc), **failure})
        console.print(f"[red]audit log verification failed:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from None
    console.print(_table(summary))
    if summary.notes:
        console.print(_notes_table(summary))
    if summary.truncated_tail:
        console.print("[yellow]the torn final entry was ignored[/yellow]")
    named = f", GPU {escape(summary.gpu)}" if summary.gpu is not None else ""
    job = f", job {summary.job.hex()}, {summary.travels} travels" if summary.job is not None else ""
    job += ", continuing an earlier log" if summary.continues is not None else ""
    facts = f"{summary.count} entries{named}{job}, head {summary.head_hash.hex()}"
    if json_out is not None:
        write_json(json_out, _summary_json(summary))
    if summary.count == 0:
        console.print("[yellow]empty log: nothing is signed, so nothing is proven; not closed: entries may be "
                      "missing at the end[/yellow]")
        raise typer.Exit(NOT_CLOSED)
    if not summary.closed:
        console.print(f"[yellow]chain verifies, but the log is not closed: entries may be missing at the end[/yellow] "
                      f"(a job still running, or a log cut short; {facts})", soft_wrap=True)
        raise typer.Exit(NOT_CLOSED)
    if summary.continues is not None:
        console.print(f"[yellow]chain verifies and the log is closed, but it continues an earlier log of its job[/yellow] "
                      f"(from the entry with hash {summary.continues.hex()}: that log holds the job's travels "
                      f"before; {facts})", soft_wrap=True)
        raise typer.Exit(CONTINUES)
    console.print(f"[green]chain OK, log closed[/green] ({facts})", soft_wrap=True)  # one line: the head to copy
