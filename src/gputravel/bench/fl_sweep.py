"""`gputravel bench fl-sweep`: where FedAvg moves fewer bytes than travelling and the TLS
baseline, and where more, over model sizes and the dataset size per holder.

Each cell is a `bench train` run. Travel and tls run once per dataset size (what they put on
the link does not depend on the model); ``crossover`` solves, per model, the dataset size per
holder at which FedAvg's bytes equal each; ``loss_gap`` sets FedAvg non-IID and IID against travel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gputravel.bench import train
from gputravel.bench.compare import parse_list, stamp
from gputravel.errors import BadInput
from gputravel.fl.config import FedAvgConfig
from gputravel.fl.local import parameter_count

HOLDERS = 3
BUFFER_BYTES = 128 << 10


@dataclass(frozen=True)
class SweepConfig:
    models: tuple[tuple[int, int], ...] = ((2, 64), (4, 128), (6, 256))  # (layers, width)
    holder_tokens: tuple[int, ...] = (4096, 16384, 65536)
    bandwidth_mbit: float = 20.0
    rounds: int = 2
    link: str = "auto"
    loss_gap: bool = True
    workdir: str | None = None

    def __post_init__(self) -> None:
        if not self.models or any(n_layer < 1 or n_embd < 32 or n_embd % 32 for n_layer, n_embd in self.models):
            raise BadInput("--models are LAYERSxWIDTH, width a multiple of 32, e.g. 2x64,4x128,6x256")
        if not self.holder_tokens or any(n < 1 for n in self.holder_tokens):
            raise BadInput("--holder-tokens must be positive")
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise BadInput(f"--rounds must be at least 1, got {self.rounds!r}")


def parse_models(text: str) -> tuple[tuple[int, int], ...]:
    """'2x64,4x128' -> ((2, 64), (4, 128))."""
    def model(m: str) -> tuple[int, int]:
        layers, width = m.split("x")  # ValueError unless exactly one x
        return int(layers), int(width)
    return parse_list(text.lower(), model, f"--models are LAYERSxWIDTH, comma separated, e.g. 2x64,4x128, got {text!r}")


def parse_tokens(text: str) -> tuple[int, ...]:
    """'4096,16384' -> (4096, 16384)."""
    return parse_list(text, int, f"--holder-tokens are whole numbers of tokens, comma separated, e.g. "
                                 f"4096,16384, got {text!r}")


def model_config(n_layer: int, n_embd: int, steps: int):
    return train.bench_train_config(steps, BUFFER_BYTES, n_layer=n_layer, n_embd=n_embd, n_head=max(1, n_embd // 64))


def run(cfg: SweepConfig, *, on_cell: Callable[[dict], None] | None = None) -> dict:
    result = {**stamp(), "bandwidth_mbit": cfg.bandwidth_mbit, "rounds": cfg.rounds, "holders": HOLDERS,
              "buffer_bytes": BUFFER_BYTES, "cells": [], "loss_gap": None}
    for d in cfg.holder_tokens:
        for k, (n_layer, n_embd) in enumerate(cfg.models):
            cell = _cell(cfg, d, n_layer, n_embd, ("travel", "tls", "fl") if k == 0 else ("fl",))
            result["link"] = cell.pop("link")
            result["cells"].append(cell)
            if on_cell is not None:
                on_cell(cell)
    result["crossover"] = crossover(result["cells"], cfg.rounds)
    if cfg.loss_gap:
        result["loss_gap"] = loss_gap(cfg)
    return result


def _cell(cfg: SweepConfig, holder_tokens: int, n_layer: int, n_embd: int, methods: tuple[str, ...]) -> dict:
    probe = model_config(n_layer, n_embd, 1)
    local = (holder_tokens - 1) // (probe.batch * probe.seq_len) // cfg.rounds
    if local < 1:
        raise BadInput(f"--holder-tokens {holder_tokens} is less than one batch per round")
    t = probe.replace(steps=cfg.rounds * HOLDERS * local)
    bench = train.TrainBenchConfig((cfg.bandwidth_mbit,), train=t, holders=HOLDERS, link=cfg.link, methods=methods,
                                   fl=FedAvgConfig(rounds=cfg.rounds), holder_tokens=holder_tokens,
                                   workdir=cfg.workdir)
    out = train.run(bench)
    rows = {r["method"]: _slim(r) for r in out["rows"]}
    return {"link": out["link"], "holder_tokens": holder_tokens, "n_layer": n_layer, "n_embd": n_embd,
            "params": parameter_count(t), "steps": t.steps, "train_tokens": t.steps * t.batch * t.seq_len,
            "local_steps": local, "rows": rows}


def _slim(row: dict) -> dict:
    keep = ("bytes_over_link", "bytes_by_holder", "tx_s", "training_s", "wall_s", "holder_compute_s", "final_loss",
            "rounds", "fetches", "framework")
    return {k: row[k] for k in keep}


def crossover(cells: list[dict], rounds: int) -> dict:
    """Measured rates and the dataset size per holder where FedAvg's bytes equal each method's."""
    central = [c for c in cells if "tls" in c["rows"]]
    if not central:
        return {}
    per_token = [c["rows"]["tls"]["bytes_over_link"] / c["train_tokens"] for c in central]
    per_travel = [c["rows"]["travel"]["bytes_over_link"] / c["rows"]["travel"]["fetches"] for c in central]
    # The highest rates measured: they put the parity points as low as the data allow, so
    # "below this size FedAvg moves more" holds (at larger sizes TLS moves ~2.1 B/token).
    tls_rate, travel_rate = max(per_token), max(per_travel)
    buffer_tokens = BUFFER_BYTES // 2
    models = {}
    for c in cells:
        fl = c["rows"]["fl"]
        per_round = fl["bytes_over_link"] / (rounds * HOLDERS)  # one holder, one round, both ways
        model = models.setdefault(f"{c['n_layer']}x{c['n_embd']}", {"params": c["params"], "per_round_holder": []})
        model["per_round_holder"].append(per_round)
    for m in models.values():
        per_round = max(m.pop("per_round_holder"))
        m.update(fl_bytes_per_holder_round=per_round, overhead=per_round / (2 * 4 * m["params"]),
                 tls_parity_holder_tokens=rounds * per_round / tls_rate,
                 travel_parity_holder_tokens=rounds * per_round * buffer_tokens / travel_rate)
    return {"tls_bytes_per_token": tls_rate, "travel_bytes_per_travel": travel_rate, "buffer_tokens": buffer_tokens,
            "rounds": rounds, "models": models}


def loss_gap(cfg: SweepConfig) -> dict:
    """Final held-out loss at `bench train`'s default size: travel and FedAvg, non-IID and IID."""
    out = {}
    for iid in (False, True):
        bench = train.TrainBenchConfig((cfg.bandwidth_mbit,), link=cfg.link, methods=("travel", "fl"), iid=iid,
                                       workdir=cfg.workdir)
        rows = {r["method"]: r for r in train.run(bench)["rows"]}
        out["iid" if iid else "non_iid"] = {m: {"final_loss": r["final_loss"], "train_loss_tail": r["train_loss_tail"]}
                                           for m, r in rows.items()}
    return out


def plot(result: dict, path):
    """Bytes over the links against the dataset size per holder, log-log."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4), dpi=110)
    ax = fig.subplots()
    cells = result["cells"]
    for name, (marker, color) in {"tls": ("s", "tab:orange"), "travel": ("o", "tab:blue")}.items():
        pts = sorted((c["holder_tokens"], c["rows"][name]["bytes_over_link"]) for c in cells if name in c["rows"])
        ax.plot(*zip(*pts, strict=True), marker=marker, color=color, label={"tls": "TLS baseline", "travel": "GPU Travelling"}[name])
    greens = ("tab:green", "tab:olive", "tab:purple", "tab:brown", "tab:pink", "tab:gray")
    for k, model in enumerate(dict.fromkeys((c["n_layer"], c["n_embd"]) for c in cells)):
        pts = sorted((c["holder_tokens"], c["rows"]["fl"]["bytes_over_link"]) for c in cells
                     if (c["n_layer"], c["n_embd"]) == model)
        params = next(c["params"] for c in cells if (c["n_layer"], c["n_embd"]) == model)
        ax.plot(*zip(*pts, strict=True), marker="^", linestyle="--", color=greens[k % len(greens)], label=f"FedAvg {model[0]}x{model[1]} ({params / 1e6:.2f}M)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training tokens per holder")
    ax.set_ylabel("bytes over the holders' links")
    ax.legend(fontsize=7)
    ax.set_title(f"{result['holders']} holders, {result['rounds']} FedAvg rounds, {result['bandwidth_mbit']:g} Mbit/s "
                 f"({result.get('link', '?')})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
