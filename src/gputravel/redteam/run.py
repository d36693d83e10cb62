"""Run every attack against one live local cohort (a malicious host, alice, bob and a malicious holder,
mallory, each holder with a marked dataset), then search each attacker's loot for the other holders'
markers and samples; print the report, a table for people, JSON for machines. The datasets are raw bytes,
or image record datasets (``data="records"``: the `image` workload's digits, canary images among them).
Then the job rows (issue 28, redteam/jobs.py), on cohorts of their own whose holders hold image records."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gputravel.errors import BadInput, GputravelError, RemoteError
from gputravel.cohort import stopping
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.supervisor import SNOOP_FILE
from gputravel.data.records import RECORDS_FILE, common_schema
from gputravel.files import RAW, RECORDS
from gputravel.redteam.arena import ALICE, BOB, MALLORY, Arena, Attack, Verdict
from gputravel.redteam.canary import SPACING, Found, Needles, make_dataset, make_image_datasets, search
from gputravel.redteam.cohort import RedTeamCohort
from gputravel.redteam.evidence import Control, Record, Searched
from gputravel.redteam.jobarena import JobAttack
from gputravel.redteam.jobs import JOB_ATTACKS, run_jobs
from gputravel.redteam.rows import ATTACKS

MIB = 1 << 20
HOLDERS = (ALICE, BOB, MALLORY)
DATASET_BYTES = 4 * MIB
BUFFER_BYTES = 2 * MIB  # two records per chunk: mid-copy attacks have a record before and after
DEVICE_TIMEOUT = 2.0  # a dropped push fails in seconds, not minutes
HOLDER_TIMEOUT = 5.0  # how long the orchestrator waits for a holder to hand the GPU back
SKIPPED = "not run"
DATA = (RAW, RECORDS)  # what the holders hold: marked random bytes, or image records with canary images


@dataclass(frozen=True)
class AttackResult:
    name: str
    adversary: str
    tried: str
    stopped_by: str
    plaintext_bytes_obtained: int
    outcome: str  # "defeated", "FAILED", or "skipped" (its defence is process isolation, which is off)
    marker_bytes: int  # of which: 16-byte markers found
    sample_bytes: int  # of which: 32-byte plain samples of the datasets found
    exposed_estimate_bytes: int  # each marker found stands for the 4 KiB of the dataset it marks (16 or 64 bytes)
    scanned_bytes: int  # how much of what the attacker read was searched
    evidence: tuple[Record, ...]


@dataclass(frozen=True)
class RedTeamReport:
    attacks: tuple[AttackResult, ...]

    @property
    def failed(self) -> tuple[AttackResult, ...]:
        return tuple(r for r in self.attacks if r.outcome == "FAILED")

    @property
    def skipped(self) -> tuple[AttackResult, ...]:
        return tuple(r for r in self.attacks if r.outcome == "skipped")

    def to_json(self) -> dict:
        # "evidence" in words, as the table prints it; "records" the same, typed (evidence.load)
        return {"attacks": [{**asdict(r), "evidence": [e.line() for e in r.evidence],
                             "records": msgspec.to_builtins(r.evidence)} for r in self.attacks],
                "defeated": len(self.attacks) - len(self.failed) - len(self.skipped), "failed": len(self.failed),
                "skipped": [r.name for r in self.skipped]}


class RedTeamAborted(RemoteError):
    """The cohort could not even serve honest travels: no attack was tried."""


PREFIX = "gputravel-redteam-"  # of its directory, with the cohort's keys in it


def run_redteam(*, workdir: Path | None = None, only: tuple[str, ...] = (), data: str = RAW,
                on_result: Callable[[Attack | JobAttack, Verdict], None] | None = None) -> RedTeamReport:
    """The arena's rows against one live cohort, then the job rows (redteam/jobs.py) on cohorts of their own."""
    if data not in DATA:
        raise BadInput(f"red-team data is one of {', '.join(DATA)}, not {data!r}")
    chosen = [a for a in ATTACKS if not only or a.name in only]
    jobs = [a for a in JOB_ATTACKS if not only or a.name in only]
    stopping.sweep(str(workdir) if workdir else None, PREFIX)  # what a red team killed outright left
    tmp = Path(tempfile.mkdtemp(prefix=PREFIX, dir=workdir))
    stopping.claim(tmp)
    try:
        results: list[AttackResult] = []
        if chosen:
            if data == RECORDS:
                needles = make_image_datasets(tmp, HOLDERS, DATASET_BYTES)
            else:
                needles = {h: make_dataset(dataset_path(tmp, h, data), h, DATASET_BYTES) for h in HOLDERS}
            run_dir, verdicts = _attack(tmp, chosen, on_result, data)
            results += [judge_row(a, v, run_dir, needles, tmp, data) for a, v in zip(chosen, verdicts, strict=True)]
        if jobs:  # always image records: a job trains on them
            results += [judge_job(a, v) for a, v in zip(jobs, run_jobs(tmp, jobs, on_result), strict=True)]
        return RedTeamReport(tuple(results))
    finally:
        stopping.delete(tmp)  # whatever depth the hostile holder nested its own directory to


def dataset_path(tmp: Path, holder: str, data: str) -> Path:
    """A holder's dataset: a file of raw bytes, or a record dataset's directory."""
    return tmp / (holder if data == RECORDS else f"{holder}.bin")


def _attack(tmp: Path, chosen: list[Attack], on_result: Callable[[Attack | JobAttack, Verdict], None] | None,
            data: str) -> tuple[Path, list[Verdict]]:
    verdicts: list[Verdict] = []
    fmt = RECORDS if data == RECORDS else RAW
    specs = tuple(HolderSpec(h, str(dataset_path(tmp, h, data)), fmt) for h in HOLDERS)
    # The orchestrator admits record holders only to a cohort that states their schema (as a job does)
    schema = common_schema([(h.name, h.dataset) for h in specs]).canonical_json() if data == RECORDS else ""
    config = CohortConfig(holders=specs, buffer_bytes=BUFFER_BYTES, schema=schema, workdir=str(tmp), snoop=True,
                          tap=True, audit_arrival=True, device_timeout=DEVICE_TIMEOUT, travel_timeout=HOLDER_TIMEOUT)
    with RedTeamCohort(config, malicious=(MALLORY,)) as cohort:
        arena = Arena(cohort)
        for h in HOLDERS:  # every holder travels once honestly (mallory keeps its keys)
            out = arena.travel(h)
            if not out.verified:
                raise RedTeamAborted(f"honest warm-up failed: {out.line()}")
        for attack in chosen:
            arena.begin(attack.name)
            verdict = _run_one(attack, arena)
            try:  # rows are independent: a holder the attack got dropped joins again
                arena.restore()
            except GputravelError:
                pass  # it stays offline: the next attack that needs it says so
            verdicts.append(verdict)
            if on_result is not None:
                on_result(attack, verdict)
        arena.host.close()
        assert cohort.dir is not None
        return cohort.dir, verdicts


def _run_one(attack: Attack, arena: Arena) -> Verdict:
    """The row's verdict; an attack that could not be carried out fails that row only."""
    iso = arena.cohort.isolation
    if attack.needs_isolation and not iso.on:
        return Verdict(False, f"{SKIPPED}: process isolation is off ({iso.reason}); run as root", ())
    try:
        stopped = attack.run(arena)
    except Exception as exc:  # noqa: BLE001 (a typed error, or the row's own bug: either fails this row alone)
        return Verdict(False, f"not carried out: {type(exc).__name__}: {exc}", tuple(arena.evidence))
    return Verdict(stopped, attack.stopped_by, tuple(arena.evidence), arena.plaintext)


def judge_row(attack: Attack, verdict: Verdict, run_dir: Path, needles: dict[str, Needles], tmp: Path,
           data: str = RAW) -> AttackResult:
    """An arena row: its verdict, and what the search found of the holders' canaries in what its attacker read."""
    files = _view(attack, run_dir)
    # A malicious holder's own data is not a leak; the host owns no data at all.
    found = search(files, [n for h, n in needles.items() if h != MALLORY or "holder" not in attack.adversary])
    found += verdict.plaintext  # the row's own canaries (the all-reduce row's gradient)
    stopped, evidence = verdict.stopped, verdict.evidence
    if attack.name == "snoop-everything":
        stopped, evidence = _watched(run_dir, found, needles, tmp, data)
    elif "holder" in attack.adversary:
        own = search(files, [needles[MALLORY]])
        if own.total:  # the search works on this very loot: it finds what mallory may see, its own data
            evidence += (Control(what="mallory's own markers and samples in its loot", nbytes=own.total),)
    outcome = "defeated" if stopped and found.total == 0 else "FAILED"
    if verdict.stopped_by.startswith(SKIPPED):
        outcome = "skipped"
    return AttackResult(attack.name, attack.adversary, attack.tried, verdict.stopped_by, found.total, outcome,
                        found.marker_bytes, found.sample_bytes, found.markers * SPACING,
                        found.scanned_bytes, evidence)


def judge_job(attack: JobAttack, verdict: Verdict) -> AttackResult:
    """A job row: its verdict, and what it found of the canaries in what its attacker read."""
    found = verdict.plaintext
    outcome = "defeated" if verdict.stopped and found.total == 0 else "FAILED"
    return AttackResult(attack.name, attack.adversary, attack.tried, verdict.stopped_by, found.total, outcome,
                        found.marker_bytes, found.sample_bytes, found.markers * SPACING, found.scanned_bytes,
                        verdict.evidence)


def _view(attack: Attack, run_dir: Path) -> list[Path]:
    """Everything this attacker read during this attack (the whole run for snoop-everything)."""
    loot = run_dir / "adversary" / "loot"
    if attack.name == "snoop-everything":
        return [p for p in (run_dir / SNOOP_FILE, run_dir / "tap.bin") if p.exists()] + sorted(loot.glob("*/host-*"))
    files = sorted((loot / attack.name).glob("*"))
    return [p for p in files if attack.adversary == "host+holder" or p.name.startswith(f"{attack.adversary}-")]


def _watched(run_dir: Path, found: Found, needles: dict[str, Needles], tmp: Path,
             data: str) -> tuple[bool, tuple[Record, ...]]:
    """The snoop row is only meaningful if the host really watched, and the scanner works."""
    snoop, tap = (p.stat().st_size if p.exists() else 0 for p in (run_dir / SNOOP_FILE, run_dir / "tap.bin"))
    plain = [dataset_path(tmp, h, data) for h in HOLDERS]
    own = search([p / RECORDS_FILE if data == RECORDS else p for p in plain], needles.values())
    watched = snoop > MIB and tap > 1024 and found.scanned_bytes > 16 * MIB
    searched = Searched(nbytes=found.scanned_bytes, snoop_bytes=snoop, tap_bytes=tap)
    control = Control(what="markers in the holders' own datasets", nbytes=own.marker_bytes)
    return watched and own.marker_bytes > 0, (searched, control)


# ----------------------------------------------------------------------------- the report
def _outcome(r: AttackResult) -> str:
    style = {"defeated": "green", "skipped": "yellow"}.get(r.outcome, "bold red")
    return f"[{style}]{r.outcome}[/{style}]"


def print_report(report: RedTeamReport, console: Console, *, evidence: bool = False) -> None:
    """A table on a wide terminal; one block per attack on a narrow one (the texts are long)."""
    if console.width >= 150:
        t = Table(title="gputravel red team: every attack against a live cohort", show_lines=True)
        for col, kw in (("attack", {"no_wrap": True}), ("adversary", {"no_wrap": True}), ("tried", {"ratio": 3}),
                        ("stopped by", {"ratio": 3}), ("plaintext bytes", {"justify": "right"}), ("outcome", {})):
            t.add_column(col, **kw)
        for r in report.attacks:
            t.add_row(r.name, r.adversary, escape(r.tried), escape(r.stopped_by), str(r.plaintext_bytes_obtained),
                      _outcome(r))
        console.print(t)
    for r in report.attacks:
        if console.width < 150:
            console.print(f"[bold]{r.name}[/bold] ({r.adversary}): {r.plaintext_bytes_obtained} bytes of plaintext "
                          f"obtained, {_outcome(r)}\n  tried:      {escape(r.tried)}\n"
                          f"  stopped by: {escape(r.stopped_by)}",
                          highlight=False)
        elif evidence:
            console.print(f"[bold]{r.name}[/bold]")
        if evidence:
            for record in r.evidence:
                console.print(f"  - {escape(record.line())}", highlight=False)  # refusals say [claim]
    n, bad = len(report.attacks), len(report.failed)
    verdict = "[green]every attack defeated, 0 bytes of plaintext obtained[/green]" if not bad else \
        f"[bold red]{bad} of {n} attacks NOT defeated: {', '.join(r.name for r in report.failed)}[/bold red]"
    if report.skipped:
        verdict += (f" [yellow]({len(report.skipped)} not run, process isolation off: "
                    f"{', '.join(r.name for r in report.skipped)})[/yellow]")
    console.print(verdict)
