"""The Flower ClientApp: one holder's local round of FedAvg, on the holder's own compute, in a
process of its own per round. Its SuperNode's node config names the holder, its index and its
data, which never leaves this process; the Context's state carries where the last round stopped.
A records workload trains on the holder's training records only, split as its CVM splits them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from gputravel.data.holder_tokens import load_tokens
from gputravel.fl.local import LocalResult, local_train, local_train_records, schedule_config
from gputravel.train.loader import LocalSource
from gputravel.train.job import TrainConfig

app = ClientApp()
STATE = "gputravel"


@app.train()
def train(msg: Message, context: Context) -> Message:
    config = msg.content["config"]
    cfg = TrainConfig.from_json(str(config["train-json"]))
    holder, index = str(context.node_config["holder"]), int(context.node_config["index"])
    rnd, steps = int(config["server-round"]), int(config["local-steps"])
    # Tells the benchmark this holder is mid-round (it may be told to drop out now).
    (Path(str(config["progress-dir"])) / f"{holder}-round-{rnd}").touch()
    started = time.time()
    result = _local(cfg, msg, context, holder, config)
    metrics = MetricRecord({"num-examples": steps * cfg.batch * (1 if cfg.records else cfg.seq_len),
                            "holder-index": index,
                            "compute-s": result.compute_s, "cpu-s": result.cpu_s,
                            "loss-first": result.losses[0], "loss-last": result.losses[-1],
                            # where the round's time went (fl/run.py), epoch s
                            "t-process": process_started_at(), "t-train-start": started, "t-train-end": time.time()})
    return Message(content=RecordDict({"arrays": ArrayRecord(torch_state_dict=result.arrays), "metrics": metrics}),
                   reply_to=msg)


def _local(cfg: TrainConfig, msg: Message, context: Context, holder: str, config) -> LocalResult:
    """This round's local steps from where the last stopped (the Context's state), recorded there."""
    rnd, steps = int(config["server-round"]), int(config["local-steps"])
    arrays = msg.content["arrays"].to_torch_state_dict()
    kw: dict[str, Any] = {"steps": steps, "schedule": schedule_config(cfg, int(config["holder-steps"])),
          "schedule_offset": (rnd - 1) * steps, "threads": int(config["holder-threads"])}
    data = str(context.node_config["data"])
    if cfg.records:
        state = json.loads(str(context.state[STATE]["loader"])) if STATE in context.state else None
        result = local_train_records(cfg, arrays, LocalSource.of(cfg, [(holder, data)]), state=state, **kw)
        context.state[STATE] = ConfigRecord({"loader": json.dumps(result.loader)})
        return result
    first = int(context.state[STATE]["next-window"]) if STATE in context.state else 0
    result = local_train(cfg, arrays, load_tokens(data).tokens, first_window=first, **kw)
    context.state[STATE] = MetricRecord({"next-window": result.next_window})
    return result


def process_started_at() -> float:
    """When this process started (epoch s, to 10 ms), from /proc."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
