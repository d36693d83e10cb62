"""A holder's privacy budget (issue 29): its signed ledger of approved jobs and their epsilon
survives restarts, refuses tampering, and a job past the holder's cap is refused saying by how
much, at approval and when its service starts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import tomli_w
import tomllib
from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.errors import BadInput
from gputravel.holder.ledger import LEDGER_FILE, PrivacyLedger, job_epsilon

KEY = ec.generate_private_key(ec.SECP384R1())
JOBS = ["a" * 96, "b" * 96, "c" * 96]


def _ledger(tmp_path: Path, epsilons=(1.0, 0.5, 0.25)) -> PrivacyLedger:
    ledger = PrivacyLedger.load(tmp_path / LEDGER_FILE, KEY.public_key())
    for job, eps in zip(JOBS, epsilons, strict=False):
        ledger = ledger.append(job, eps, 1e-5, KEY, now=1.0)
    return ledger


def test_the_ledger_survives_a_restart_and_records_a_job_once(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path)
    again = PrivacyLedger.load(tmp_path / LEDGER_FILE, KEY.public_key())
    assert again.entries == ledger.entries and again.head == ledger.head
    assert again.spent() == 1.75 and again.spent(but=JOBS[0]) == 0.75
    assert again.append(JOBS[1], 9.0, 1e-5, KEY, now=2.0) is again  # approved before: counted once
    assert (tmp_path / LEDGER_FILE).stat().st_mode & 0o077 == 0
    assert job_epsilon(0.0) == math.inf and job_epsilon(3.0) == 3.0


@pytest.mark.parametrize("tamper", ["edit", "drop", "swap", "foreign", "garbage"])
def test_a_tampered_ledger_refuses_everything(tmp_path: Path, tamper: str) -> None:
    _ledger(tmp_path)
    path = tmp_path / LEDGER_FILE
    lines = path.read_bytes().splitlines()
    if tamper == "edit":  # one hex digit of the first entry's body changed
        lines[0] = lines[0][:40] + (b"0" if lines[0][40:41] != b"0" else b"1") + lines[0][41:]
    elif tamper == "drop":
        del lines[1]
    elif tamper == "swap":
        lines[0], lines[1] = lines[1], lines[0]
    elif tamper == "foreign":  # a whole ledger of another key's
        other = ec.generate_private_key(ec.SECP384R1())
        (tmp_path / "other").mkdir()
        PrivacyLedger.load(tmp_path / "other" / LEDGER_FILE, other.public_key()).append("d" * 96, 0.1, 1e-5, other, 1.0)
        lines = (tmp_path / "other" / LEDGER_FILE).read_bytes().splitlines()
    else:
        lines.append(b"not a ledger entry")
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(BadInput, match=r"entry \d+ (does not verify|is out of its place).*ledger was altered"):
        PrivacyLedger.load(path, KEY.public_key())


def test_a_job_past_the_cap_is_refused_saying_by_how_much(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path, (1.0,))
    ledger.check("north", "e" * 96, 1.0, cap=2.0)  # 1 + 1: within
    with pytest.raises(BadInput, match=r"holder 'north': job eeeeeeeeeeeeeeee\.\.\. may spend epsilon 3 .*cap is 2 .*"
                                       r"before may spend 1: 2 over"):
        ledger.check("north", "e" * 96, 3.0, cap=2.0)
    with pytest.raises(BadInput, match=r"epsilon unbounded of its data.*unbounded: the job has no DP-SGD"):
        ledger.check("north", "e" * 96, math.inf, cap=2.0)
    ledger.check("north", JOBS[0], 1.0, cap=1.0)  # the job already counted is not counted twice


def test_the_cli_and_the_service_enforce_the_cap(tmp_path: Path) -> None:
    """A capped holder refuses a job without DP-SGD at `job approve`; a job approved by hand,
    outside the ledger, or a cap lowered below what the ledger holds, stops its service at start."""
    from test_cli_job import _holder_config, _name_parties, _refused

    from gputravel.manifest import JobManifest, Outputs, write_manifest
    from gputravel.service.budget import approve_within_budget, check_budget_at_start
    from gputravel.service.config import load_service
    from gputravel.train.job import TrainConfig

    job = tmp_path / "job.toml"
    write_manifest(job, JobManifest.for_job(TrainConfig(steps=3), holders=["alice"], quorum=1,
                                            outputs=Outputs(model="sealed")))
    confirm = _name_parties(job, tmp_path)
    cfg = _holder_config(tmp_path, policy={"orchestrator_measurements": ["ab" * 48], "epsilon_cap": 2.0})
    _refused("job", "approve", str(job), "--holder-config", str(cfg), "--yes", *confirm,
             says="may spend epsilon unbounded of its data; its cap is 2")
    assert not (tmp_path / "state" / LEDGER_FILE).exists()
    raw = tomllib.loads(cfg.read_text())
    raw["policy"]["approved_jobs"] = ["f" * 96]  # approved by hand, never counted
    cfg.write_text(tomli_w.dumps(raw))
    with pytest.raises(BadInput, match=r"approved job ffffffffffffffff\.\.\. is not in its privacy ledger"):
        check_budget_at_start(load_service(cfg))
    uncapped = _holder_config(tmp_path)  # no cap: the approval is counted, unbounded
    from gputravel.manifest import load_manifest

    m = load_manifest(job)
    assert approve_within_budget(load_service(uncapped), m, record=True) == math.inf
    raw["policy"]["approved_jobs"] = [m.digest_hex()]
    cfg.write_text(tomli_w.dumps(raw))
    with pytest.raises(BadInput, match="may spend epsilon inf, past its cap 2"):
        check_budget_at_start(load_service(cfg))


def test_a_demo_holder_capped_below_the_jobs_epsilon_refuses_before_anything_travels(processes, tmp_path: Path,
                                                                                    searchable_tmp) -> None:
    """Issue 29, as shown: `gputravel demo --workload tabular --dp-epsilon 3 --epsilon-cap holder-2=2`
    is refused by holder-2's budget before any service starts, saying by how much."""
    from gputravel.data.demo_records import demo_holders
    from gputravel.jobs.training import TrainingJobConfig, run_training_job
    from gputravel.train.job import TrainConfig

    holders = demo_holders("tabular", 3, tmp_path / "data")
    train = TrainConfig(workload="tabular", dp_epsilon=3.0, steps=5, batch=32, buffer_bytes=1 << 20, threads=1)
    with pytest.raises(BadInput, match=r"holder 'holder-2': job .* may spend epsilon 3 of its data; its cap is 2 .*1 over"):
        run_training_job(TrainingJobConfig(train=train, holders=holders, run_dir=str(tmp_path / "run"),
                                           caps=(("holder-2", 2.0),)))
    with pytest.raises(BadInput, match="--epsilon-cap nobody: not a holder"):
        TrainingJobConfig(train=train, holders=holders, run_dir=str(tmp_path / "run"), caps=(("nobody", 2.0),))


def test_a_capped_holder_approved_for_by_the_demo_starts_and_metrics_count_as_unbounded(tmp_path: Path,
                                                                                       searchable_tmp) -> None:
    """The third review's demo with --epsilon-cap holder-1=3 never ran: init had approved the job
    alone, which the ledger never counted. And a DP job that writes per-step losses is not covered
    by its epsilon: a capped holder counts it as unbounded."""
    import os

    from gputravel.data.demo_records import demo_holders
    from gputravel.manifest import Outputs
    from gputravel.service.budget import check_budget_at_start
    from gputravel.service.config import load_service
    from gputravel.service.init import init_cohort, write_service
    from gputravel.service.job import make_identity, published_parties, set_job
    from gputravel.manifest import JobManifest

    os.chmod(tmp_path, 0o711)
    holders = list(demo_holders("tabular", 2, tmp_path / "data"))
    d = init_cohort(tmp_path / "D", holders, job={"workload": "tabular", "buffer_bytes": 1 << 20})[0].parent
    for party in ("holder-holder-1", "holder-holder-2", "broker"):
        make_identity(d / f"{party}.toml")
    job = load_service(d / "orchestrator.toml").job.train_config().replace(dp_epsilon=2.0)
    certs, key = published_parties(d, ["holder-1", "holder-2"])

    def manifest(metrics: bool) -> JobManifest:
        return JobManifest.for_job(job, holders=["holder-1", "holder-2"], quorum=1, certificates=certs,
                                   broker_key=key, outputs=Outputs(model="sealed", metrics=metrics))

    path = d / "holder-holder-1.toml"
    capped = load_service(path)
    write_service(path, capped.model_copy(update={"policy": capped.policy.model_copy(update={"epsilon_cap": 3.0})}))
    with pytest.raises(BadInput, match=r"unbounded: the job writes metrics \(outputs\.metrics\)"):
        set_job(d, manifest(metrics=True), approve=["holder-1"])
    quiet = manifest(metrics=False)
    set_job(d, quiet, approve=["holder-1"])
    holder = load_service(path)
    assert holder.policy.approved_jobs == [quiet.digest_hex()]  # the job init approved is no longer
    check_budget_at_start(holder)  # within its cap, counted: the service starts


def test_job_approve_says_why_a_job_counts_as_unbounded() -> None:
    from types import SimpleNamespace

    from gputravel.service.budget import METRICS_WHY, unbounded_why

    def m(dp: float, metrics: bool) -> SimpleNamespace:
        return SimpleNamespace(job=SimpleNamespace(dp_epsilon=dp), outputs=SimpleNamespace(metrics=metrics))

    assert unbounded_why(m(0.0, True)) == unbounded_why(m(0.0, False)) == "no DP-SGD"
    assert unbounded_why(m(3.0, True)) == METRICS_WHY  # it said "no DP-SGD" for a DP job writing metrics
