"""The job settings issue 29 (DP-SGD) wires are refused until it does: a setting accepted and
ignored would report a privacy the run never had. (Issue 31's ddp_compress is wired: test_gpus_train.)"""

import pytest

from gputravel.errors import BadInput
from gputravel.train.job import TrainConfig


@pytest.mark.parametrize(("key", "value", "says"), [("dp_epsilon", 3.0, "DP-SGD is not built yet")])
def test_a_setting_not_built_yet_is_refused(key: str, value: object, says: str) -> None:
    with pytest.raises(BadInput, match=says):
        TrainConfig(**{key: value})
    assert getattr(TrainConfig(), key) in (0.0, "none")
