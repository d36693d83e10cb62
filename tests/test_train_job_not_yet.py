"""Job settings are refused where they cannot hold: a setting accepted and ignored would report a
privacy the run never had. Issue 29 wires DP-SGD for records workloads (tests/test_dp_*.py);
GPT-2's tokens and training scripts stay refused. (Issue 31's ddp_compress: test_gpus_train.)"""

import pytest

from gputravel.errors import BadInput
from gputravel.train.job import TrainConfig

CODE = "SCHEMA = 'x: float32[3]; label: int64[]'\ndef model(s): pass\ndef inputs(r): pass\n"


@pytest.mark.parametrize(("values", "says"), [
    ({}, "--dp-epsilon: expected 0 for GPT-2's token windows"),  # gpt2
    ({"workload": "port", "workload_code": CODE, "script": True}, "--dp-epsilon: expected 0 for a training script"),
])
def test_dp_where_it_cannot_be_accounted_for_is_refused_naming_the_key(values: dict, says: str) -> None:
    with pytest.raises(BadInput, match=says):
        TrainConfig(dp_epsilon=3.0, **values)
    assert TrainConfig().dp_epsilon == 0.0
    assert TrainConfig(workload="tabular", dp_epsilon=3.0).dp_epsilon == 3.0


def test_the_fedavg_baseline_refuses_a_dp_job_rather_than_train_it_without_dp(tmp_path) -> None:
    from gputravel.fl.config import FedAvgConfig
    from gputravel.fl.run import FlJob, check

    job = FlJob(train=TrainConfig(workload="tabular", dp_epsilon=3.0, record_schema=""), fl=FedAvgConfig(),
                holders={}, bandwidth_mbit=None, workdir=tmp_path)
    with pytest.raises(BadInput, match="the FedAvg baseline trains without DP-SGD"):
        check(job)
