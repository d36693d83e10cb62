"""FedAvg's knobs, and the plan they make for one job, checked before any process starts: FedAvg
trains on as many tokens as the other methods (rounds x clients per round x local steps = steps),
and no holder is asked for more local steps in a round than its data holds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version

from gputravel.errors import BadInput

DROP_MODES = ("crash", "leave")
_DROP = re.compile(r"^(?P<holder>[A-Za-z0-9_.-]+)@(?P<round>[0-9]+)$")


def framework() -> str:
    """The framework as reported in results, e.g. "flwr 1.42.0"."""
    try:
        return f"flwr {version('flwr')}"
    except PackageNotFoundError:
        raise BadInput("the FL baseline needs Flower: install the `fl` extra (pip install -e '.[fl]')") from None


@dataclass(frozen=True)
class FedAvgConfig:
    rounds: int = 4
    local_steps: int | None = None  # None: whatever gives the same training tokens as the others
    fraction: float = 1.0  # of the connected holders sampled each round (fraction_train)
    holder_threads: int = 1  # torch threads of each holder's local training
    round_timeout_s: float = 900.0  # how long a round waits for replies (Flower's `timeout`)
    drop: str | None = None  # "HOLDER@ROUND": that holder drops out in the middle of that round
    drop_mode: str = "crash"  # crash: killed, no goodbye; leave: stopped, it deregisters

    def __post_init__(self) -> None:
        if type(self.rounds) is not int or self.rounds < 1:  # not isinstance: True is no count
            raise BadInput(f"--fl-rounds must be at least 1, got {self.rounds!r}")
        if self.local_steps is not None and (type(self.local_steps) is not int or self.local_steps < 1):
            raise BadInput(f"--fl-local-steps must be at least 1, got {self.local_steps!r}")
        if not isinstance(self.fraction, (int, float)) or not 0 < self.fraction <= 1:
            raise BadInput(f"--fl-fraction must be in (0, 1], got {self.fraction!r}")
        if not isinstance(self.holder_threads, int) or self.holder_threads < 1:
            raise BadInput(f"holder threads must be at least 1, got {self.holder_threads!r}")
        if not self.round_timeout_s > 0:
            raise BadInput(f"the round timeout must be positive, got {self.round_timeout_s!r}")
        if self.drop_mode not in DROP_MODES:
            raise BadInput(f"--fl-drop-mode must be one of {', '.join(DROP_MODES)}, not {self.drop_mode!r}")
        if self.drop is not None:
            drop_target(self.drop)

    def to_dict(self) -> dict:
        return asdict(self)


def drop_target(text: str) -> tuple[str, int]:
    """'holder-2@2' -> ("holder-2", 2)."""
    m = _DROP.match(text or "")
    if m is None or int(m.group("round")) < 1:
        raise BadInput(f"--fl-drop must be HOLDER@ROUND, e.g. holder-2@2 (round from 1), got {text!r}")
    return m.group("holder"), int(m.group("round"))


@dataclass(frozen=True)
class FedAvgPlan:
    rounds: int
    local_steps: int
    clients_per_round: int
    holders: tuple[str, ...]
    fraction: float

    @property
    def total_steps(self) -> int:
        return self.rounds * self.clients_per_round * self.local_steps

    def to_dict(self) -> dict:
        return {**asdict(self), "holders": list(self.holders), "total_steps": self.total_steps}


def clients_per_round(holders: int, fraction: float) -> int:
    """How many holders Flower's FedAvg samples: int(connected x fraction), at least one."""
    return max(1, int(holders * fraction))


def plan(cfg: FedAvgConfig, *, steps: int, batch: int, seq_len: int, holder_tokens: Mapping[str, int],
         records: bool = False) -> FedAvgPlan:
    """The plan for a job of ``steps`` steps of ``batch`` x ``seq_len`` tokens, or BadInput naming what to change.
    With ``records`` (issue 27) ``holder_tokens`` counts training records, ``batch`` to a step: a holder's
    loader goes on into its next epoch as the centralised one does, so one whole batch is all it needs."""
    if not holder_tokens:
        raise BadInput("federated learning needs at least one holder")
    k = clients_per_round(len(holder_tokens), cfg.fraction)
    per_round = cfg.rounds * k
    if cfg.local_steps is None:
        if steps % per_round:
            raise BadInput(f"{steps} steps do not split into {cfg.rounds} rounds x {k} holders per round; "
                           f"pick --fl-rounds so that rounds x {k} divides the steps, or give --fl-local-steps")
        local = steps // per_round
    else:
        local = cfg.local_steps
        if local * per_round != steps:
            raise BadInput(f"FedAvg would train {cfg.rounds} rounds x {k} holders x {local} local steps = "
                           f"{local * per_round} steps, the other methods {steps}: the same training tokens "
                           f"need rounds x holders per round x local steps = steps")
    window = batch * seq_len
    for name, n in holder_tokens.items():
        if records:
            if n < batch:
                raise BadInput(f"holder {name!r} has {n} training records, fewer than one batch of {batch}")
            continue
        windows = (n - 1) // window if n > 0 else 0
        if local > windows:
            raise BadInput(f"{local} local steps per round is more than holder {name!r} has data for: its "
                           f"{n} tokens make {windows} batches of {batch} x {seq_len}; use more rounds or "
                           "fewer local steps")
    if cfg.drop is not None:
        holder, rnd = drop_target(cfg.drop)
        if holder not in holder_tokens:
            raise BadInput(f"--fl-drop names {holder!r}, not a holder ({', '.join(holder_tokens)})")
        if rnd > cfg.rounds:
            raise BadInput(f"--fl-drop round {rnd} is past the last round ({cfg.rounds})")
    return FedAvgPlan(cfg.rounds, local, k, tuple(holder_tokens), float(cfg.fraction))
