"""Issue 31's gradient compression as a job setting (`ddp_compress`): the job's value reaches its
ranks' ring (Ranks.for_job, which the loop opens them with), and where there is no all-reduce to
compress (one GPU) it is refused, never accepted and ignored. Fast tier: nothing starts a process;
tests/test_gpus_train.py trains two GPUs with it (G2 within compression)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from gputravel.cli.app import app
from gputravel.errors import BadInput
from gputravel.jobs.training import TrainingJobConfig, default_holders
from gputravel.train.job import TrainConfig
from gputravel.train.ranks import Ranks


def _ranks(compress: str | None = None) -> Ranks:
    return Ranks(rank=0, world_size=2, attest=lambda n: n, verify=lambda r, q, n: None, context=b"job",
                 compress=compress)


@pytest.mark.parametrize(("setting", "compress"), [("none", None), ("fp16", "fp16"), ("bf16", "bf16")])
def test_the_ranks_compress_as_the_job_says(setting: str, compress: str | None) -> None:
    assert _ranks().for_job(setting).compress == compress
    assert _ranks(compress).for_job(setting).compress == compress  # told the same: kept


@pytest.mark.parametrize(("told", "setting"), [("fp16", "none"), ("fp16", "bf16"), ("bf16", "fp16")])
def test_ranks_told_another_compression_than_the_job_are_refused(told: str, setting: str) -> None:
    with pytest.raises(BadInput, match="ddp_compress"):
        _ranks(told).for_job(setting)


def test_a_job_of_one_gpu_refuses_compression(tmp_path: Path) -> None:
    holders = default_holders(2, tmp_path)
    with pytest.raises(BadInput, match=r"--ddp-compress fp16 .* needs --gpus 2 or more"):
        TrainingJobConfig(train=TrainConfig(ddp_compress="fp16"), holders=holders, run_dir=str(tmp_path / "r"))
    job = TrainingJobConfig(train=TrainConfig(ddp_compress="bf16"), holders=holders, run_dir=str(tmp_path / "r"),
                            gpus=2)
    assert job.train.ddp_compress == "bf16"


@pytest.mark.parametrize(("args", "says"), [(["--ddp-compress", "fp16"], "needs --gpus 2 or more"),
                                            (["--ddp-compress", "fp8", "--gpus", "2"], "--ddp-compress")])
def test_the_demo_refuses_compression_without_gpus_to_all_reduce(tmp_path: Path, args: list[str], says: str) -> None:
    res = CliRunner().invoke(app, ["demo", *args, "--run-dir", str(tmp_path / "run")])
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert says in " ".join(res.output.split())
    assert not (tmp_path / "run").exists()  # refused before anything started
