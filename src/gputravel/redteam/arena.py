"""The arena the red-team rows run in: the live cohort and the attackers' links (:class:`Arena`), a row
(:class:`Attack`, made by :func:`row`) and what its run comes to (:class:`Verdict`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from msgspec import structs

from gputravel.errors import GputravelError
from gputravel.orchestrator.audit import read_log
from gputravel.redteam.bus import Did, Event, MarkRow
from gputravel.redteam.canary import Found
from gputravel.redteam.cohort import HolderLink, HostLink, RedTeamCohort
from gputravel.redteam.evidence import Acted, Baseline, Journal, Logged, Record, Rejoined, Travel

ALICE, BOB, MALLORY = "alice", "bob", "mallory"


@dataclass(frozen=True)
class Verdict:
    stopped: bool
    stopped_by: str
    evidence: tuple[Record, ...]
    plaintext: Found = field(default_factory=Found)


@dataclass(frozen=True)
class Attack:
    name: str
    adversary: str  # "host", "holder" or "host+holder"
    tried: str
    stopped_by: str  # the defence that stops it, as the table says it
    run: Callable[[Arena], bool]  # whether that defence was seen to act and the cohort went on
    needs_isolation: bool = False  # the defence is process isolation: only with it on (root) is the row run


def row(name: str, adversary: str, *, tried: str, stopped_by: str,
        needs_isolation: bool = False) -> Callable[[Callable[[Arena], bool]], Attack]:
    return lambda run: Attack(name, adversary, tried, stopped_by, run, needs_isolation)


class Arena:
    """The live cohort and the attackers' links; it keeps what each attack saw (:attr:`evidence`)."""

    def __init__(self, cohort: RedTeamCohort) -> None:
        self.cohort = cohort
        self.host, self.mallory = HostLink(cohort, self._acted), HolderLink(cohort, MALLORY, self._acted)
        self.buffer_bytes = cohort.config.buffer_bytes
        audited = cohort.config.audit_arrival  # the arrival audit reads each record once before the copy
        self._audit_pushes = self.buffer_bytes // cohort.config.layout.record_bytes if audited else 0
        self._offset = {h.name: 0 for h in cohort.config.holders}
        self.dropped: set[str] = set()  # holders the orchestrator dropped (offline until they rejoin)
        self._log_at = 0  # how much of the orchestrator's log the attacks have seen
        self._journal_at = 0  # how many entries of its signed travel log
        self.evidence: list[Record] = []
        self.plaintext = Found()  # what a row found of its own canaries (the all-reduce row's gradient)
        self.stage = ""  # stamped on each record kept (see evidence.Record)
        self.row = ""

    def keep(self, *records: Record) -> None:
        self.evidence += [structs.replace(r, stage=self.stage) if self.stage else r for r in records]

    def _acted(self, who: str, events: tuple[Event, ...]) -> None:
        # The host's switch notes are its bookkeeping, not evidence (verdicts still read them).
        self.keep(*(Acted(who=who, did=e.did, party=e.party, place=e.place, count=e.count, nbytes=e.nbytes,
                          error=e.error, said=e.text) for e in events if e.did != Did.SWITCH_ASKED))

    def begin(self, row: str) -> None:
        """A new attack: loot goes under its name; what was logged and seen so far was the last one's."""
        self.host.begin(row)
        self.mallory.order(MarkRow(row))
        self.row = row
        self.orchestrator_said()
        self.journal()
        self.evidence, self.plaintext, self.stage = [], Found(), ""

    def _next_offset(self, holder: str) -> int:
        size = self.cohort.dataset_bytes[holder]
        offset = self._offset[holder]
        self._offset[holder] = (offset + self.buffer_bytes) % max(size - size % self.buffer_bytes, self.buffer_bytes)
        return offset

    def travel(self, holder: str, *, after: bool = False) -> Travel:
        offset = self._next_offset(holder)
        try:
            report = self.cohort.travel(holder, offset)
            out = Travel(holder=holder, verified=report.chunk is not None, refused=report.refused or "", error="",
                         message="", audit=report.nonzero_on_arrival, after=after)
        except GputravelError as exc:
            # HolderLost or ContextRefused; across the control link only the message tells (cohort.client.error_from)
            if f"holder {holder!r} lost" in str(exc):
                self.dropped.add(holder)
            kinds = tuple(c.__name__ for c in type(exc).__mro__ if issubclass(c, GputravelError))
            out = Travel(holder=holder, verified=False, refused="", error=type(exc).__name__, message=str(exc),
                         audit=-1, kinds=kinds, after=after)
        self.keep(out)
        return out

    def baseline(self, holder: str) -> bool:
        """The TLS baseline: the orchestrator copies the chunk itself."""
        try:
            self.cohort.baseline(holder, self._next_offset(holder))
        except GputravelError as exc:
            self.keep(Baseline(holder=holder, error=type(exc).__name__, message=str(exc)))
            return False
        self.keep(Baseline(holder=holder, error="", message=""))
        return True

    def rejoin(self, holder: str) -> None:
        """A dropped holder joins again (attesting the orchestrator afresh)."""
        self.cohort.rejoin(holder)
        self.dropped.discard(holder)
        self.keep(Rejoined(holder=holder))

    def restore(self) -> None:
        """Leave the cohort as the next attack expects it: every dropped holder back in."""
        for h in sorted(self.dropped):
            self.rejoin(h)

    def orchestrator_said(self) -> list[Logged]:
        """The orchestrator's warnings since the last look (its log: a trusted party's account)."""
        with open(self.cohort.children["orchestrator"].log, "rb") as f:
            f.seek(self._log_at)
            text = f.read()
        self._log_at += len(text)
        said = [Logged.of(line) for line in text.decode("utf-8", "replace").splitlines()
                if "re-key" in line or "rotation" in line]
        self.keep(*said)
        return said

    def rekeyed(self) -> bool:
        """Did the orchestrator say, since the last look, that it re-keyed the GPU? (Its travel log is kept too.)"""
        said = self.orchestrator_said()
        self.journal()
        return any(s.rekeyed for s in said)

    def journal(self) -> list[Journal]:
        """Entries of the orchestrator's signed travel log since the last look."""
        path = self.cohort.audit_log_path
        entries = read_log(path, allow_truncated_tail=True) if path is not None and path.exists() else []
        fresh, self._journal_at = entries[self._journal_at :], len(entries)
        out = [Journal(event=e.event.value, holder=e.holder, epoch_before=e.epoch_before,
                       epoch_after=e.epoch_after) for e in fresh]
        self.keep(*out)
        return out

    def carry_on(self, holder: str) -> bool:
        """Does the cohort go on? A fault an attack left may cost one refused travel (DoS)."""
        return self.travel(holder, after=True).verified or self.travel(holder, after=True).verified

    def copy_push(self, record: int) -> int:
        """Index, within a holder's travel, of the user push that copies ``record``."""
        return record + self._audit_pushes
