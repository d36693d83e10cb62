"""The job settings issues 29 (DP-SGD) and 31 (compressed all-reduce) wire are refused until they
are: a setting accepted and ignored would report a privacy or numerics the run never had."""

import pytest

from gputravel.errors import BadInput
from gputravel.train.job import TrainConfig


@pytest.mark.parametrize(("key", "value", "says"), [("dp_epsilon", 3.0, "DP-SGD is not built yet"),
                                                      ("ddp_compress", "fp16", "not built into jobs yet")])
def test_a_setting_not_built_yet_is_refused(key: str, value: object, says: str) -> None:
    with pytest.raises(BadInput, match=says):
        TrainConfig(**{key: value})
    assert getattr(TrainConfig(), key) in (0.0, "none")
