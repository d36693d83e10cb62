"""The arena the red-team rows run in: the live cohort and the attackers' links
(:class:`Arena`), what a row returns (:class:`Verdict`), and small helpers the rows share.

A row's verdict says whether the defence it names was *seen* to act (a typed error from the
orchestrator, a fault flag the host read in BAR0, an attacker's read that failed, a travel
that never happened) and whether the cohort carried on; the bytes of plaintext the attacker
obtained are counted afterwards, by searching its loot (:mod:`gputravel.redteam.run`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gputravel.orchestrator.audit import Entry, read_log
from gputravel.errors import GputravelError
from gputravel.protocol.control import BaselineReport, TravelReport
from gputravel.redteam.canary import Found
from gputravel.redteam.cohort import HolderLink, HostLink, RedTeamCohort
from gputravel.redteam.messages import HolderNews, HostNews

ALICE, BOB, MALLORY = "alice", "bob", "mallory"


@dataclass(frozen=True)
class Verdict:
    stopped: bool
    stopped_by: str
    evidence: tuple[str, ...]
    # What a row whose secrets are not the holders' datasets found of its own canaries (the
    # all-reduce row's gradients), counted with what the holders' search finds in its loot.
    plaintext: Found | None = None


@dataclass(frozen=True)
class Attack:
    name: str
    adversary: str  # "host", "holder" or "host+holder"
    tried: str
    run: Callable[[Arena], Verdict]
    needs_isolation: bool = False  # the defence is process isolation: only with it on (root) is the row run


@dataclass(frozen=True)
class Outcome:
    holder: str
    report: TravelReport | None
    error: GputravelError | None

    @property
    def verified(self) -> bool:
        return self.report is not None and self.report.chunk is not None

    def failed_with(self, *kinds: type) -> bool:
        return isinstance(self.error, kinds)

    def describe(self) -> str:
        if self.error is not None:
            return f"travel to {self.holder} failed: {type(self.error).__name__}: {self.error}"
        assert self.report is not None
        if self.report.refused:
            return f"{self.holder} refused the travel ({self.report.refused})"
        audit = self.report.nonzero_on_arrival
        seen = f"; its arrival audit found {audit} non-zero bytes" if audit >= 0 else ""
        return f"travel to {self.holder} verified (digest of VRAM = manifest){seen}"


class Arena:
    """The live cohort and the attackers' links, as the attacks use them."""

    def __init__(self, cohort: RedTeamCohort, host: HostLink, mallory: HolderLink, buffer_bytes: int,
                 audit: bool) -> None:
        self.cohort, self.host, self.mallory = cohort, host, mallory
        self.buffer_bytes = buffer_bytes
        self.records = buffer_bytes // cohort.config.layout.record_bytes
        self.slots = cohort.config.layout.staging_slots
        self.audit = audit
        self._offset = {h.name: 0 for h in cohort.config.holders}
        self.dropped: set[str] = set()  # holders the orchestrator dropped (offline until they rejoin)
        self._log_at = 0  # how much of the orchestrator's log the attacks have seen
        self._journal_at = 0  # how many entries of its signed travel log

    def _next_offset(self, holder: str) -> int:
        size = self.cohort.dataset_bytes[holder]
        offset = self._offset[holder]
        self._offset[holder] = (offset + self.buffer_bytes) % max(size - size % self.buffer_bytes, self.buffer_bytes)
        return offset

    def travel(self, holder: str) -> Outcome:
        offset = self._next_offset(holder)
        try:
            return Outcome(holder, self.cohort.travel(holder, offset), None)
        except GputravelError as exc:
            # HolderLost or ContextRefused; across the control link only the message tells (cohort.client.error_from)
            if f"holder {holder!r} lost" in str(exc):
                self.dropped.add(holder)
            return Outcome(holder, None, exc)

    def baseline(self, holder: str) -> tuple[BaselineReport | None, str]:
        """The centralised TLS baseline: the orchestrator copies the chunk itself."""
        try:
            report = self.cohort.baseline(holder, self._next_offset(holder))
        except GputravelError as exc:
            return None, f"baseline transfer of {holder}'s chunk failed: {type(exc).__name__}: {exc}"
        return report, (f"baseline transfer of {holder}'s chunk: the orchestrator wrote it into the dataset buffer "
                        "with its own user-channel copy, and VRAM's digest matched the manifest")

    def rejoin(self, holder: str) -> str:
        """A dropped holder joins again (attesting the orchestrator afresh), as Cohort.rejoin."""
        self.cohort.rejoin(holder)
        self.dropped.discard(holder)
        return f"{holder} joined the cohort again (attested the orchestrator afresh)"

    def restore(self) -> list[str]:
        """Leave the cohort as the next attack expects it: every dropped holder back in."""
        return [self.rejoin(h) for h in sorted(self.dropped)]

    def orchestrator_said(self) -> list[str]:
        """The orchestrator's warnings since the last look (its log: a trusted party's account)."""
        path = self.cohort.children["orchestrator"].log
        with open(path, "rb") as f:
            f.seek(self._log_at)
            text = f.read()
        self._log_at += len(text)
        return [f"orchestrator: {line}" for line in text.decode("utf-8", "replace").splitlines()
                if "re-key" in line or "rotation" in line]

    def journal(self) -> list[str]:
        """Entries of the orchestrator's signed travel log since the last look."""
        return [log_line(e) for e in self.journal_entries()]

    def journal_entries(self) -> list[Entry]:
        path = self.cohort.audit_log_path
        entries = read_log(path, allow_truncated_tail=True) if path is not None and path.exists() else []
        fresh, self._journal_at = entries[self._journal_at :], len(entries)
        return fresh

    def look(self) -> None:
        """Forget what the orchestrator logged so far (a new attack starts)."""
        self.orchestrator_said()
        self.journal()

    def carry_on(self, holder: str) -> tuple[bool, str]:
        """Does the cohort go on? A fault an attack left may cost one refused travel (DoS)."""
        first = self.travel(holder)
        if first.verified:
            return True, "then: " + first.describe()
        second = self.travel(holder)
        return second.verified, f"then: {first.describe()}; then: {second.describe()}"

    def copy_push(self, record: int) -> int:
        """Index, within a holder's travel, of the user push that copies ``record``."""
        return record + (self.records if self.audit else 0)


def log_line(e: Entry) -> str:
    """An entry of the signed travel log, as a line of evidence."""
    return f"travel log: {e.event.value} {e.chunk.holder}, key epoch {e.epoch_before} -> {e.epoch_after}"


def rekeyed(said: list[str]) -> bool:
    """Did the orchestrator say it re-keyed the GPU through a new SPDM session?"""
    return any("re-keyed the GPU through a new SPDM session" in line for line in said)


def news_lines(news: HostNews | HolderNews, prefix: str) -> list[str]:
    """What an attacker reported, as lines of evidence (the host's switch notes left out)."""
    return [f"{prefix}: {e}" for e in news.events if not e.startswith("switch:")]


def host_said(news: HostNews, text: str) -> bool:
    """Did the host report something containing ``text``?"""
    return any(text in e for e in news.events)
