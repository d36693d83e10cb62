"""The orchestrator CVM's process main loop: boot the engine, then answer the supervisor's
commands over the control link (travels, baseline transfers, joins and leaves, training).
The engine itself, and the travel loop, are orchestrator/cvm.py.
"""

from __future__ import annotations

import dataclasses
import json
import socket
from pathlib import Path

from gputravel.errors import BadInput, GputravelError
from gputravel.orchestrator.cvm import NAME, Orchestrator, OrchestratorConfig
from gputravel.orchestrator.membership import ORCHESTRATOR_COMMANDS, Membership
from gputravel.protocol.control import (
    AwaitHolders,
    DoBaseline,
    DoTravel,
    Failed,
    Holders,
    Ready,
    Shutdown,
    Train,
    TrainDone,
    TrainStep,
)
from gputravel.transport.base import Transport


def run_training(orch: Orchestrator, cmd: Train, control: Transport) -> dict:
    """Train inside this CVM on batches the GPU fetched by travelling; stream each step out."""
    # Here, not at the top: training needs torch, which a cohort that only travels never loads.
    from gputravel.train.loader import BaselineSource, TravelSource  # lazy: torch, for training only
    from gputravel.train.loop import TrainConfig, make_report, sample_tokenizer, train  # lazy: torch

    cfg = TrainConfig(**json.loads(cmd.config_json))
    if cfg.buffer_bytes != orch.config.buffer_bytes:
        raise BadInput(f"the job wants a {cfg.buffer_bytes}-byte buffer, this cohort has {orch.config.buffer_bytes}")
    if orch.config.tokenizer and cfg.tokenizer != orch.config.tokenizer:
        raise BadInput(f"the job trains on {cfg.tokenizer!r} tokens, this cohort holds {orch.config.tokenizer!r} tokens")
    assert orch.travel_sm is not None
    sizes = {name: orch.travel_sm.holders[name].dataset_bytes for name in orch.holders}
    source = BaselineSource(orch, sizes) if cfg.loader == "baseline" else TravelSource(orch, sizes)
    result = train(cfg, source, run_dir=Path(cmd.run_dir) if cmd.run_dir else None,
                   on_step=lambda e: control.send(TrainStep(**dataclasses.asdict(e))),
                   resume_from=Path(cmd.resume_checkpoint) if cmd.resume_checkpoint else None,
                   tokenizer=sample_tokenizer(cfg.tokenizer))
    return make_report(cfg, result)


def serve(config: OrchestratorConfig, control: Transport, device_link: socket.socket) -> None:
    orch = Orchestrator(config, device_link)
    orch.boot()
    membership = Membership(orch)  # who has the GPU between travels: kept across commands
    control.send(Ready(role=NAME, detail={"port": orch.listener.port}))
    try:
        while True:
            cmd = control.recv().message
            if isinstance(cmd, Shutdown):
                return
            try:
                if isinstance(cmd, AwaitHolders):
                    control.send(Holders(dataset_bytes=orch.await_holders(cmd.names, cmd.timeout)))
                elif isinstance(cmd, DoBaseline):
                    control.send(orch.baseline(cmd.holder, cmd.dataset_offset))
                elif isinstance(cmd, DoTravel):
                    control.send(orch.travel(cmd.holder, cmd.dataset_offset))
                elif isinstance(cmd, ORCHESTRATOR_COMMANDS):  # join and leave (orchestrator/membership.py)
                    control.send(membership.command(cmd))
                elif isinstance(cmd, Train):
                    control.send(TrainDone(report_json=json.dumps(run_training(orch, cmd, control))))
                else:
                    control.send(Failed(kind="ProtocolError", reason=f"unknown command {type(cmd).__name__}"))
            except GputravelError as exc:
                control.send(Failed(kind=type(exc).__name__, reason=str(exc)))
    finally:
        orch.close()
