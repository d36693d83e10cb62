"""A training run's outputs on disk: report, metrics, loss plot, checkpoint, sample.

Layout of a run directory::

    report.json     final summary (atomic: a reader never sees half a file)
    metrics.csv     one row per logged step, appended and flushed as training goes
    loss.png        loss curve
    checkpoint.pt   model + optimizer + step + the model's GPTConfig (atomic)
    sample.txt      generated text

Files that are rewritten whole are written to a temporary file in the same directory and
then ``os.replace``-d, so a crash mid-write leaves the previous version, never a torn one.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from gputravel.files import atomic_write_bytes
from gputravel.errors import BadInput
from gputravel.train.model import GPT, GPTConfig

CHECKPOINT_FORMAT = "gputravel-gpt-checkpoint-v1"


def _scalar(value: object) -> object:
    """A CSV cell for ``value``: 0-d tensors become Python numbers."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise BadInput("a metrics value must be a scalar; call .item() on tensors first")
        return value.item()
    return value


class RunDir:
    """Writes one training run's outputs under ``path`` (created if missing)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise BadInput(f"run directory {self.path} exists and is not a directory")
        self.path.mkdir(parents=True, exist_ok=True)
        self._metrics_header: list[str] | None = None

    # ------------------------------------------------------------------ paths
    @property
    def report_path(self) -> Path:
        return self.path / "report.json"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.csv"

    @property
    def checkpoint_path(self) -> Path:
        return self.path / "checkpoint.pt"

    @property
    def sample_path(self) -> Path:
        return self.path / "sample.txt"

    # ------------------------------------------------------------------ report
    def write_report(self, report: dict) -> Path:
        """Write ``report`` as report.json (sorted keys, atomically). Values must be JSON
        types; NaN and infinity are refused because strict JSON readers reject them."""
        if not isinstance(report, dict):
            raise BadInput(f"a report must be a dict, got {type(report).__name__}")
        try:
            text = json.dumps(report, indent=2, sort_keys=True, allow_nan=False)
        except ValueError as e:
            raise BadInput(
                f"report.json cannot hold NaN or infinity ({e}); store None or a string instead"
            ) from None
        except TypeError as e:
            raise BadInput(
                f"report.json takes only JSON types ({e}); convert tensors with .item() "
                "and paths with str()"
            ) from None
        atomic_write_bytes(self.report_path, (text + "\n").encode())
        return self.report_path

    def read_report(self) -> dict:
        try:
            return json.loads(self.report_path.read_text())
        except FileNotFoundError:
            raise BadInput(f"no report.json in {self.path}; write_report() first") from None
        except ValueError as e:
            raise BadInput(f"{self.report_path} is not valid JSON: {e}") from None

    # ------------------------------------------------------------------ metrics
    def _existing_header(self) -> list[str] | None:
        """The header of a metrics.csv left by an earlier process (a resumed run)."""
        if not self.metrics_path.exists() or self.metrics_path.stat().st_size == 0:
            return None
        with self.metrics_path.open(newline="") as f:
            return next(csv.reader(f), None)

    def append_metrics(self, row: dict) -> None:
        """Append one row to metrics.csv. The first row's keys become the header; every
        later row must have the same keys. Each call opens, writes and closes the file,
        so a crash loses at most the row being written."""
        if not isinstance(row, dict) or not row:
            raise BadInput("a metrics row must be a non-empty dict of column -> value")
        if self._metrics_header is None:
            self._metrics_header = self._existing_header()
        header = self._metrics_header
        keys = [str(k) for k in row]
        if header is not None and sorted(keys) != sorted(header):
            raise BadInput(
                f"metrics row has columns {keys} but metrics.csv has {header}; "
                "log the same columns on every row"
            )
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        if header is None:
            header = self._metrics_header = keys
            writer.writerow(header)
        by_name = {str(k): _scalar(v) for k, v in row.items()}
        writer.writerow([by_name[k] for k in header])
        with self.metrics_path.open("a", newline="") as f:
            f.write(buf.getvalue())
            f.flush()

    def read_metrics(self) -> list[dict[str, str]]:
        """The rows of metrics.csv as dicts of strings (CSV has no types)."""
        if not self.metrics_path.exists():
            return []
        with self.metrics_path.open(newline="") as f:
            return list(csv.DictReader(f))

    def truncate_metrics(self, step: int) -> None:
        """Keep only the rows of steps before `step`: a run resumed from the checkpoint of
        that step trains the later ones again (an earlier attempt may have logged them)."""
        rows = self.read_metrics()
        if not rows:
            return
        header = list(rows[0])
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=header, lineterminator="\n")
        writer.writeheader()
        writer.writerows(r for r in rows if int(r["step"]) < step)
        atomic_write_bytes(self.metrics_path, buf.getvalue().encode())

    # ------------------------------------------------------------------ plot
    def plot_losses(
        self,
        steps: Sequence[float],
        losses: Sequence[float],
        out: str = "loss.png",
        title: str = "training loss",
        val: tuple[Sequence[float], Sequence[float]] | None = None,
    ) -> Path:
        """Plot loss against step into ``out`` (a file name inside the run directory).
        ``val`` is an optional (steps, losses) pair drawn as a second curve."""
        if len(steps) != len(losses):
            raise BadInput(f"plot_losses got {len(steps)} steps but {len(losses)} losses")
        if not steps:
            raise BadInput("plot_losses needs at least one (step, loss) point")
        if Path(out).name != out:
            raise BadInput(f"out must be a file name inside the run directory, got {out!r}")
        # imported here: matplotlib costs a noticeable import time that only plotting needs.
        # The Figure API draws with Agg and never touches pyplot's global state or a display,
        # so this works headless and from any thread.
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.4, 4.0), dpi=100)
        ax = fig.add_subplot()
        ax.plot(list(steps), list(losses), label="train")
        if val is not None:
            ax.plot(list(val[0]), list(val[1]), marker="o", label="val")
            ax.legend()
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        target = self.path / out
        atomic_write_bytes(target, buf.getvalue())
        return target

    # ------------------------------------------------------------------ sample
    def write_sample(self, text: str) -> Path:
        if not isinstance(text, str):
            raise BadInput(f"a sample must be str, got {type(text).__name__}; decode tokens first")
        atomic_write_bytes(self.sample_path, text.encode("utf-8", errors="replace"))
        return self.sample_path

    # ------------------------------------------------------------------ checkpoint
    def save_checkpoint(
        self,
        model: GPT,
        optimizer: torch.optim.Optimizer | None,
        step: int,
        extra: dict | None = None,
    ) -> Path:
        """Save model, optimizer, step and ``extra`` to checkpoint.pt atomically.

        ``extra`` must hold only plain types (numbers, str, lists, dicts, tensors) because
        checkpoints are loaded with ``weights_only=True``, which refuses arbitrary pickles.
        Put RNG states there (``torch.get_rng_state()``) if a resumed run must continue
        bit-identically."""
        config = getattr(model, "config", None)
        if not isinstance(config, GPTConfig):
            raise BadInput("save_checkpoint needs a GPT model (one with a GPTConfig .config)")
        if not isinstance(step, int) or step < 0:
            raise BadInput(f"step must be an int >= 0, got {step!r}")
        payload = {
            "format": CHECKPOINT_FORMAT,
            "config": config.to_dict(),
            "step": step,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "extra": dict(extra or {}),
        }
        buf = io.BytesIO()
        torch.save(payload, buf)
        atomic_write_bytes(self.checkpoint_path, buf.getvalue())
        return self.checkpoint_path

    @staticmethod
    def load_checkpoint(
        path: str | os.PathLike,
        model: GPT,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> tuple[int, dict]:
        """Restore ``model`` (and ``optimizer`` if given) from ``path``; return (step, extra).
        Also available as the module function :func:`load_checkpoint`."""
        return load_checkpoint(path, model, optimizer)


def _read_checkpoint(path: Path, data: bytes | None = None) -> dict:
    """The checkpoint at `path`, or in `data`: its bytes, read once by a caller that checked them."""
    if data is None and not path.is_file():
        raise BadInput(f"no checkpoint at {path}; check the run directory or train first")
    try:
        # weights_only: a checkpoint is data, never code to run (it may come from elsewhere)
        payload = torch.load(io.BytesIO(data) if data is not None else path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a damaged file
        raise BadInput(
            f"checkpoint {path} is corrupt or not a gputravel checkpoint "
            f"({type(e).__name__}); delete it or restore it from a copy"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise BadInput(f"{path} is not a {CHECKPOINT_FORMAT} file")
    return payload


def checkpoint_extra(path: str | os.PathLike) -> dict:
    """What a checkpoint carries besides the model and optimizer (its ``extra``), without
    building a model to load it into; BadInput if it has none."""
    extra = _read_checkpoint(Path(path)).get("extra")
    if not isinstance(extra, dict):
        raise BadInput(f"checkpoint {path} is inconsistent (no extra); start the run afresh")
    return extra


def load_checkpoint(
    path: str | os.PathLike,
    model: GPT,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    data: bytes | None = None,
) -> tuple[int, dict]:
    """Restore ``model`` (and ``optimizer`` if given) from a checkpoint; return (step, extra).
    With ``data``, from those bytes (the file's, read once by the caller) rather than the file.

    Tensors are loaded onto the CPU and copied into the model's parameters, so a checkpoint
    saved on CUDA loads into a CPU model and back. The stored GPTConfig must equal
    ``model.config``; a mismatch is a BadInput naming the differing fields."""
    path = Path(path)
    payload = _read_checkpoint(path, data)
    config = getattr(model, "config", None)
    if not isinstance(config, GPTConfig):
        raise BadInput("load_checkpoint needs a GPT model (one with a GPTConfig .config)")
    stored = payload.get("config")
    if stored != config.to_dict():
        diffs = (
            ", ".join(
                f"{k}: checkpoint {stored.get(k)!r} vs model {v!r}"
                for k, v in config.to_dict().items()
                if stored.get(k) != v
            )
            if isinstance(stored, dict)
            else "checkpoint has no config"
        )
        raise BadInput(
            f"checkpoint {path} is for another model config ({diffs}); "
            "build the model with the checkpoint's GPTConfig"
        )
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

