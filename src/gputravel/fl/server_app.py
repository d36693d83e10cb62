"""The Flower ServerApp: Flower's own FedAvg, unchanged but for recording each round, over the
holders' SuperNodes once all are connected. A holder that drops out is handled as Flower does.
It writes model.pt, rounds.json and, last, status.json in the job's ``out_dir``.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from gputravel.fl.local import initial_model, model_arrays
from gputravel.files import write_json
from gputravel.train.job import TrainConfig

app = ServerApp()


class RecordingFedAvg(FedAvg):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rounds: list[dict] = []

    def configure_train(self, server_round, arrays, config, grid):
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.rounds.append({"round": server_round, "start": time.time(),
                            "sampled_nodes": [m.metadata.dst_node_id for m in messages]})
        return messages

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        record = self.rounds[-1]
        record["end"] = time.time()
        record["replies"] = [_metrics(m) for m in replies if not m.has_error()]
        record["failures"] = [{"node": m.metadata.src_node_id, "code": int(m.error.code), "reason": m.error.reason}
                              for m in replies if m.has_error()]
        answered = {r["node"] for r in record["replies"]}
        record["missing_nodes"] = [n for n in record["sampled_nodes"] if n not in answered]
        return super().aggregate_train(server_round, replies)


def _metrics(message) -> dict:
    metrics = next(iter(message.content.metric_records.values()))
    return {"node": message.metadata.src_node_id, **{k: float(v) for k, v in metrics.items()}}


def _wait_for_holders(grid: Grid, expected: int, timeout_s: float) -> list[int]:
    """Every holder's SuperNode connected, or RuntimeError: a round must not sample a federation still assembling."""
    deadline = time.monotonic() + timeout_s
    while len(nodes := list(grid.get_node_ids())) < expected:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(nodes)} of {expected} holders' SuperNodes connected in {timeout_s:g} s")
        time.sleep(0.2)
    return nodes


@app.main()
def main(grid: Grid, context: Context) -> None:
    job = json.loads(Path(str(context.run_config["job"])).read_text())
    out = Path(job["out_dir"])
    try:
        _run(grid, job, out)
    except BaseException as exc:
        write_json(out / "status.json", {"status": "failed", "reason": f"{type(exc).__name__}: {exc}",
                                         "traceback": traceback.format_exc()})
        raise
    write_json(out / "status.json", {"status": "done"})


def _run(grid: Grid, job: dict, out: Path) -> None:
    cfg = TrainConfig.from_dict(job["train"])
    plan, fl = job["plan"], job["fl"]
    torch.set_num_threads(cfg.threads)
    nodes = _wait_for_holders(grid, len(plan["holders"]), job["connect_timeout_s"])
    strategy = RecordingFedAvg(fraction_train=plan["fraction"], fraction_evaluate=0.0, min_train_nodes=1,
                               min_evaluate_nodes=0, min_available_nodes=1)
    train_config = ConfigRecord({"train-json": cfg.canonical_json(), "local-steps": plan["local_steps"],
                                 "holder-steps": plan["rounds"] * plan["local_steps"],
                                 "holder-threads": fl["holder_threads"], "progress-dir": job["progress_dir"]})
    t0 = time.time()
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(torch_state_dict=model_arrays(initial_model(cfg))),
                            num_rounds=plan["rounds"], timeout=fl["round_timeout_s"], train_config=train_config)
    wall = time.time() - t0
    torch.save(result.arrays.to_torch_state_dict(), out / "model.pt")
    write_json(out / "rounds.json", {"nodes_at_start": nodes, "wall_s": wall, "rounds": strategy.rounds})
