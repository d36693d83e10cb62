"""Workloads (issue 27): the consortium's training code. A workload is a plain Python file that
names the SCHEMA of the records it trains on, builds its ``model(schema)`` and turns a batch of
records into ``inputs(records) -> (x, y)``; ``loss``, ``optimizer`` and ``metrics`` are optional.
It travels inside the job, so it is part of the orchestrator's measurement that holders pin.
"""

from __future__ import annotations

import traceback
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from gputravel.data.records import RecordSchema, as_tensors
from gputravel.errors import BadInput, named_type

SHIPPED = ("gpt2", "image", "tabular")
REQUIRED = ("SCHEMA", "model", "inputs")


def gpt_loss(forward: Callable, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """GPT-2's: its forward takes the targets and returns (logits, loss)."""
    return forward(x, y)[1]


def default_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def default_metrics(out: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over the batch (gputravel divides by the records evaluated): loss and accuracy."""
    return {"loss": F.cross_entropy(out, y, reduction="sum"), "accuracy": (out.argmax(-1) == y).sum()}


def default_optimizer(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


@dataclass(frozen=True)
class Workload:
    """A loaded workload. ``schema`` None: GPT-2 on token windows (the original job)."""

    name: str
    schema: RecordSchema | None
    module: types.ModuleType | None = None

    @property
    def tokens(self) -> bool:
        return self.schema is None and self.module is None

    def build(self, cfg: Any, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The model and its optimizer, initialised from the job's seed (GPT-2's: train/loop.py)."""
        assert self.module is not None
        torch.manual_seed(cfg.seed)
        with self.guard("model"):
            model = self.module.model(self.schema).to(device)
        with self.guard("optimizer"):
            make = getattr(self.module, "optimizer", default_optimizer)
            return model, make(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def loss(self, forward: Callable, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.module is None:
            return gpt_loss(forward, x, y)
        with self.guard("loss"):
            return getattr(self.module, "loss", default_loss)(forward(x), y)

    def batch(self, records: np.ndarray, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of records (a structured array) as the model's (inputs, targets)."""
        return self.inputs(as_tensors(records, torch.from_numpy), device)

    def inputs(self, fields: dict[str, torch.Tensor], device: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch as a tensor a field, as the model's (inputs, targets)."""
        assert self.module is not None
        with self.guard("inputs"):
            x, y = self.module.inputs(fields)
            return x.to(device), y.to(device)

    def metrics(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """The workload's metric sums over one evaluation batch, with "count"."""
        assert self.module is not None
        with self.guard("metrics"):
            sums = getattr(self.module, "metrics", default_metrics)(model(x), y)
            return {**{k: float(v) for k, v in sums.items()}, "count": float(len(y))}

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run the workload's code: a failure that passed through it is named by type and line only,
        as its message (or its class's name) may quote records; GPT-2's own code is not guarded."""
        if self.module is None:
            yield
            return
        try:
            yield
        except BaseException as exc:
            filename = _filename(self.name)
            if not _passed(exc, filename):  # not the workload's: the ring's typed errors, a real Ctrl-C
                raise
            raise BadInput(f"workload {self.name!r} failed in {what}: {failure(exc, filename)}") from None



def _passed(exc: BaseException, filename: str) -> bool:
    return any(f.filename == filename for f in traceback.extract_tb(exc.__traceback__))


def failure(exc: BaseException, filename: str) -> str:
    """`exc` in words safe to log: its type (when Python, torch or numpy define it) and the last
    line of `filename` it passed through."""
    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
    return f"{named_type(exc) or 'an exception the code defines'} at line {lines[-1] if lines else '?'}"


def _filename(name: str) -> str:
    return f"<workload {name}>"


def load_workload(name: str, code: str = "", schema: str = "", script: bool = False) -> Workload:
    """The job's workload: a shipped one by name, or ``code`` (a file's text) when name is "file";
    `schema` is the job's record schema (the holders'), which must match the workload's SCHEMA."""
    if name == "gpt2" and not code:
        return Workload("gpt2", None)
    if script:  # a script brings its own model and loop: only its records' schema is the job's
        return Workload(name, RecordSchema.from_json(schema) if schema else None)
    if code:
        module = _module(name, code)
    elif name in SHIPPED:
        module = _module(name, resources.files(__package__).joinpath(f"{name}.py").read_text())
    else:
        raise BadInput(f"unknown workload {name!r}: choose one of {', '.join(SHIPPED)} or a .py file")
    own = RecordSchema.parse(module.SCHEMA)
    job = RecordSchema.from_json(schema) if schema else own
    shape = [(f.name, f.dtype, f.shape) for f in job.fields]
    if shape != [(f.name, f.dtype, f.shape) for f in own.fields]:
        raise BadInput(f"workload {name!r} trains on records {own.text()}, the job's holders hold {job.text()}")
    return Workload(name, job, module)


def _module(name: str, code: str) -> types.ModuleType:
    module = types.ModuleType(f"gputravel_workload_{name.replace('.', '_')}")
    try:
        exec(compile(code, _filename(name), "exec"), module.__dict__)
    except Exception as exc:  # at load time no record is in reach: the message helps the author
        raise BadInput(f"workload {name!r} failed to load: {type(exc).__name__}: {exc}") from None
    missing = [n for n in REQUIRED if not hasattr(module, n)]
    if missing:
        raise BadInput(f"workload {name!r} does not define {', '.join(missing)} (a workload names its SCHEMA "
                       "and defines model(schema) and inputs(records))")
    if not isinstance(module.SCHEMA, str):
        raise BadInput(f"workload {name!r}: SCHEMA is a string such as 'image: uint8[1,8,8]; label: int64[]'")
    return module
