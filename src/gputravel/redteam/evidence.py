"""What a red-team row saw, as typed records that verdicts and tests read field by field;
:meth:`Record.line` puts one into words for people (the JSON's ``evidence``; ``records`` are typed)."""

from __future__ import annotations

import re
from typing import Union

import msgspec

from gputravel.redteam.bus import Did


class Record(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    stage: str = ""  # the part of a row it comes from, where a row has several
    template = ""  # the record in words, formatted with its fields

    def text(self) -> str:
        return self.template.format_map(msgspec.structs.asdict(self))

    def line(self) -> str:
        return f"[{self.stage}] {self.text()}" if self.stage else self.text()


class Travel(Record, tag="travel"):
    """A travel the driver asked for, and how it ended; ``after``: one to see the cohort carries on."""

    holder: str
    verified: bool  # VRAM's digest matched the holder's manifest
    refused: str  # why the holder refused it ("" if it did not)
    error: str  # the typed error the travel failed with ("" if none)
    message: str  # that error's words (the orchestrator's)
    audit: int  # non-zero bytes the holder's arrival audit found (-1: no audit)
    kinds: tuple[str, ...] = ()  # the error's class and the classes it derives from, by name
    after: bool = False

    def text(self) -> str:
        then = "then: " if self.after else ""
        if self.error:
            return f"{then}travel to {self.holder} failed: {self.error}: {self.message}"
        if self.refused:
            return f"{then}{self.holder} refused the travel ({self.refused})"
        seen = f"; its arrival audit found {self.audit} non-zero bytes" if self.audit >= 0 else ""
        return f"{then}travel to {self.holder} verified (digest of VRAM = manifest){seen}"


class Baseline(Record, tag="baseline"):
    """The TLS baseline: the orchestrator copied the holder's chunk itself."""

    holder: str
    error: str
    message: str

    def text(self) -> str:
        if self.error:
            return f"baseline transfer of {self.holder}'s chunk failed: {self.error}: {self.message}"
        return (f"baseline transfer of {self.holder}'s chunk: the orchestrator wrote it into the dataset buffer "
                "with its own user-channel copy, and VRAM's digest matched the manifest")


class Acted(Record, tag="acted"):
    """What an adversary reported it did or saw (an :class:`~gputravel.redteam.bus.Event`)."""

    template = "{who}: {said}"
    who: str  # "host" or the malicious holder's name
    did: Did
    party: str
    place: str
    count: int
    nbytes: int
    error: str
    said: str  # the adversary's own words


REKEYED = "re-keyed the GPU through a new SPDM session"
_RECOVERY_FAILED = re.compile(r"recovery rotation failed \((\w+)")


class Logged(Record, tag="logged"):
    """A warning of the orchestrator's log (a trusted party's words, read once, here)."""

    template = "orchestrator: {said}"
    said: str
    rekeyed: bool  # it re-keyed the GPU through a new SPDM session
    recovery_failed: str  # the typed error its recovery rotation failed with ("" if none)

    @classmethod
    def of(cls, line: str) -> Logged:
        failed = _RECOVERY_FAILED.search(line)
        return cls(said=line, rekeyed=REKEYED in line, recovery_failed=failed.group(1) if failed else "")


class Journal(Record, tag="journal"):
    """An entry of the orchestrator's signed travel log."""

    template = "travel log: {event} {holder}, key epoch {epoch_before} -> {epoch_after}"
    event: str
    holder: str
    epoch_before: int
    epoch_after: int


class Rejoined(Record, tag="rejoined"):
    template = "{holder} joined the cohort again (attested the orchestrator afresh)"
    holder: str


class Recovered(Record, tag="recovered"):
    template = ("after {holder}'s travel the GPU was recovered by the rotation under way (a confirmed rotation, "
                "no re-key)")
    holder: str


class Travelled(Record, tag="travelled"):
    holder: str
    went: bool

    def text(self) -> str:
        return f"the GPU {'travelled' if self.went else 'never travelled'} to {self.holder}"


class EpochSkipped(Record, tag="epoch-skipped"):
    holder: str
    spent: int

    def text(self) -> str:
        return (f"the travel log shows {self.holder}'s travel began on key epoch {self.spent}, the epoch of the "
                f"baseline copy, and {self.holder} was given epoch {self.spent + 1}")


class Control(Record, tag="control"):
    """The search, run where it must find something, finds ``nbytes`` of ``what``."""

    template = "control: the same search finds {nbytes} bytes of {what}"
    what: str
    nbytes: int


class Searched(Record, tag="searched"):
    nbytes: int
    snoop_bytes: int
    tap_bytes: int

    def text(self) -> str:
        return (f"searched {self.nbytes >> 20} MiB: the snooper's file ({self.snoop_bytes >> 20} MiB), the TLS tap "
                f"({self.tap_bytes >> 10} KiB) and the host's snapshots and captured pushes of every attack")


class Probed(Record, tag="probed"):
    """What an attacker's process got of other parties' memory, descriptors and files."""

    attacker: str
    victims: tuple[str, ...]
    isolation: bool  # process isolation on (otherwise nothing was probed)
    uids: str  # each party's uid, as the launcher gave them
    denied: int
    read: int  # targets read (public /proc files left out)
    nbytes: int  # bytes read of those

    def text(self) -> str:
        if not self.isolation:
            return f"process isolation is off (not root): {', '.join(self.victims)} not probed"
        return (f"process isolation on: each party under its own uid ({self.uids}), non-dumpable; "
                f"{self.attacker}'s own process tried {self.denied + self.read} targets of "
                f"{', '.join(self.victims)}: {self.denied} denied, {self.read} read ({self.nbytes} bytes)")


class Carried(Record, tag="carried"):
    """What the host carried of one case of the all-reduce row, and the gradient bytes in it."""

    template = ("{case}: the host carried {records} records ({nbytes} bytes) of the {variant} ring: {found} bytes of "
                "the canary gradient found")
    case: str
    variant: str
    records: int
    nbytes: int
    found: int


class Tampered(Record, tag="tampered"):
    """What the host did to one record rank 0 sent rank 1 (``delivered`` -1: dropped)."""

    case: str
    fault: str
    record: int
    nbytes: int
    delivered: int

    def text(self) -> str:
        what = {"flip": f"flipped bit 0 of byte {self.nbytes // 2} of",
                "replay": f"delivered the record before again ({self.delivered} bytes), in place of",
                "cut": f"delivered the first {self.delivered} bytes of"}.get(self.fault, "dropped")
        return f"{self.case}: host: {what} record {self.record} of those rank 0 sent rank 1 ({self.nbytes} bytes)"


class RankStep(Record, tag="rank-step"):
    case: str
    rank: int
    completed: bool
    sum_right: bool  # its weights moved by exactly the right average
    untouched: bool  # its weights never moved
    error: str  # the typed error that stopped it ("" if it completed)
    message: str

    def text(self) -> str:
        if not self.completed:
            moved = "its parameters never moved" if self.untouched else "its parameters MOVED"
            return f"{self.case}: rank {self.rank}'s step stopped: {self.error}: {self.message}; {moved}"
        return f"{self.case}: rank {self.rank}'s step completed with {'the right' if self.sum_right else 'a WRONG'} sum"


class SearchedRing(Record, tag="searched-ring"):
    """What the all-reduce row searched: all the host carried but the control's."""

    template = ("searched {nbytes} bytes the host carried in every case but the control for 8-byte runs of the canary "
                "gradient in 5 encodings (float32 of the gradient, of its 1/{world} share and of the updated weights; "
                "float16 and bfloat16 of the share)")
    nbytes: int
    world: int


class Failed(Record, tag="failed"):
    """Something an adversary failed at outside the attack (the row then cannot be defeated)."""

    template = "{what}"
    what: str


# ----------------------------------------------------------------------------- the job rows (issue 28)
class Refusal(Record, tag="refusal"):
    """A holder's refusal of an orchestrator at attestation: the claim that failed and its words."""

    template = "{holder} refused the orchestrator at attestation [{claim}]: {said}"
    holder: str
    claim: str
    said: str


class JobLog(Record, tag="job-log"):
    """What one orchestrator's signed travel log holds of its job."""

    approved: tuple[str, ...]  # holders that accepted its attestation of the job
    travels: int  # chunks copied and verified
    nbytes: int  # bytes of those chunks
    signed: tuple[str, ...]
    released: bool

    def text(self) -> str:
        approved = ", ".join(self.approved) or "no holder"
        signed = f"; release signed by {', '.join(self.signed) or 'no holder'}" if self.signed or self.released else ""
        return (f"travel log: job approved by {approved}; {self.travels} chunks travelled ({self.nbytes} bytes)"
                f"{signed}{'; model released' if self.released else ''}")


class Quoted(Record, tag="quoted"):
    """A holder's check of a real quote: what RTMR[3] was extended with, which job the evidence named."""

    extended: tuple[str, ...]  # the job digests extended into RTMR[3], in order (hex prefixes)
    named: str  # the job digest the orchestrator's evidence names (hex prefix)
    claim: str  # the claim refused ("" if accepted)
    said: str

    def text(self) -> str:
        held = " then ".join(f"{d}..." for d in self.extended) or "nothing"
        seen = f"refused [{self.claim}]: {self.said}" if self.claim else "accepted"
        return f"RTMR[3] extended with {held}, the evidence naming job {self.named}...: {seen}"


class FileRead(Record, tag="file-read"):
    """A file of the orchestrator's run the host read whole (and searched)."""

    name: str
    nbytes: int
    sealed: bool  # a sealed blob (broker/seal.py, or a release file's HPKE)
    said: str  # why a plaintext reader could not load it ("" if it is no model or checkpoint)

    def text(self) -> str:
        how = "; sealed" if self.sealed else ""
        return f"host read {self.name} ({self.nbytes} bytes){how}{f': {self.said}' if self.said else ''}"


class Opened(Record, tag="opened"):
    """A party opening a release or a sealed file with a key of its own."""

    who: str
    what: str
    error: str  # the typed error it got ("" if it opened)
    said: str
    nbytes: int  # plaintext bytes it got

    def text(self) -> str:
        got = f"{self.error}: {self.said}" if self.error else f"opened, {self.nbytes} bytes"
        return f"{self.who} opened {self.what}: {got}"


class Released(Record, tag="released"):
    """How a job's end went, as its report says: names only."""

    run: str
    signed: tuple[str, ...]
    declined: tuple[str, ...]
    released_to: tuple[str, ...]
    files: tuple[str, ...]  # what the run directory holds

    def text(self) -> str:
        to = f"released to {', '.join(self.released_to)}" if self.released_to else "NOT released"
        return (f"{self.run}: signed by {', '.join(self.signed) or 'no holder'}, declined by "
                f"{', '.join(self.declined) or 'none'}: {to}; run directory: {', '.join(self.files)}")


class SealTried(Record, tag="seal-tried"):
    """seal_release given a statement and signatures: the release file, or its refusal."""

    what: str
    signatures: int
    quorum: int
    error: str
    said: str
    nbytes: int  # of the release file made (0: none)

    def text(self) -> str:
        got = f"{self.error}: {self.said}" if self.error else f"sealed ({self.nbytes} bytes)"
        given = f"{self.signatures} signature{'' if self.signatures == 1 else 's'}"
        return f"{self.what} ({given} for a quorum of {self.quorum}): {got}"


class Measured(Record, tag="measured"):
    """An orchestrator's quoted identity: its MRTD and the job in RTMR[3] (hex prefixes)."""

    template = "{run}: orchestrator MRTD {mrtd}..., job {job}..., the key broker of {broker}"
    run: str
    mrtd: str
    job: str
    broker: str


class Resumed(Record, tag="resumed"):
    """A run resumed from a sealed checkpoint: how it ended."""

    run: str
    error: str
    said: str

    def text(self) -> str:
        return f"{self.run}: resumed" if not self.error else f"{self.run}: resume refused: {self.error}: {self.said}"


Evidence = Union[Travel, Baseline, Acted, Logged, Journal, Rejoined, Recovered, Travelled, EpochSkipped, Control,
                 Searched, Probed, Carried, Tampered, RankStep, SearchedRing, Failed, Refusal, JobLog, Quoted, FileRead,
                 Opened, Released, SealTried, Measured, Resumed]


def load(records: object) -> list[Evidence]:
    """The JSON report's ``records`` back, every field checked."""
    return msgspec.convert(records, list[Evidence])
