"""A training run's outputs on disk: report.json, metrics.csv, loss.png, checkpoint.pt and
sample.txt. Files rewritten whole are replaced atomically: a crash leaves the old one, never a torn one.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from gputravel.files import atomic_write_bytes
from gputravel.errors import BadInput
from gputravel.train.model import GPTConfig

CHECKPOINT_FORMAT = "gputravel-gpt-checkpoint-v1"


class Sealing(Protocol):
    """What a checkpoint is sealed with at rest (broker/seal.py's Sealer: a key only the same
    orchestrator measurement and job gets back from the key broker). None: plaintext, as before."""

    def seal(self, plaintext: bytes) -> bytes: ...

    def open(self, data: bytes, what: str = ...) -> bytes: ...


@dataclass(frozen=True)
class Kept:
    """What a run may keep in its run directory (a job manifest's [outputs], issue 28). The default,
    for runs with no manifest: everything, in plaintext. `weights`: hand the trained weights back
    (TrainResult.weights) for a release."""

    metrics: bool = True  # metrics.csv, loss.png, eval.png (the report is its launcher's)
    checkpoints: bool = True
    sealer: Sealing | None = None  # checkpoints sealed at rest with it; None: plaintext
    weights: bool = False


def _scalar(value: object) -> object:
    """A CSV cell for ``value``: 0-d tensors become Python numbers."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise BadInput("a metrics value must be a scalar; call .item() on tensors first")
        return value.item()
    return value


class RunDir:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise BadInput(f"run directory {self.path} exists and is not a directory")
        self.path.mkdir(parents=True, exist_ok=True)
        self._metrics_header: list[str] | None = None
        self.report_path = self.path / "report.json"
        self.metrics_path = self.path / "metrics.csv"
        self.checkpoint_path = self.path / "checkpoint.pt"
        self.sample_path = self.path / "sample.txt"

    def write_report(self, report: dict) -> Path:
        """report.json, sorted; NaN and infinity are refused, as strict JSON readers reject them."""
        if not isinstance(report, dict):
            raise BadInput(f"a report must be a dict, got {type(report).__name__}")
        try:
            text = json.dumps(report, indent=2, sort_keys=True, allow_nan=False)
        except ValueError as e:
            raise BadInput(f"report.json cannot hold NaN or infinity ({e}); store None or a string instead") from None
        except TypeError as e:
            raise BadInput(f"report.json takes only JSON types ({e}); convert tensors with .item() "
                           "and paths with str()") from None
        atomic_write_bytes(self.report_path, (text + "\n").encode())
        return self.report_path

    def read_report(self) -> dict:
        try:
            return json.loads(self.report_path.read_text())
        except FileNotFoundError:
            raise BadInput(f"no report.json in {self.path}; write_report() first") from None
        except ValueError as e:
            raise BadInput(f"{self.report_path} is not valid JSON: {e}") from None

    def _existing_header(self) -> list[str] | None:
        """The header of a metrics.csv left by an earlier process (a resumed run)."""
        if not self.metrics_path.exists() or self.metrics_path.stat().st_size == 0:
            return None
        with self.metrics_path.open(newline="") as f:
            return next(csv.reader(f), None)

    def append_metrics(self, row: dict) -> None:
        """One row more in metrics.csv, the file closed after it: a crash loses at most that row."""
        if not isinstance(row, dict) or not row:
            raise BadInput("a metrics row must be a non-empty dict of column -> value")
        if self._metrics_header is None:
            self._metrics_header = self._existing_header()
        header = self._metrics_header
        keys = [str(k) for k in row]
        if header is not None and sorted(keys) != sorted(header):
            raise BadInput(f"metrics row has columns {keys} but metrics.csv has {header}; "
                           "log the same columns on every row")
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        if header is None:
            header = self._metrics_header = keys
            writer.writerow(header)
        by_name = {str(k): _scalar(v) for k, v in row.items()}
        writer.writerow([by_name[k] for k in header])
        with self.metrics_path.open("a", newline="") as f:  # closed, so flushed, row by row
            f.write(buf.getvalue())

    def read_metrics(self) -> list[dict[str, str]]:
        """The rows of metrics.csv as dicts of strings (CSV has no types)."""
        if not self.metrics_path.exists():
            return []
        with self.metrics_path.open(newline="") as f:
            return list(csv.DictReader(f))

    def truncate_metrics(self, step: int) -> None:
        """Keep the rows of steps before `step`: a run resumed there trains the later ones again."""
        rows = self.read_metrics()
        if not rows:
            return
        header = list(rows[0])
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=header, lineterminator="\n")
        writer.writeheader()
        writer.writerows(r for r in rows if int(r["step"]) < step)
        atomic_write_bytes(self.metrics_path, buf.getvalue().encode())

    def plot_losses(self, steps: Sequence[float], losses: Sequence[float], title: str = "training loss") -> Path:
        """loss.png: loss against step."""
        if len(steps) != len(losses):
            raise BadInput(f"plot_losses got {len(steps)} steps but {len(losses)} losses")
        if not steps:
            raise BadInput("plot_losses needs at least one (step, loss) point")
        # The Figure API (not pyplot) draws headless, from any thread; imported here, as it is slow.
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.4, 4.0), dpi=100)
        ax = fig.add_subplot()
        ax.plot(list(steps), list(losses), label="train")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        target = self.path / "loss.png"
        atomic_write_bytes(target, buf.getvalue())
        return target

    def plot_eval(self, evals: Sequence[dict], metric: str = "accuracy") -> Path | None:
        """eval.png: each holder's held-out `metric` (else loss) against step; None if no evaluation."""
        if not evals:
            return None
        from matplotlib.figure import Figure

        metric = metric if metric in evals[-1]["all"] else "loss"
        fig = Figure(figsize=(6.4, 4.0), dpi=100)
        ax = fig.add_subplot()
        steps = [e["step"] for e in evals]
        for holder in sorted(evals[-1]["per_holder"]):
            ax.plot(steps, [e["per_holder"].get(holder, {}).get(metric) for e in evals], marker="o", label=holder)
        ax.plot(steps, [e["all"][metric] for e in evals], marker="s", color="black", label="all holders")
        ax.set_xlabel("step")
        ax.set_ylabel(f"held-out {metric}")
        ax.grid(True, alpha=0.3)
        ax.legend()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        target = self.path / "eval.png"
        atomic_write_bytes(target, buf.getvalue())
        return target

    def write_sample(self, text: str) -> Path:
        if not isinstance(text, str):
            raise BadInput(f"a sample must be str, got {type(text).__name__}; decode tokens first")
        atomic_write_bytes(self.sample_path, text.encode("utf-8", errors="replace"))
        return self.sample_path

    def save_checkpoint(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, step: int,
                        extra: dict | None = None, *, sealer: Sealing | None = None) -> Path:
        """checkpoint.pt, sealed by ``sealer`` if given; ``extra`` holds plain types and tensors only,
        as loading is weights_only."""
        config = model_config(model)
        if not isinstance(step, int) or step < 0:
            raise BadInput(f"step must be an int >= 0, got {step!r}")
        payload = {
            "format": CHECKPOINT_FORMAT,
            "config": config,
            "step": step,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "extra": dict(extra or {}),
        }
        buf = io.BytesIO()
        torch.save(payload, buf)
        data = buf.getvalue() if sealer is None else sealer.seal(buf.getvalue())
        atomic_write_bytes(self.checkpoint_path, data)
        return self.checkpoint_path


def model_config(model: torch.nn.Module) -> dict:
    """What a checkpoint records of its model: a GPT's config, else every tensor's shape (issue 27)."""
    config = getattr(model, "config", None)
    if isinstance(config, GPTConfig):
        return config.to_dict()
    if not isinstance(model, torch.nn.Module):
        raise BadInput(f"a checkpoint holds a torch model, got {type(model).__name__}")
    return {"shapes": {name: list(t.shape) for name, t in model.state_dict().items()}}


def _read_checkpoint(path: Path, data: bytes | None = None, sealer: Sealing | None = None) -> dict:
    """The checkpoint at `path`, or in `data`: its bytes, read once by a caller that checked them;
    opened by `sealer` first if given (SealedError if it does not open)."""
    if data is None and not path.is_file():
        raise BadInput(f"no checkpoint at {path}; check the run directory or train first")
    if sealer is not None:
        data = sealer.open(data if data is not None else path.read_bytes(), f"checkpoint {path}")
    try:
        # weights_only: a checkpoint is data, never code to run (it may come from elsewhere)
        payload = torch.load(io.BytesIO(data) if data is not None else path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a damaged file
        sealed = " (a sealed one opens only with its run's key from the key broker)" if sealer is None else ""
        raise BadInput(f"checkpoint {path} is corrupt, sealed or not a gputravel checkpoint ({type(e).__name__})"
                       f"{sealed}; restore it from a copy") from None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise BadInput(f"{path} is not a {CHECKPOINT_FORMAT} file")
    return payload


def checkpoint_extra(path: str | os.PathLike, *, sealer: Sealing | None = None) -> dict:
    """A checkpoint's ``extra``, without building a model to load it into."""
    extra = _read_checkpoint(Path(path), sealer=sealer).get("extra")
    if not isinstance(extra, dict):
        raise BadInput(f"checkpoint {path} is inconsistent (no extra); start the run afresh")
    return extra


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    data: bytes | None = None, sealer: Sealing | None = None) -> tuple[int, dict]:
    """(step, extra), ``model`` (and ``optimizer``) restored from the checkpoint at ``path``, or
    from ``data``, its bytes as the caller read and checked them (sealed, if ``sealer`` is given,
    which opens them). Loads onto the CPU."""
    path = Path(path)
    payload = _read_checkpoint(path, data, sealer)
    config = model_config(model)
    stored = payload.get("config")
    if stored != config:
        diffs = (", ".join(f"{k}: checkpoint {stored.get(k)!r} vs model {v!r}"
                           for k, v in config.items() if stored.get(k) != v)
                 if isinstance(stored, dict) else "checkpoint has no config")
        raise BadInput(f"checkpoint {path} is for another model config ({diffs}); "
                       "build the model with the checkpoint's GPTConfig")
    try:
        model.load_state_dict(payload["model"])
        if optimizer is not None:
            if payload.get("optimizer") is None:
                raise BadInput(f"checkpoint {path} has no optimizer state; pass optimizer=None")
            optimizer.load_state_dict(payload["optimizer"])
    except (KeyError, RuntimeError, ValueError) as e:
        raise BadInput(f"checkpoint {path} does not fit this model/optimizer: {e}") from None
    step, extra = payload.get("step"), payload.get("extra")
    if not isinstance(step, int) or not isinstance(extra, dict):
        raise BadInput(f"checkpoint {path} is missing its step or extra fields")
    return step, extra

