"""Several GPUs training as the ranks of one data-parallel job (issue 14), end to end through
real cohort processes: one cohort stack per GPU (its host route, device, TDX module and
orchestrator rank), each travelling to its own share of the holders, the ranks' gradients
summed over the encrypted ring between their CVMs.

G2 carries over: with the same seed, GPU count and thread count, the travelling ranks and the
local ranks (the same shares read from disk) give bit-identical losses.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from gputravel.cohort.client import RankPlace
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.gpus import GpuCohorts
from gputravel.ddp.launch import free_port
from gputravel.errors import BadInput, GputravelError, PeerAttestationError
from gputravel.jobs.training import (
    TrainingJobConfig,
    default_holders,
    layout_for,
    resolve,
    run_training_job,
    shares_of,
)
from gputravel.net import netns_available
from gputravel.orchestrator.audit import verify_log
from gputravel.data.holder_tokens import load_tokens
from gputravel.train.loop import TrainConfig
from gputravel.train.schedule import LoaderState, Scheduler

pytestmark = pytest.mark.integration

TINY = TrainConfig(steps=16, batch=4, seq_len=32, buffer_bytes=4096, n_layer=1, n_head=2, n_embd=32,
                   threads=1, sample_tokens=0, warmup_steps=4)
# The module's shared job: TINY under the proportional schedule, a window a visit (16 visits a
# GPU), so that one travelling run and one local run serve G2, the signed logs and the schedule.
SHARED = TINY.replace(schedule="proportional", batch=16, seq_len=64)


def holders(tmp: Path) -> tuple[tuple[str, str], ...]:
    """The shipped plays dealt to four holders: two GPUs get two each."""
    return default_holders(4, tmp)


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpus")
    os.chmod(tmp, 0o755)  # the ranks' CVMs run under uids of their own when the suite is root
    hs = holders(tmp)
    travelling = run_training_job(TrainingJobConfig(train=SHARED, holders=hs, run_dir=str(tmp / "travelling"), gpus=2))
    local = run_training_job(TrainingJobConfig(train=SHARED.replace(loader="local"), holders=hs,
                                               run_dir=str(tmp / "local"), gpus=2))
    return tmp, hs, travelling, local


def test_two_travelling_gpus_and_two_local_ranks_give_bit_identical_losses(processes, two_gpus):
    _, _, travelling, local = two_gpus
    assert len(travelling["losses"]) == SHARED.steps
    assert travelling["losses"] == local["losses"]
    assert travelling["gpus"] == local["gpus"] == 2
    assert travelling["shares"] == local["shares"]


def test_g2_holds_within_gradient_compression(processes, two_gpus, tmp_path):
    """Issue 31: with the job's ddp_compress, travelling and local ranks still give bit-identical
    losses, and not the uncompressed ones (the ring summed fp16, so the setting took effect)."""
    _, hs, uncompressed, _ = two_gpus
    os.chmod(tmp_path, 0o755)
    cfg = SHARED.replace(ddp_compress="fp16")
    travelling = run_training_job(TrainingJobConfig(train=cfg, holders=hs, run_dir=str(tmp_path / "t"), gpus=2))
    local = run_training_job(TrainingJobConfig(train=cfg.replace(loader="local"), holders=hs,
                                               run_dir=str(tmp_path / "l"), gpus=2))
    assert len(travelling["losses"]) == SHARED.steps
    assert travelling["losses"] == local["losses"]
    assert travelling["losses"] != uncompressed["losses"]


def test_each_gpu_travels_only_to_its_own_holders_and_signs_its_own_log(processes, two_gpus):
    tmp, _, travelling, _ = two_gpus
    run_dir = tmp / "travelling"
    shares = [set(s) for s in travelling["shares"]]
    assert shares[0].isdisjoint(shares[1]) and len(shares[0] | shares[1]) == 4
    for rank in travelling["ranks"]:
        k = rank["gpu"]
        assert rank["travel_count"] > 0
        cert = (run_dir / f"gpu-{k}-orchestrator.pem").read_bytes()
        summary = verify_log(run_dir / rank["audit_log"], cert)
        assert summary.closed and len(summary.entries) == rank["travel_count"]  # then its closing entry
        assert summary.gpu == f"GPU-EMU-{k}"  # named inside the signed entries, not by the file
        assert {e.holder for e in summary.entries} <= shares[k]  # this GPU went to its share only
    # Rank 0 alone writes the run directory; its report is its own travels.
    assert {t["holder"] for t in travelling["travels"]} <= shares[0]
    assert (run_dir / "checkpoint.pt").is_file() and (run_dir / "report.json").is_file()


def _planned(cfg: TrainConfig, paths: dict[str, str], share: list[str], policy: str, count: int) -> list[tuple]:
    """The first `count` visits one GPU's scheduler plans over `share`, as (holder, byte offset)."""
    sizes = {n: len(load_tokens(paths[n], cfg.tokenizer).tokens) for n in share}
    scheduler = Scheduler(sizes, cfg.buffer_bytes // 2, cfg.batch * cfg.seq_len, policy)
    state, out = LoaderState(), []
    for _ in range(count):
        visit, after = scheduler.next_visit(state)
        state = scheduler.consumed(after, visit)
        out.append((visit.holder, visit.token_offset * 2))
    return out


def test_the_proportional_schedule_carries_over_to_each_gpu(processes, two_gpus):
    """Each rank schedules its own share as one GPU would: with `proportional`, each GPU's
    signed log shows the single-GPU scheduler's visits over its share (which differ from round
    robin's); the first test shows the travelling ranks train to the local ranks' losses."""
    tmp, hs, travelling, _ = two_gpus
    paths, differs = dict(hs), False
    for rank in travelling["ranks"]:
        share = travelling["shares"][rank["gpu"]]
        cert = (tmp / "travelling" / f"gpu-{rank['gpu']}-orchestrator.pem").read_bytes()
        summary = verify_log(tmp / "travelling" / rank["audit_log"], cert)
        got = [(e.holder, e.chunk.dataset_offset) for e in summary.entries]
        assert len(got) >= SHARED.steps  # a window a visit
        assert got == _planned(SHARED, paths, share, "proportional", len(got))
        differs |= got != _planned(SHARED, paths, share, "round_robin", len(got))
    assert differs  # the shares' sizes make the two policies visit in different orders


def test_the_job_refuses_more_gpus_than_holders(tmp_path):
    with pytest.raises(BadInput, match="--gpus"):
        TrainingJobConfig(train=TINY, holders=holders(tmp_path)[:1], run_dir=str(tmp_path / "r"), gpus=2)


# The killed rank's job: TINY, longer. Its ranks do not wait for the test, which sees their steps
# late (metrics.csv, polled): a kill at step 3 of 16 once landed after the job had ended.
KILLED = TINY.replace(steps=64, checkpoint_every=2)


def test_a_killed_rank_stops_every_rank_and_the_job_resumes_losing_nothing(processes, tmp_path, kill_orchestrators):
    os.chmod(tmp_path, 0o755)
    hs = holders(tmp_path)
    job = TrainingJobConfig(train=KILLED, holders=hs, run_dir=str(tmp_path / "run"), gpus=2)
    killed: list[int] = []

    def crash_early(event) -> None:
        if event.step == 3 and not killed:  # a checkpoint behind it, some 60 steps still ahead
            killed.append(kill_orchestrators(limit=1))  # one rank

    with pytest.raises(GputravelError):
        run_training_job(job, on_step=crash_early)
    assert killed == [1]
    resumed = run_training_job(replace(job, resume=True))
    # Model, optimizer and every rank's cursors came back: the losses are the uninterrupted ones,
    # which two local ranks give (G2: the first test above).
    uninterrupted = run_training_job(replace(job, train=KILLED.replace(loader="local"), run_dir=str(tmp_path / "l")))
    assert len(resumed["losses"]) == KILLED.steps
    assert resumed["losses"] == uninterrupted["losses"]


def _base(job: TrainingJobConfig, dies: str = "") -> CohortConfig:
    """The cohort of `job`'s holders; `dies` is a holder that exits half-way through its first copy."""
    specs = tuple(HolderSpec(n, p, "tokens", die_mid_copy_on_travel=1 if n == dies else 0) for n, p in job.holders)
    return CohortConfig(holders=specs, buffer_bytes=job.train.buffer_bytes, layout=layout_for(job.train.buffer_bytes),
                        tokenizer=job.train.tokenizer)


def _train_every_rank(gpus: GpuCohorts, job: TrainingJobConfig, *, configs: list[TrainConfig] | None = None,
                      shares=None) -> tuple[list, list[BaseException]]:
    """Every GPU's orchestrator trains `job` as its rank, all at once: (reports, errors). A
    launcher may tell each rank its own config, and any shares."""
    place = RankPlace(world_size=len(gpus.cohorts), master=f"127.0.0.1:{free_port()}", context=b"test/" + os.urandom(8),
                      shares=tuple(shares if shares is not None else gpus.shares))
    configs = configs or [job.train] * len(gpus.cohorts)
    reports: list = [None] * len(gpus.cohorts)
    errors: list[BaseException] = []

    def rank(k: int) -> None:
        try:
            reports[k] = gpus.cohorts[k].train(json.dumps(configs[k].to_dict()), rank=replace(place, rank=k))
        except GputravelError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(k,)) for k in range(len(gpus.cohorts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    return reports, errors


def test_a_rank_that_runs_another_measurement_is_refused_before_any_gradient_moves(processes, tmp_path):
    os.chmod(tmp_path, 0o755)
    job = resolve(TrainingJobConfig(train=TINY, holders=holders(tmp_path), run_dir=str(tmp_path / "run"), gpus=2))
    # GPU 1's orchestrator is launched with another measured setting: another measurement.
    with GpuCohorts(_base(job), shares_of(job), per_gpu=lambda k, c: replace(c, travel_timeout=c.travel_timeout + k)) as gpus:
        _, errors = _train_every_rank(gpus, job)
    assert len(errors) == 2 and all(isinstance(e, PeerAttestationError) for e in errors), errors


@pytest.fixture(scope="module")
def cohorts_with_a_dying_holder(tmp_path_factory):
    """One pair of GPU cohorts for the two tests below (booting them is most of each test's
    cost): the job, its shares, the holder of GPU 1's share that dies in its first copy, the
    cohorts. The refusals end before any travel, so the holder that dies is still unused for
    the test that trains, whichever runs first."""
    tmp = tmp_path_factory.mktemp("dying")
    os.chmod(tmp, 0o755)
    job = resolve(TrainingJobConfig(train=TINY, holders=holders(tmp), run_dir=str(tmp / "run"), gpus=2))
    shares = shares_of(job)
    dies = shares[1][0]
    with GpuCohorts(_base(job, dies), shares) as gpus:
        yield job, shares, dies, gpus


def test_ranks_told_different_jobs_refuse_each_other_and_each_is_held_to_its_share(processes, cohorts_with_a_dying_holder):
    """The launcher says what each rank trains; the ranks bind the job (settings, checkpoint,
    every rank's holders) into their pair keys, so ranks told different jobs stop before a
    step. And a rank refuses a share that is not the holders it has."""
    job, _, dies, gpus = cohorts_with_a_dying_holder
    _, errors = _train_every_rank(gpus, job, configs=[job.train, job.train.replace(seed=job.train.seed + 1)])
    assert len(errors) == 2 and all(isinstance(e, PeerAttestationError) for e in errors), errors
    _, errors = _train_every_rank(gpus, job, shares=gpus.shares[::-1])
    assert len(errors) == 2 and all(isinstance(e, BadInput) and "not its share" in str(e) for e in errors), errors


def test_a_holder_killed_mid_copy_on_one_gpu_is_dropped_there_and_no_chunk_is_trained_on_twice(processes,
        cohorts_with_a_dying_holder):
    job, shares, dies, gpus = cohorts_with_a_dying_holder
    assert gpus.cohorts[1].children[dies].proc.poll() is None  # its first copy is this test's
    reports, errors = _train_every_rank(gpus, job)
    assert gpus.cohorts[1].children[dies].proc.wait(timeout=10) == 70  # it really died mid-copy
    assert not errors, errors
    assert all(len(r["losses"]) == TINY.steps for r in reports)  # both ranks trained every step
    assert reports[0]["holders_lost"] == [] and dies in " ".join(reports[1]["holders_lost"])
    for k, report in enumerate(reports):
        visits = [(t["holder"], t["token_offset"]) for t in report["travels"]]
        assert {h for h, _ in visits} <= set(shares[k]) and dies not in {h for h, _ in visits}
        # Within an epoch no chunk is fetched twice: a window is trained on at most once.
        assert len(set(visits)) == len(visits) and report["loader_state"]["epoch"] == 0


def test_two_servers_of_one_gpu_each_train_over_their_shaped_link(processes, two_gpus, tmp_path):
    """Each GPU's cohort an emulated server of its own (its members in network namespaces),
    the two orchestrator ranks joined only by a shaped link through a switch: the same losses
    as on one machine, and the ranks' traffic crossed that link both ways."""
    ok, why = netns_available()
    if not ok or os.geteuid() != 0:
        pytest.skip(f"emulated servers need root and network namespaces: {why}")
    _, hs, on_one_machine, _ = two_gpus
    os.chmod(tmp_path, 0o755)
    report = run_training_job(TrainingJobConfig(train=SHARED, holders=hs, run_dir=str(tmp_path / "run"), gpus=2,
                                                servers=True, server_mbit=1000.0))
    assert report["losses"] == on_one_machine["losses"]
    carried = report["servers"]["bytes"]
    assert report["servers"]["links"] == "netns-tc" and set(carried) == {"server-0", "server-1"}
    # Every step's gradients went through the ring between the servers: far more than a step's worth.
    assert all(b["sent"] > 10_000 and b["received"] > 10_000 for b in carried.values()), carried


def test_a_rank_told_to_resume_a_missing_checkpoint_answers_with_the_reason(tmp_path):
    """An OSError would end the orchestrator's process; it answers Failed(BadInput) instead."""
    from gputravel.orchestrator.process import _checkpoint_digest

    with pytest.raises(BadInput, match="no checkpoint"):
        _checkpoint_digest(str(tmp_path / "checkpoint.pt"))
    assert _checkpoint_digest("") == b""
