"""From a party's service config to the engine's own configuration."""

from __future__ import annotations

import os

from gputravel.orchestrator.cvm import OrchestratorConfig
from gputravel.service.config import AUDIT_LOG, OrchestratorService

__all__ = ["orchestrator_engine_config"]


def orchestrator_engine_config(cfg: OrchestratorService, *, pki_dir: str, trust_dir: str) -> OrchestratorConfig:
    """The engine's config; its placement is not measured, so init's measurement is the running service's."""
    return OrchestratorConfig(
        host_socket=cfg.host_socket, pki_dir=pki_dir, layout=cfg.layout.to_layout(),
        buffer_bytes=cfg.job.buffer_bytes, listen_host=cfg.listen_host, listen_port=cfg.listen_port,
        holder_timeout=cfg.holder_timeout, device_timeout=cfg.device_timeout,
        # As the demo (jobs/training.py): holders whose tokens came from another tokenizer are refused.
        tokenizer=cfg.job.tokenizer,
        trust_dir=trust_dir, audit_log=os.path.join(cfg.state_dir, AUDIT_LOG), hardware=cfg.hardware,
        # The [job] table is measured too: a holder's policy pins the job run on its data.
        job_json=cfg.job.train_config().canonical_json())
