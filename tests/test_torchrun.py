"""torchrun launches the ranks of a `--loader local` data-parallel job (jobs/torchrun_rank.py,
issue 14): the same losses as run_local_ranks, bit for bit, and a launch that does not fit its
job directory refused with the reason."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gputravel.ddp.launch import free_port
from gputravel.errors import BadInput
from gputravel.jobs.local_ranks import run_local_ranks
from gputravel.jobs.torchrun_rank import ROOT_KEY_FILE, main, read_torchrun_job, write_torchrun_job
from gputravel.train.loop import TrainConfig

TINY = TrainConfig(steps=6, batch=2, seq_len=16, buffer_bytes=1024, n_layer=1, n_head=2, n_embd=32,
                   threads=1, sample_tokens=0, warmup_steps=2, loader="local")
LAUNCH_TIMEOUT_S = 120  # both ranks' start-up and training take a few seconds here


def _torchrun(job_dir: Path, cwd: Path, *launches: list[str]) -> list[subprocess.CompletedProcess]:
    """One torchrun (torch.distributed.run, in the CPU wheel) per `launches` item (its own
    options), all at once, each in a session of its own so a hung launch is ended with every
    rank it started."""
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *options, "-m",
                               "gputravel.jobs.torchrun_rank", str(job_dir)], cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for options in launches]
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun hung past {LAUNCH_TIMEOUT_S} s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return done


@pytest.fixture(scope="module")
def local(tmp_path_factory, write_rank_shares):
    """The reference: run_local_ranks on the same job."""
    tmp = tmp_path_factory.mktemp("local")
    shares = write_rank_shares(tmp)
    return shares, run_local_ranks(TINY, shares, tmp / "run", timeout=60)


def _assert_same_as_local(run_dir: Path, local_report: dict) -> None:
    report = json.loads((run_dir / "report.json").read_text())
    assert len(report["losses"]) == TINY.steps
    assert report["losses"] == local_report["losses"]  # floats through JSON: exact, repr round-trips
    assert report["loader_state"] == local_report["loader_state"]
    assert report["gpus"] == 2 and report["shares"] == [["north"], ["south", "west"]]
    assert (run_dir / "checkpoint.pt").is_file()


def test_torchrun_ranks_give_the_losses_of_local_ranks_bit_for_bit(processes, local, tmp_path):
    shares, local_report = local
    job = write_torchrun_job(TINY, shares, tmp_path / "job", tmp_path / "run")
    [launched] = _torchrun(job, tmp_path, ["--standalone", "--nproc-per-node", "2"])
    assert launched.returncode == 0, launched.stderr[-3000:]
    _assert_same_as_local(tmp_path / "run", local_report)


def test_two_nodes_of_one_rank_each_give_the_same_losses(processes, local, tmp_path):
    """The two-machine command of docs/training.md, both "machines" on this one."""
    shares, local_report = local
    job = write_torchrun_job(TINY, shares, tmp_path / "job", tmp_path / "run")
    port = str(free_port())
    launched = _torchrun(job, tmp_path, *([["--nnodes", "2", "--node-rank", str(k), "--master-addr", "127.0.0.1",
                                           "--master-port", port, "--nproc-per-node", "1"] for k in range(2)]))
    for node in launched:
        assert node.returncode == 0, node.stderr[-3000:]
    _assert_same_as_local(tmp_path / "run", local_report)


def test_a_launch_of_another_world_size_is_refused_with_the_reason(processes, tmp_path, write_rank_shares):
    job = write_torchrun_job(TINY, write_rank_shares(tmp_path), tmp_path / "job", tmp_path / "run")
    [launched] = _torchrun(job, tmp_path, ["--standalone", "--nproc-per-node", "1"])
    assert launched.returncode != 0
    assert "is a job of 2 ranks, launched with WORLD_SIZE=1" in launched.stderr
    assert not (tmp_path / "run").exists()


def test_the_job_directory_keeps_its_emulated_root_key_private(tmp_path, write_rank_shares):
    job = write_torchrun_job(TINY, write_rank_shares(tmp_path), tmp_path / "job", tmp_path / "run")
    assert (job.stat().st_mode & 0o777) == 0o700
    assert ((job / ROOT_KEY_FILE).stat().st_mode & 0o777) == 0o600
    assert read_torchrun_job(job, 1, 2).share == tuple((n, p) for n, p in write_rank_shares(tmp_path)[1])
    with pytest.raises(BadInput, match="local loader"):
        write_torchrun_job(TrainConfig(loader="travelling"), write_rank_shares(tmp_path), tmp_path / "j2", tmp_path / "r2")


LAUNCH_ENV = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # torchrun's


@pytest.mark.parametrize("env, job_json, says", [
    (dict.fromkeys(LAUNCH_ENV), None, ("RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set: launch this module "
                                       "with torchrun")),
    ({"RANK": "x"}, None, "RANK and WORLD_SIZE must be integers"),
    ({"RANK": "2"}, None, "RANK=2 is not in 0..1"),
    ({}, "", "job.json not found"),
    ({}, "{not json", "job.json is malformed"),
    ({}, '{"format": "gputravel torchrun job v1"}', "run_dir: Field required"),
])
def test_bad_launches_exit_2_with_a_clear_message(tmp_path, monkeypatch, capsys, env, job_json, says, write_rank_shares):
    """Each is refused before any rendezvous (MASTER_PORT 1 is never dialled)."""
    job = write_torchrun_job(TINY, write_rank_shares(tmp_path), tmp_path / "job", tmp_path / "run")
    for name, value in (LAUNCH_ENV | env).items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    if job_json == "":
        (job / "job.json").unlink()
    elif job_json is not None:
        (job / "job.json").write_text(job_json)
    assert main([str(job)]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert "PRIVATE KEY" not in err  # the emulated root's key never reaches a message


def test_a_launch_without_its_job_directory_is_told_the_usage(capsys):
    assert main([]) == 2
    assert "usage: python -m gputravel.jobs.torchrun_rank JOB_DIR" in capsys.readouterr().err
