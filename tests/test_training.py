"""Training on travelled data, end to end through real cohort processes.

The central claim (paper goal G2): travelling does not change what the model learns. With the
same seed, order and thread count, the travelling loader (batches read from the GPU's
protected memory after each travel) and the local loader (the same tokens read from disk)
give bit-identical losses.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gputravel.cohort import isolation
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.local import Cohort
from gputravel.data.holder_tokens import load_tokens
from gputravel.data.shards import write_shard
from gputravel.errors import BadInput, HolderLost, RemoteError
from gputravel.jobs.training import TrainingJobConfig, layout_for, resolve, run_training_job
from gputravel.orchestrator.audit import verify_log
from gputravel.protocol.layout import Layout
from gputravel.testing.cohort import InProcessCohort
from gputravel.train.loader import LocalSource
from gputravel.train.loop import TrainConfig, make_report, train

pytestmark = pytest.mark.integration

TEXTS = {
    "north": "Now is the winter of our discontent made glorious summer by this sun of York. " * 60,
    "south": "If music be the food of love, play on; give me excess of it, that, surfeiting. " * 45,
    "west": "When shall we three meet again in thunder, lightning, or in rain? " * 70,
}
TINY = TrainConfig(steps=48, batch=4, seq_len=32, buffer_bytes=4096, n_layer=2, n_head=2, n_embd=32,
                   threads=1, sample_tokens=20, warmup_steps=5)


def holders(tmp: Path) -> tuple[tuple[str, str], ...]:
    out = []
    for name, text in TEXTS.items():
        d = tmp / name
        d.mkdir()
        (d / "book.txt").write_text(text)
        out.append((name, str(d)))
    return tuple(out)


@pytest.fixture(scope="module")
def both_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("g2")
    hs = holders(tmp)
    travelling = run_training_job(TrainingJobConfig(train=TINY, holders=hs, run_dir=str(tmp / "travelling")))
    local = run_training_job(TrainingJobConfig(train=TINY.replace(loader="local"), holders=hs, run_dir=str(tmp / "local")))
    return tmp, travelling, local


def test_travelling_and_local_losses_are_bit_identical(processes, both_runs):
    _, travelling, local = both_runs
    assert len(travelling["losses"]) == TINY.steps
    assert travelling["losses"] == local["losses"]  # exact float equality, step by step
    # ... and the travelling run really travelled, to every holder, several times.
    visited = [t["holder"] for t in travelling["travels"]]
    assert set(visited) == set(TEXTS) and len(visited) >= 4
    assert all("steps_ms" in t for t in travelling["travels"])
    assert not any("steps_ms" in t for t in local["travels"])


def test_training_learns_and_writes_the_run_directory(processes, both_runs):
    tmp, travelling, _ = both_runs
    assert travelling["loss_after"] < travelling["loss_before"]
    assert 0 <= travelling["stall_share"] < 1
    run_dir = tmp / "travelling"
    for name in ("report.json", "metrics.csv", "loss.png", "checkpoint.pt", "sample.txt"):
        assert (run_dir / name).stat().st_size > 0, name
    assert json.loads((run_dir / "report.json").read_text())["losses"] == travelling["losses"]
    assert len((run_dir / "metrics.csv").read_text().strip().splitlines()) == TINY.steps + 1
    iso = travelling["isolation"]  # the report says what kept the emulated CVMs apart
    assert iso["on"] == (not isolation.unavailable()) and (iso["on"] or iso["reason"])
    if iso["on"]:
        assert all(p["dumpable"] is False for p in iso["parties"].values())
        assert len({p["uid"] for p in iso["parties"].values()}) == len(iso["parties"])


def test_a_holder_with_another_tokenizer_is_refused(tmp_path):
    """The orchestrator refuses the hello of a holder whose tokens another tokenizer made: the
    real orchestrator and holders, on the in-process cohort (the check is the join's)."""
    good, odd = tmp_path / "good", tmp_path / "odd"
    for d, name in ((good, "bytes"), (odd, "gpt2")):
        d.mkdir()
        write_shard(d / "data_000000.bin", np.arange(5000) % 250)
        (d / "tokenizer.json").write_text(json.dumps({"name": name, "vocab_size": 257 if name == "bytes" else 50257,
                                                      "eot": 256 if name == "bytes" else 50256}))
    cohort = InProcessCohort({"good": good, "odd": odd}, formats={"good": "tokens", "odd": "tokens"},
                             buffer_bytes=1 << 20, layout=Layout(), workdir=tmp_path, tokenizer="bytes")
    with pytest.raises(BadInput, match=r"odd.*gpt2.*bytes"):
        with cohort:
            pass
    assert "odd" not in cohort.orchestrator.holders


def test_bad_job_input_is_refused(tmp_path):
    with pytest.raises(BadInput, match="not found"):
        TrainingJobConfig(train=TINY, holders=(("ghost", str(tmp_path / "nope")),), run_dir=str(tmp_path))
    with pytest.raises(BadInput, match="--steps"):
        TrainConfig(steps=0)
    with pytest.raises(BadInput, match="--loader"):
        TrainConfig(loader="carrier-pigeon")


def test_a_killed_orchestrator_resumes_from_its_checkpoint_exactly(processes, both_runs, tmp_path, kill_orchestrators):
    _, uninterrupted, _ = both_runs
    job = TrainingJobConfig(train=TINY.replace(checkpoint_every=2), holders=holders(tmp_path), run_dir=str(tmp_path / "run"))

    def crash_early(event) -> None:
        # Early, so the orchestrator (which does not wait for us) cannot finish all 48 steps
        # before the kill lands; wherever it is by then, it has checkpointed recently.
        if event.step == 3:
            kill_orchestrators()

    with pytest.raises(RemoteError):
        run_training_job(job, on_step=crash_early)
    resumed = run_training_job(replace(job, resume=True))
    # Model, optimizer and per-holder cursors came back: every loss is the one an uninterrupted
    # run had, so each window was trained on exactly once and none was skipped.
    assert resumed["losses"] == uninterrupted["losses"]
    steps = [int(line.split(",")[0]) for line in (tmp_path / "run" / "metrics.csv").read_text().splitlines()[1:]]
    assert steps == list(range(TINY.steps))


def test_a_run_asked_to_stop_ends_at_a_step_checkpointed_there_and_resumes_exactly(processes, both_runs, tmp_path):
    """A service's SIGTERM asks its orchestrator to stop (orchestrator/process.py): training
    ends after the step it is on, the checkpoint is of that step, and a resume continues from
    it with the losses of an uninterrupted run."""
    _, _, uninterrupted = both_runs
    job = resolve(TrainingJobConfig(train=TINY.replace(loader="local"), holders=holders(tmp_path), run_dir=str(tmp_path)))
    tokens = {n: load_tokens(p).tokens for n, p in job.holders}
    asked = []
    first = train(job.train, LocalSource(tokens), run_dir=tmp_path / "run", on_step=lambda e: asked.append(e.step),
                  should_stop=lambda: len(asked) >= 7)
    assert first.stopped and len(first.losses) == 7
    assert make_report(job.train, first)["stopped"] is True
    resumed = train(job.train, LocalSource(tokens), run_dir=tmp_path / "run", resume_from=tmp_path / "run" / "checkpoint.pt")
    assert not resumed.stopped and resumed.losses == uninterrupted["losses"]


def test_resuming_with_another_job_or_without_a_checkpoint_is_refused(tmp_path):
    job = TrainingJobConfig(train=TINY.replace(loader="local", steps=10), holders=holders(tmp_path), run_dir=str(tmp_path / "r"))
    with pytest.raises(BadInput, match="nothing to resume"):
        run_training_job(replace(job, resume=True))
    run_training_job(job)
    with pytest.raises(BadInput, match=r"another job.*lr"):
        run_training_job(replace(job, train=job.train.replace(lr=0.5), resume=True))


def test_a_fresh_run_into_a_used_run_directory_starts_its_metrics_over(tmp_path):
    job = TrainingJobConfig(train=TINY.replace(loader="local", steps=6), holders=holders(tmp_path), run_dir=str(tmp_path / "r"))
    run_training_job(job)
    run_training_job(job)  # not resumed: the same steps again, logged once
    steps = [int(line.split(",")[0]) for line in (tmp_path / "r" / "metrics.csv").read_text().splitlines()[1:]]
    assert steps == list(range(6))


class _LosesHolderOnce:
    """The local reference for a holder that dies in its first travel: that visit fails."""

    def __init__(self, inner, holder: str) -> None:
        self.inner, self.holder, self.failed, self.last_report = inner, holder, False, None

    def sizes(self):
        return self.inner.sizes()

    def fetch(self, visit):
        if visit.holder == self.holder and not self.failed:
            self.failed = True
            raise HolderLost(visit.holder, "reference failure")
        return self.inner.fetch(visit)


def test_a_holder_killed_mid_copy_is_dropped_and_its_partial_chunk_never_trained_on(processes, tmp_path):
    job = resolve(TrainingJobConfig(train=TINY, holders=holders(tmp_path), run_dir=str(tmp_path / "run")))
    specs = tuple(HolderSpec(n, p, "tokens", die_mid_copy_on_travel=1 if n == "west" else 0) for n, p in job.holders)
    cfg = CohortConfig(holders=specs, buffer_bytes=TINY.buffer_bytes, layout=layout_for(TINY.buffer_bytes),
                       tokenizer=job.train.tokenizer)
    with Cohort(cfg) as cohort:
        report = cohort.train(json.dumps(job.train.to_dict()))
        assert cohort.children["west"].proc.wait(timeout=10) == 70  # it really died mid-copy
        # The orchestrator took the GPU back and re-keyed, and training went on travelling to the
        # others (the report below); the job done, its log is closed and no travel follows.
        with pytest.raises(BadInput, match="job is done and its travel log closed"):
            cohort.travel("north", 0)
        log = verify_log(cohort.audit_log_path, cohort.orchestrator_certificate())
        assert log.closed and {e.holder for e in log.entries if e.event == "aborted"} == {"west"}
    assert len(report["losses"]) == TINY.steps
    assert len(report["holders_lost"]) == 1 and "west" in report["holders_lost"][0]
    assert "west" not in {t["holder"] for t in report["travels"]}
    # Bit-identical to a reference where west's first visit simply fails: no byte of the half
    # chunk west left in the GPU's memory reached training.
    tokens = {n: load_tokens(p).tokens for n, p in job.holders}
    ref = train(job.train, _LosesHolderOnce(LocalSource(tokens), "west"))
    assert report["losses"] == ref.losses


def test_the_orchestrator_runs_only_the_job_it_was_measured_with(processes, tmp_path):
    """The job is part of the orchestrator's measurement, which the holders pin: a Train for
    another job (another seed, here) is refused, before any step."""
    job = resolve(TrainingJobConfig(train=TINY, holders=holders(tmp_path)[:1], run_dir=str(tmp_path / "run")))
    cfg = CohortConfig(holders=tuple(HolderSpec(n, p, "tokens") for n, p in job.holders), buffer_bytes=TINY.buffer_bytes,
                       layout=layout_for(TINY.buffer_bytes), tokenizer=job.train.tokenizer,
                       job_json=json.dumps(job.train.to_dict()))
    with Cohort(cfg) as cohort:
        with pytest.raises(BadInput, match="measured with"):
            cohort.train(job.train.replace(seed=job.train.seed + 1).canonical_json())


def test_every_travel_is_in_the_orchestrators_signed_log(processes, both_runs):
    tmp, travelling, _ = both_runs
    run_dir = tmp / "travelling"
    cert = (run_dir / "orchestrator.pem").read_bytes()
    summary = verify_log(run_dir / "audit.log", cert)
    travels = travelling["travels"]
    # The job done, the orchestrator signed the closing entry: the demo's log is closed. Beside the
    # travels it notes each holder's approval of the job (the demo runs under a manifest, issue 28).
    assert summary.closed and summary.count == len(travels) + len(TEXTS) + 1 and len(summary.entries) == len(travels)
    assert [(e.holder, e.chunk.dataset_offset // 2) for e in summary.entries] == \
        [(t["holder"], t["token_offset"]) for t in travels]
    assert all(e.event == "travel" and e.epoch_after == e.epoch_before + 1 for e in summary.entries)
    mine = verify_log(run_dir / "audit.log", cert, holder="south")
    assert mine.entries and {e.holder for e in mine.entries} == {"south"}
