"""A user's own training script as the job (issue 27): it keeps its loop, and only its data
loader changes, to :func:`batches`, which yields the travelled records one epoch a call. Its text
travels in the job like a workload file's, so the orchestrator's measurement covers it."""

from __future__ import annotations

import traceback
import types
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from gputravel.errors import BadInput
from gputravel.workloads import failure

__all__ = ["Feed", "batches", "held_out", "keep", "log", "run_script"]


@dataclass
class Feed:
    """What a running script reaches: the job's loader (any iterator of batches that keeps its
    epoch in ``loader.state.epoch``), its held-out records, and where logged values go."""

    loader: Any
    held: Callable[[], Iterator[tuple[str, Any]]]
    on_log: Callable[[dict[str, float]], None]
    _it: Iterator[Any] | None = None
    _pending: list[Any] = field(default_factory=list)
    kept: dict[str, Any] | None = None  # the state_dict of the model the script handed keep() last

    def epoch(self) -> Iterator[Any]:
        begin = getattr(self.loader, "epoch_batches", None)
        if begin is not None:  # one shuffle over all records: an epoch begins at each call, as a stock loop's
            yield from begin()
            return
        if self._it is None:
            self._it = iter(self.loader)
        epoch = self.loader.state.epoch
        while True:
            batch = self._pending.pop() if self._pending else next(self._it)
            if self.loader.state.epoch != epoch:  # the first batch of the next epoch: kept for the next call
                self._pending.append(batch)
                return
            yield batch


_feed: ContextVar[Feed | None] = ContextVar("gputravel_script_feed", default=None)


def _current() -> Feed:
    feed = _feed.get()
    if feed is None:
        raise BadInput("gputravel.workloads.batches() feeds a script run as a gputravel job: "
                       "`gputravel demo --script FILE`")
    return feed


def batches() -> Iterator[dict[str, Any]]:
    """One epoch over every holder's training records, as dicts of tensors (field name -> tensor),
    the job's --batch records each, shuffled within each travel (the job's shuffle "all": one shuffle over
    them all, as DataLoader(shuffle=True) draws it from torch's generator)."""
    return _current().epoch()


def held_out() -> Iterator[tuple[str, dict[str, Any]]]:
    """(holder, batch) over each holder's held-out records, which travel for this only."""
    return _current().held()


def log(**values: float) -> None:
    """Record this step's values (``loss=...``): the report's losses and the live view show them."""
    _current().on_log({k: float(v) for k, v in values.items()})


def keep(model: Any) -> None:
    """Hand gputravel the trained model (a torch.nn.Module): under a job manifest, the model that is
    sealed and released to its recipients (issue 28); the last call counts."""
    import torch  # lazy: a script's runtime already has it loaded

    if not isinstance(model, torch.nn.Module):
        raise BadInput(f"gputravel.workloads.keep() takes the trained torch.nn.Module, got {type(model).__name__}")
    _current().kept = {k: v.detach().clone() for k, v in model.state_dict().items()}  # as it is now


def run_script(name: str, code: str, feed: Feed) -> None:
    """Run the script's text as ``__main__`` with `feed` behind batches(), held_out() and log()."""
    module = types.ModuleType("__main__")
    module.__file__ = f"<script {name}>"
    token = _feed.set(feed)
    try:
        exec(compile(code, module.__file__, "exec"), module.__dict__)
    except SystemExit as exc:  # sys.exit(): 0 or None is the script's end; its message may quote records
        if exc.code not in (0, None):
            raise BadInput(f"script {name!r} exited: {failure(exc, module.__file__)}") from None
    except BaseException as exc:  # its message may quote records: the type and the line only
        frames = traceback.extract_tb(exc.__traceback__)
        if not any(f.filename == module.__file__ for f in frames):
            raise  # not the script's own: the loader's typed errors, a real Ctrl-C
        if isinstance(exc, BadInput) and frames[-1].filename == __file__:  # this module's own words, no data
            raise BadInput(f"script {name!r}: {exc}") from None
        raise BadInput(f"script {name!r} failed: {failure(exc, module.__file__)}") from None
    finally:
        _feed.reset(token)
