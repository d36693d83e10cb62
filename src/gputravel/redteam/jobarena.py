"""Where the job rows (issue 28) run: cohorts of image-record holders (alice, bob, mallory; canary images
among their digits) launched for a tiny job whose workload is a file, the manifest every holder approves,
its one recipient's key, and one honest run that trained and released, which the rows that attack what a
finished job leaves share (:class:`JobArena`); a row (:class:`JobAttack`, made by :func:`job_row`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from msgspec import structs

from gputravel.attest import AttestationError
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.local import Cohort
from gputravel.cohort.trust import TrustOptions
from gputravel.crypto.pki import CA_FILE
from gputravel.data.records import RECORDS_FILE, common_schema
from gputravel.errors import GputravelError
from gputravel.files import RECORDS
from gputravel.manifest import JobManifest
from gputravel.orchestrator.audit import read_log
from gputravel.protocol.control import Joined
from gputravel.protocol.layout import layout_for
from gputravel.redteam.arena import ALICE, BOB, MALLORY
from gputravel.redteam.canary import Found, Needles, make_image_datasets, search
from gputravel.redteam.evidence import JobLog, Measured, Record, Refusal
from gputravel.release import raw_public
from gputravel.release.seal import ca_der
from gputravel.train.job import TrainConfig

JOB_HOLDERS = (ALICE, BOB, MALLORY)
RECIPIENT = "dana"  # the one recipient the manifest names: neither a holder nor the host
QUORUM = 2  # of the three holders
JOB_DATASET_BYTES = 1 << 20
JOB_BUFFER = 16 << 10
WORKLOAD = "digits"  # the workload file's name: the shipped image workload's text, brought as a user's file


def workload_text() -> str:
    """The workload file W the holders approve: the `image` workload's source, as a consortium would bring it."""
    return resources.files("gputravel.workloads").joinpath("image.py").read_text()


def edit_one_line(text: str) -> str:
    """W with one line changed: the inputs scaled by 1/254, not 1/255 (a change no reviewer would see)."""
    lines = text.splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if "/ 255.0" in line]
    if len(at) != 1:
        raise GputravelError("the image workload no longer has the one line the edited-workload row changes")
    lines[at[0]] = lines[at[0]].replace("/ 255.0", "/ 254.0")
    return "".join(lines)


@dataclass(frozen=True)
class JobAttack:
    name: str
    adversary: str  # "host", "holder" or "host+holder"
    tried: str
    stopped_by: str
    run: Callable[[JobArena], bool]  # whether the defence it names was seen to act
    needs_isolation: bool = False  # as the arena's rows (none of the job rows needs it)


def job_row(name: str, adversary: str, *, tried: str, stopped_by: str) -> Callable[[Callable[[JobArena], bool]],
                                                                                  JobAttack]:
    return lambda run: JobAttack(name, adversary, tried, stopped_by, run)


@dataclass(frozen=True)
class Honest:
    """The honest run every holder approved: trained, evaluated, released to the recipient."""

    run_dir: Path
    report: dict
    ca_der: bytes  # the cohort CA: whose certificates a release signature counts under
    measurement: bytes  # the orchestrator's MRTD, as the holders pinned it
    audit_log: Path
    broker_dir: Path  # the key broker's secret: a resume needs the same one


@dataclass
class JobArena:
    """The job rows' common ground: the holders' datasets, the approved job, what each row saw and read."""

    tmp: Path
    needles: dict[str, Needles] = field(init=False)
    holders: tuple[tuple[str, str], ...] = field(init=False)
    recipient: X25519PrivateKey = field(init=False, repr=False)
    job: TrainConfig = field(init=False)
    manifest: JobManifest = field(init=False)
    evidence: list[Record] = field(default_factory=list)
    read: list[Path] = field(default_factory=list)  # what the attacker read this row: searched for canaries
    opened: int = 0  # plaintext bytes of a model or checkpoint the attacker opened this row
    stage: str = ""
    _honest: Honest | GputravelError | None = None
    _closing: list[threading.Thread] = field(default_factory=list)
    _runs: int = 0

    def __post_init__(self) -> None:
        root = self.tmp / "job-data"
        self.needles = make_image_datasets(root, JOB_HOLDERS, JOB_DATASET_BYTES)
        self.holders = tuple((h, str(root / h)) for h in JOB_HOLDERS)
        schema = common_schema(self.holders).canonical_json()
        self.recipient = X25519PrivateKey.generate()
        self.job = TrainConfig(workload=WORKLOAD, workload_code=workload_text(), record_schema=schema, steps=4,
                               batch=8, buffer_bytes=JOB_BUFFER, threads=1, warmup_steps=1, eval_every=0,
                               checkpoint_every=2, sample_tokens=0)
        self.manifest = self.manifest_of(self.job)

    # ------------------------------------------------------------------ rows
    def begin(self) -> None:
        self.evidence, self.read, self.opened, self.stage = [], [], 0, ""

    def keep(self, *records: Record) -> None:
        self.evidence += [structs.replace(r, stage=self.stage) if self.stage else r for r in records]

    def found(self, adversary: str) -> Found:
        """The holders' canaries in what the attacker read (mallory's own are no leak to mallory)."""
        needles = [n for h, n in self.needles.items() if h != MALLORY or "holder" not in adversary]
        return search(self.read, needles)

    def control(self) -> Found:
        """The same search over the holders' own datasets: it finds their canaries."""
        return search([Path(p) / RECORDS_FILE for _, p in self.holders], self.needles.values())

    # ------------------------------------------------------------------ jobs and cohorts
    def manifest_of(self, job: TrainConfig, recipients: dict[str, bytes] | None = None) -> JobManifest:
        keys = recipients if recipients is not None else {RECIPIENT: raw_public(self.recipient)}
        return JobManifest.for_job(job, holders=JOB_HOLDERS, quorum=QUORUM, recipients=list(keys.items()))

    def _dir(self, name: str) -> Path:
        self._runs += 1
        path = self.tmp / f"job-{self._runs}-{name}"
        path.mkdir()
        return path

    def config(self, job: TrainConfig, manifest: JobManifest, where: Path, *, decline: tuple[str, ...] = (),
               **more: object) -> CohortConfig:
        specs = tuple(HolderSpec(n, p, RECORDS, sign_release=n not in decline) for n, p in self.holders)
        values: dict = {"broker_dir": str(where / "broker"), "output_dirs": (str(where / "run"),),
                        "audit_log": str(where / "audit.log"), **more}
        return CohortConfig(holders=specs, buffer_bytes=job.buffer_bytes, layout=layout_for(job.buffer_bytes),
                            schema=job.record_schema, job_json=job.canonical_json(), manifest_json=manifest.to_json(),
                            workdir=str(where), **values)

    def refused_at_join(self, job: TrainConfig, manifest: JobManifest) -> tuple[list[Refusal], JobLog]:
        """Launch an orchestrator for `job` (`manifest`) to holders that approved only the honest manifest:
        each holder's refusal (none: they joined), and its travel log. The host taps every holder link."""
        where = self._dir("refused")
        trust = TrustOptions(approved_jobs=(self.manifest.digest_hex(),))
        cohort = Cohort(self.config(job, manifest, where, trust=trust, tap=True))
        try:
            try:
                cohort.start()
                refusals = []
            except AttestationError as exc:
                first = next((h for h in JOB_HOLDERS if f"{h} did not join" in str(exc)), "")
                refusals = [Refusal(holder=first, claim=exc.claim, said=str(exc))]
                for h in JOB_HOLDERS:  # the others' answers to the same join: each its own refusal
                    if h != first:
                        refusals += self._answer(cohort, h)
            tap = cohort.dir / "tap.bin" if cohort.dir is not None else None
            self.read += [tap] if tap is not None and tap.exists() else []
        finally:
            self._close_later(cohort)
        log = self.journal(where / "audit.log")
        self.keep(*refusals, log)
        return refusals, log

    def _answer(self, cohort: Cohort, holder: str) -> list[Refusal]:
        try:
            cohort.client.from_holder(holder, Joined)
        except AttestationError as exc:
            return [Refusal(holder=holder, claim=exc.claim, said=str(exc))]
        return []

    def _close_later(self, cohort: Cohort) -> None:
        """A refused orchestrator waits out its join before it stops: close it aside while the rows go on."""
        thread = threading.Thread(target=cohort.close, name="redteam-job-close", daemon=True)
        thread.start()
        self._closing.append(thread)

    def close(self) -> None:
        for thread in self._closing:
            thread.join()
        self._closing = []

    def journal(self, path: Path) -> JobLog:
        entries = read_log(path, allow_truncated_tail=True) if path.exists() else []

        def who(event: str) -> tuple[str, ...]:
            return tuple(e.note.holder for e in entries if e.event.value == event and e.note is not None)

        travels = [e.chunk for e in entries if e.event.value == "travel" and e.chunk is not None]
        return JobLog(approved=who("approved"), travels=len(travels), nbytes=sum(c.nbytes for c in travels),
                      signed=who("signed"), released=any(e.event.value == "released" for e in entries))

    def train(self, name: str, *, decline: tuple[str, ...] = (), resume: Path | None = None,
              broker_dir: Path | None = None, **more: object) -> tuple[Path, dict, bytes, bytes]:
        """Run the approved job in a cohort of its own: (run dir, report, cohort CA DER, MRTD)."""
        where = self._dir(name)
        run = where / "run"
        more = {**more, **({"broker_dir": str(broker_dir)} if broker_dir is not None else {})}
        try:
            with Cohort(self.config(self.job, self.manifest, where, decline=decline, **more)) as cohort:
                assert cohort.dir is not None and cohort.trust is not None
                ca, mrtd = ca_der((cohort.dir / "pki" / ALICE / CA_FILE).read_bytes()), cohort.trust.pinned[0]
                broker = Path(str(more.get("broker_dir", where / "broker"))).relative_to(self.tmp)
                self.keep(Measured(run=name, mrtd=mrtd.hex()[:16], job=self.manifest.digest_hex()[:16],
                                   broker=str(broker)))
                report = cohort.train(self.job.canonical_json(), str(run), str(resume) if resume else "")
        finally:  # what travelled, if the job failed too
            self.keep(self.journal(where / "audit.log"))
        (run / "report.json").write_text(json.dumps(report, sort_keys=True))  # as a launcher keeps it
        return run, report, ca, mrtd

    @property
    def honest(self) -> Honest:
        """The honest run (made at first use): every holder approved, trained, 3 of 3 signed, released."""
        if self._honest is None:
            stage, self.stage = self.stage, "honest run"
            try:
                run, report, ca, mrtd = self.train("honest")
            except GputravelError as exc:  # each row that needs it fails with this, not with a run of its own
                self._honest = exc
                raise
            finally:
                self.stage = stage
            where = run.parent
            self._honest = Honest(run, report, ca, mrtd, where / "audit.log", where / "broker")
        if isinstance(self._honest, GputravelError):
            raise GputravelError(f"the honest run failed: {self._honest}")
        return self._honest

