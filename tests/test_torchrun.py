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

from gputravel.errors import BadInput
from gputravel.jobs.local_ranks import run_local_ranks
from gputravel.jobs.torchrun_rank import ROOT_KEY_FILE, main, read_torchrun_job, write_torchrun_job
from gputravel.train.loop import TrainConfig

TEXTS = {
    "north": "Now is the winter of our discontent made glorious summer by this sun of York. " * 12,
    "south": "If music be the food of love, play on; give me excess of it, that, surfeiting. " * 10,
    "west": "When shall we three meet again in thunder, lightning, or in rain? " * 14,
}
TINY = TrainConfig(steps=6, batch=2, seq_len=16, buffer_bytes=1024, n_layer=1, n_head=2, n_embd=32,
                   threads=1, sample_tokens=0, warmup_steps=2, loader="local")
LAUNCH_TIMEOUT_S = 120  # both ranks' start-up and training take a few seconds here


def _shares(tmp: Path) -> list[list[tuple[str, str]]]:
    paths = {}
    for name, text in TEXTS.items():
        (tmp / f"{name}.txt").write_text(text)
        paths[name] = str(tmp / f"{name}.txt")
    return [[("north", paths["north"])], [("south", paths["south"]), ("west", paths["west"])]]


def _torchrun(job_dir: Path, nproc: int, cwd: Path) -> subprocess.CompletedProcess:
    """torchrun from the CPU wheel (torch.distributed.run), in a session of its own so a hung
    launch is ended with every rank it started."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "gputravel.jobs.torchrun_rank", str(job_dir)]
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun hung past {LAUNCH_TIMEOUT_S} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_torchrun_ranks_give_the_losses_of_local_ranks_bit_for_bit(tmp_path):
    shares = _shares(tmp_path)
    job = write_torchrun_job(TINY, shares, tmp_path / "job", tmp_path / "run")
    launched = _torchrun(job, 2, tmp_path)
    assert launched.returncode == 0, launched.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    local = run_local_ranks(TINY, shares, tmp_path / "local", timeout=60)
    assert len(report["losses"]) == TINY.steps
    assert report["losses"] == local["losses"]  # floats through JSON: exact, repr round-trips
    assert report["loader_state"] == local["loader_state"]
    assert report["gpus"] == 2 and report["shares"] == [["north"], ["south", "west"]]
    assert (tmp_path / "run" / "checkpoint.pt").is_file()


def test_a_launch_of_another_world_size_is_refused_with_the_reason(tmp_path):
    job = write_torchrun_job(TINY, _shares(tmp_path), tmp_path / "job", tmp_path / "run")
    launched = _torchrun(job, 1, tmp_path)
    assert launched.returncode != 0
    assert "is a job of 2 ranks, launched with WORLD_SIZE=1" in launched.stderr
    assert not (tmp_path / "run").exists()


def test_the_job_directory_keeps_its_emulated_root_key_private(tmp_path):
    job = write_torchrun_job(TINY, _shares(tmp_path), tmp_path / "job", tmp_path / "run")
    assert (job.stat().st_mode & 0o777) == 0o700
    assert ((job / ROOT_KEY_FILE).stat().st_mode & 0o777) == 0o600
    assert read_torchrun_job(job, 1, 2).share == tuple((n, p) for n, p in _shares(tmp_path)[1])
    with pytest.raises(BadInput, match="local loader"):
        write_torchrun_job(TrainConfig(loader="travelling"), _shares(tmp_path), tmp_path / "j2", tmp_path / "r2")


@pytest.mark.parametrize("env, job_json, says", [
    ({}, None, "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set: launch this module with torchrun"),
    ({"RANK": "x"}, None, "RANK and WORLD_SIZE must be integers"),
    ({"RANK": "2"}, None, "RANK=2 is not in 0..1"),
    ({}, "", "job.json not found"),
    ({}, "{not json", "job.json is malformed"),
    ({}, '{"format": "gputravel torchrun job v0"}', "run_dir: Field required"),
])
def test_bad_launches_exit_2_with_a_clear_message(tmp_path, monkeypatch, capsys, env, job_json, says):
    job = write_torchrun_job(TINY, _shares(tmp_path), tmp_path / "job", tmp_path / "run")
    if env:  # the variables torchrun would have set, one of them wrong
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "1")
        for name, value in ({"RANK": "0", "WORLD_SIZE": "2"} | env).items():
            monkeypatch.setenv(name, value)
    else:
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(name, raising=False)
    if job_json is not None:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}.items():
            monkeypatch.setenv(name, value)
        if job_json:
            (job / "job.json").write_text(job_json)
        else:
            (job / "job.json").unlink()
    assert main([str(job)]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert "PRIVATE KEY" not in err  # the emulated root's key never reaches a message
