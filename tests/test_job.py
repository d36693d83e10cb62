"""Issue 26: one schema of a training job (train/job.py), whatever starts, records or checks it:
the demo's options, the services' [job] table, a checkpoint, the measured job and FedAvg."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import get_args

import pytest
import torch
from pydantic import ValidationError

from gputravel.cli.train import training_job
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.errors import BadInput
from gputravel.files import DATASET_FORMATS, RAW, RECORDS, TOKENS, dataset_kind
from gputravel.fl.local import schedule_config
from gputravel.holder.cvm import Dataset
from gputravel.service.config import HolderService, JobSection
from gputravel.train.job import TrainConfig
from gputravel.train.loader import LocalSource
from gputravel.train.loop import train

TINY = TrainConfig(steps=4, batch=2, seq_len=8, buffer_bytes=256, n_layer=1, n_head=2, n_embd=16, threads=1,
                   sample_tokens=0, warmup_steps=1, checkpoint_every=2, loader="local")


def test_the_services_job_table_is_the_job_and_where_its_run_directory_goes() -> None:
    assert list(JobSection.model_fields) == [*TrainConfig.model_fields, "run_dir"]
    section = JobSection(run_dir="/run")
    assert section.train_config() == TrainConfig()  # the same defaults
    assert {k: v for k, v in section.to_dict().items() if k != "run_dir"} == TrainConfig().to_dict()


def test_the_demos_options_default_to_the_jobs_defaults() -> None:
    defaults = {name: p.default.default for name, p in inspect.signature(training_job).parameters.items()}
    job = TrainConfig()
    for flag in ("steps", "batch", "seq_len", "schedule", "seed", "loader", "threads", "checkpoint_every"):
        assert defaults[flag] == getattr(job, flag), flag
    assert round(defaults["buffer_mib"] * (1 << 20)) == job.buffer_bytes


@pytest.mark.parametrize("values, says", [
    ({"steps": 0}, "--steps: expected greater than 0, got 0"),
    ({"seq_len": "64"}, "--seq-len: expected a valid integer, got '64'"),  # strict: a string is no number
    ({"threads": True}, "--threads: expected a valid integer, got True"),
    ({"loader": "carrier-pigeon"}, "--loader: expected 'travelling', 'local' or 'baseline'"),
    ({"seed": 1 << 64}, "--seed: expected an integer from -2^63 to 2^64 - 1"),
    ({"n_head": 3}, "--n-embd: expected a multiple of n_head (3), got 256"),
    ({"stpes": 3}, "--stpes: unknown key"),
])
def test_a_bad_job_made_in_code_names_the_flag(values: dict, says: str) -> None:
    with pytest.raises(BadInput) as caught:
        TrainConfig(**values)
    assert says in str(caught.value)


def test_the_job_table_names_its_keys_and_keeps_its_own_rules() -> None:
    with pytest.raises(BadInput, match=r"job\.steps: expected greater than 0"):
        JobSection(run_dir="/run", steps=0)
    with pytest.raises(BadInput, match=r"job\.loader: expected 'travelling' or 'baseline'"):
        JobSection(run_dir="/run", loader="local")  # the services train on what the GPU brings
    with pytest.raises(BadInput, match=r"job\.buffer_bytes: expected a multiple of 4096"):
        JobSection(run_dir="/run", buffer_bytes=5000)
    TrainConfig(buffer_bytes=5000, loader="local")  # from disk, any buffer does
    with pytest.raises(ValidationError):  # nested (a TOML file's [job]): the reader words it, by file and key
        JobSection.model_validate({"run_dir": "/run", "steps": 0})


def test_a_job_is_frozen_and_replace_checks_the_new_one() -> None:
    job = TrainConfig()
    with pytest.raises(ValidationError):
        job.steps = 3
    assert job.replace(steps=3).steps == 3 and job.steps == 300
    with pytest.raises(BadInput, match="--lr"):
        job.replace(lr=2.0)
    assert isinstance(JobSection(run_dir="/run").replace(steps=3), JobSection)


def test_the_canonical_json_is_one_string_per_job_and_reads_back() -> None:
    job = TrainConfig(lr=0.5, weight_decay=0)  # an int where a float goes: the same job as 0.0
    assert job == TrainConfig(weight_decay=0.0, lr=0.5)
    text = job.canonical_json()
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    assert TrainConfig.from_json(text) == job and TrainConfig.from_dict(json.loads(text)) == job
    for bad in ("{not json", "[1]", '{"steps": -1}'):
        with pytest.raises(BadInput):
            TrainConfig.from_json(bad)


def test_fedavg_stretches_the_jobs_schedule_as_a_job() -> None:
    stretched = schedule_config(TrainConfig(steps=100, warmup_steps=20), 10)
    assert isinstance(stretched, TrainConfig) and (stretched.steps, stretched.warmup_steps) == (10, 2)


def _tokens() -> dict:
    return {"a": torch.arange(4000, dtype=torch.int64).remainder(200).numpy().astype("uint16")}


def test_a_checkpoint_records_the_job_and_a_resume_compares_jobs(tmp_path: Path) -> None:
    """The checkpoint holds the job's settings; a resume reads them back as a job and compares
    that with its own: equal jobs resume (however the record spells a value), others are named."""
    run = tmp_path / "run"
    stopped = train(TINY, LocalSource(_tokens()), run_dir=run, should_stop=lambda: True)  # after step 1
    path = run / "checkpoint.pt"
    payload = torch.load(path, weights_only=True)
    assert stopped.stopped and TrainConfig.from_dict(payload["extra"]["config"]) == TINY
    with pytest.raises(BadInput, match=r"another job \(differs in: lr, steps\)"):
        train(TINY.replace(lr=0.5, steps=5), LocalSource(_tokens()), resume_from=path)
    # Written by another version: keys in another order, a float stored as an int.
    payload["extra"]["config"] = dict(reversed(list({**payload["extra"]["config"], "weight_decay": 0}.items())))
    torch.save(payload, path)
    resumed = train(TINY.replace(weight_decay=0.0), LocalSource(_tokens()), resume_from=path)
    assert len(resumed.losses) == TINY.steps


def test_a_dataset_format_is_defined_once() -> None:
    assert DATASET_FORMATS == (RAW, TOKENS, RECORDS) == ("raw", "tokens", "records")
    assert get_args(HolderService.model_fields["format"].annotation) == DATASET_FORMATS
    assert HolderService.model_fields["format"].default == TOKENS  # a service's holder feeds a training job
    assert [dataset_kind(f) for f in DATASET_FORMATS] == ["file", "path", "path"]
    for refuse in (lambda: dataset_kind("bytes"), lambda: Dataset(__file__, "bytes")):
        with pytest.raises((ValueError, BadInput), match="unknown dataset format 'bytes': use 'raw', 'tokens' or 'records'"):
            refuse()
    with pytest.raises(BadInput, match="holder 'h': unknown dataset format"):
        CohortConfig(holders=(HolderSpec("h", __file__, "bytes"),), buffer_bytes=1 << 20)
