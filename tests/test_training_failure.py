"""A failure of no type of ours in the orchestrator's training (a bug, or torch refusing a record) may
quote a holder's record in its message: it ends the job named by type and line only (the second
review of this stop: torch's "Target 12 is out of bounds" named a holder's label)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from gputravel.data.demo_records import demo_holders
from gputravel.data.records import load_records, write_records
from gputravel.errors import GputravelError, failed_where


def test_a_failure_is_named_by_type_and_our_line_never_its_message() -> None:
    from gputravel.files import check_split

    with pytest.raises(ValueError) as info:
        check_split(2.0, 0)  # "eval_share must be ... got 2.0": a value in the message
    named = failed_where(info.value)
    assert named.startswith("ValueError at gputravel/files.py:") and "2.0" not in named

    class Theirs(Exception):
        pass

    assert failed_where(Theirs("record 7: alice, 1971")) == "an exception of other code"


def test_a_records_label_torch_refuses_ends_the_job_without_its_value(processes, tmp_path: Path) -> None:
    from gputravel.jobs.training import TrainingJobConfig, run_training_job
    from gputravel.train.job import TrainConfig

    os.chmod(tmp_path, 0o755)
    holders = demo_holders("tabular", 2, tmp_path / "data")
    path = Path(holders[1][1])
    records = load_records(path)
    array = np.array(records.array)
    array["label"] = 12  # past the table's two classes: a value only this holder's records hold
    write_records(path, records.schema, array)
    for _, p in holders:
        Path(p).chmod(0o755)
    schema = load_records(holders[0][1]).schema.canonical_json()
    cfg = TrainConfig(workload="tabular", record_schema=schema, steps=4, batch=8, buffer_bytes=64 << 10,
                      eval_every=0, checkpoint_every=0, warmup_steps=1, schedule="proportional")
    with pytest.raises(GputravelError) as info:
        run_training_job(TrainingJobConfig(train=cfg, holders=holders, run_dir=str(tmp_path / "run")))
    said = str(info.value)
    assert "training failed: IndexError at gputravel/" in said, said
    assert "Target 12" not in said and "out of bounds" not in said  # not in the error, nor the log's tail
