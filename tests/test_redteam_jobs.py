"""The red team's job rows (issue 28): what leaves the orchestrator is what every holder approved.

`gputravel redteam` runs them after the arena's rows, on cohorts of their own whose holders hold image
records with canary images (redteam/jobs.py). One run of the eight rows here (about 35 s); each test
checks one row's evidence, as typed records: the defence it names was seen to act, the attacker got
0 bytes of any holder's data, and the control (the same search or the same call, where it must
succeed) did succeed."""

from __future__ import annotations

import difflib

import pytest

from gputravel.manifest import JobManifest
from gputravel.redteam.evidence import (Control, FileRead, JobLog, Measured, Opened, Quoted, Refusal, Released,
                                        Resumed, SealTried, load)
from gputravel.redteam.jobarena import JOB_HOLDERS, QUORUM, edit_one_line, workload_text
from gputravel.redteam.jobs import JOB_ATTACKS
from gputravel.redteam.rows import ATTACKS
from gputravel.train.job import TrainConfig
from test_redteam import POSITIVE, Check, has, run_redteam_cli  # tests/test_redteam.py: the CLI run, record checks

NAMES = ("edited-workload", "changed-job", "replayed-approval", "host-reads-run-dir", "outsider-opens-release",
         "release-short-of-quorum", "signature-over-other-model", "foreign-resume", "operator-made-keys")


def refused_by_all(stage: str) -> tuple[Check, ...]:
    """Every holder refused the launched job [job], naming its digest; its travel log: no approval, no travel."""
    return (*(has(Refusal, stage=stage, holder=h, claim="job", said=lambda s: "approved no such job" in s)
              for h in JOB_HOLDERS), has(JobLog, stage=stage, approved=(), travels=0, nbytes=0))


def sealed(name: str) -> Check:
    return has(FileRead, name=name, sealed=True, nbytes=POSITIVE, said=lambda s: "cannot load" in s)


def refused_release(stage: str) -> Check:
    return has(SealTried, stage=stage, error="ReleaseRefused", nbytes=0)


EXPECTED: dict[str, tuple[str, tuple[Check, ...]]] = {
    "edited-workload": ("host", refused_by_all("one line changed")),
    "changed-job": ("host", (*refused_by_all("another recipient"), *refused_by_all("another lr"))),
    "replayed-approval": ("host", (has(Quoted, stage="A named over B", claim="job",
                                       said=lambda s: "does not match the job the orchestrator names" in s),
                                   has(Quoted, stage="B named over B", claim="job"),
                                   has(Quoted, stage="A then B, A named", claim="job"),
                                   has(Quoted, stage="A then B, B named", claim="job"),
                                   has(Quoted, stage="control", claim=""))),
    "host-reads-run-dir": ("host", (sealed("checkpoint.pt"), sealed("model.sealed"), sealed("model.release"),
                                    has(FileRead, name="metrics.csv"), has(FileRead, name="audit.log"),
                                    has(Control, nbytes=POSITIVE),
                                    has(JobLog, stage="honest run", released=True, travels=POSITIVE))),
    "outsider-opens-release": ("host+holder", (has(Opened, who="mallory", what="model.release", error="NotARecipient",
                                                   nbytes=0),
                                               has(Opened, who="host", what="model.release", error="NotARecipient",
                                                   nbytes=0),
                                               has(Opened, who="mallory", what=lambda w: "HPKE" in w, error=bool),
                                               has(Opened, who="host", what=lambda w: "HPKE" in w, error=bool),
                                               has(Opened, stage="control", who="dana", error="", nbytes=POSITIVE))),
    "release-short-of-quorum": ("host", (has(Released, stage="run", signed=("alice",), released_to=(),
                                             files=lambda f: "model.sealed" in f and "model.release" not in f),
                                         has(JobLog, stage="run", signed=("alice",), released=False),
                                         has(SealTried, stage="library", error="ReleaseRefused", signatures=QUORUM - 1,
                                             said=lambda s: f"{QUORUM - 1} of {QUORUM}" in s),
                                         has(SealTried, stage="control", error="", nbytes=POSITIVE))),
    "signature-over-other-model": ("host", (refused_release("another model"), refused_release("another recipient"),
                                            has(SealTried, stage="relabelled", error="ReleaseRefused",
                                                said=lambda s: "does not verify under its certificate" in s),
                                            has(SealTried, stage="control", error="", nbytes=POSITIVE))),
    "foreign-resume": ("host", (has(Resumed, run="foreign", error="SealedError",
                                    said=lambda s: "another orchestrator measurement or job" in s),
                                has(Measured, run="foreign"), has(Measured, run="honest"),
                                # approvals wait for the log's next entry, which never came
                                has(JobLog, approved=lambda h: set(h) <= set(JOB_HOLDERS), travels=0))),
    "operator-made-keys": ("host", (has(Released, stage="orchestrator's count", signed=(), released_to=(),
                                        files=lambda f: "model.release" not in f),
                                    has(Opened, stage="recipient's check", who="the recipient", error="BadInput",
                                        nbytes=0, said=lambda s: "only 0 of the release's signatures" in s),
                                    has(Released, stage="control", signed=("alice", "bob"), released_to=("dana",)),
                                    has(Opened, stage="control", error="", nbytes=POSITIVE))),
}

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[int, str, dict]:
    only = [arg for name in NAMES for arg in ("--only", name)]
    return run_redteam_cli(tmp_path_factory.mktemp("redteam-jobs") / "redteam.json", *only)


def _row(report: dict, name: str) -> dict:
    rows = {r["name"]: r for r in report["attacks"]}
    assert name in rows, f"attack {name} did not run"
    return rows[name]


# ----------------------------------------------------------------------------- without processes
def test_the_job_rows_are_the_issues_eight_and_more_and_every_one_has_an_expectation() -> None:
    assert tuple(a.name for a in JOB_ATTACKS) == NAMES and set(EXPECTED) == set(NAMES)
    assert not set(NAMES) & {a.name for a in ATTACKS}  # a phase of its own: the arena's rows are unchanged


def test_the_edited_workload_is_one_line_changed_and_another_job_digest() -> None:
    text = workload_text()
    edited = edit_one_line(text)
    changed = [d for d in difflib.ndiff(text.splitlines(), edited.splitlines()) if d[:1] in "+-"]
    assert len(changed) == 2  # one line out, one in

    def digest(code: str) -> bytes:
        job = TrainConfig(workload="digits", workload_code=code, steps=4)
        return JobManifest.for_job(job.replace(record_schema=_schema()), holders=JOB_HOLDERS, quorum=QUORUM,
                                   recipients=[("dana", bytes(range(32)).hex())]).digest()

    assert digest(text) != digest(edited)


def test_replayed_approval_fails_when_holders_skip_the_job_check(tmp_path, monkeypatch) -> None:
    """The row checks the system, not itself: with the policy's job check off, the replay is accepted."""
    from gputravel.attest import Policy
    from gputravel.redteam.jobarena import JobArena
    from gputravel.redteam.jobs import replayed_approval

    arena = JobArena(tmp_path)
    assert replayed_approval.run(arena)
    arena.begin()
    monkeypatch.setattr(Policy, "check_job", lambda self, rtmr, named: None)
    assert not replayed_approval.run(arena)


def test_a_model_an_outsider_opened_counts_as_plaintext_and_fails_the_row(tmp_path) -> None:
    from gputravel.redteam.jobarena import JobAttack
    from gputravel.redteam.jobs import run_jobs
    from gputravel.redteam.run import judge_job

    def opens(a) -> bool:
        a.opened += 1000
        return True

    attack = JobAttack("opens", "host", tried="opened", stopped_by="nothing", run=opens)
    (verdict,) = run_jobs(tmp_path, [attack])
    result = judge_job(attack, verdict)
    assert result.plaintext_bytes_obtained == 1000 and result.outcome == "FAILED"


def _schema() -> str:
    from gputravel.data.records import Field, RecordSchema

    return RecordSchema((Field("image", "uint8", (1, 8, 8)), Field("label", "int64"))).canonical_json()


# ----------------------------------------------------------------------------- the live rows
@pytest.mark.parametrize("name", NAMES)
def test_job_row_is_defeated(processes, run, name: str) -> None:
    _, output, report = run
    row = _row(report, name)
    adversary, must_show = EXPECTED[name]
    assert row["adversary"] == adversary
    assert row["plaintext_bytes_obtained"] == 0, f"{name}: the attacker obtained plaintext"
    records, evidence = load(row["records"]), "\n".join(row["evidence"])
    for check in must_show:
        assert check(records), f"{name}: expected {check.__qualname__} in:\n{evidence}"
    assert row["outcome"] == "defeated", f"{name}:\n{evidence}\n{output}"


def test_what_the_host_read_was_searched_and_the_search_finds_the_canaries_in_the_datasets(processes, run) -> None:
    """host-reads-run-dir: every file of the run directory and the travel log searched, 0 bytes of the
    canary or digit images found; the same search over the holders' datasets finds them (control)."""
    _, _, report = run
    row = _row(report, "host-reads-run-dir")
    records = load(row["records"])
    read = sum(r.nbytes for r in records if isinstance(r, FileRead))
    assert row["scanned_bytes"] == read > 0 and row["marker_bytes"] == row["sample_bytes"] == 0
    assert next(r for r in records if isinstance(r, Control)).nbytes > 0
    assert not any(isinstance(r, FileRead) and r.name == "sample.txt" for r in records)


def test_the_refused_jobs_tapped_links_were_searched(processes, run) -> None:
    """The host taps every holder link of a refused orchestrator: TLS handshakes only, no canary."""
    _, _, report = run
    for name in ("edited-workload", "changed-job"):
        row = _row(report, name)
        assert row["scanned_bytes"] > 0 and row["plaintext_bytes_obtained"] == 0


def test_the_foreign_orchestrator_differs_in_its_measurement_only(processes, run) -> None:
    _, _, report = run
    measured = {r.run: r for r in load(_row(report, "foreign-resume")["records"]) if isinstance(r, Measured)}
    honest, foreign = measured["honest"], measured["foreign"]
    assert foreign.mrtd != honest.mrtd and foreign.job == honest.job and foreign.broker == honest.broker


def test_cli_runs_the_job_rows_alone_and_exits_zero(processes, run) -> None:
    code, output, report = run
    assert code == 0, output
    assert "every attack defeated, 0 bytes of plaintext obtained" in output
    assert [r["name"] for r in report["attacks"]] == list(NAMES)  # --only a job row: no arena cohort
    assert report["defeated"] == len(NAMES) and report["failed"] == 0
