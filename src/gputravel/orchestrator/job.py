"""The job an orchestrator runs, as one 48-byte digest (issue 28): what it extends into RTMR[3] at
boot, names in every AttestEvidence, and what each holder's policy approves (docs/attestation.md).

With a job manifest (gputravel.manifest) the digest is the manifest's, and the job it launches with
must be the manifest's job; without one, a labelled SHA-384 of the canonical TrainConfig JSON
("": the any-job digest, which a holder may approve explicitly)."""

from __future__ import annotations

import hashlib
from typing import Protocol

from gputravel.errors import BadInput

__all__ = ["JOB_LABEL", "job_digest", "job_json_digest"]

JOB_LABEL = b"gputravel job v1\x00"


class JobFields(Protocol):
    """What of an OrchestratorConfig names its job (orchestrator/cvm.py imports this module)."""

    @property
    def job_json(self) -> str: ...
    @property
    def manifest_json(self) -> str: ...


def job_json_digest(job_json: str) -> bytes:
    """The digest of a job given as canonical TrainConfig JSON, without a manifest."""
    return hashlib.sha384(JOB_LABEL + job_json.encode("utf-8")).digest()


def job_digest(config: JobFields) -> bytes:
    """The 48-byte digest of the job `config` runs: its manifest's, else its job_json's."""
    if not config.manifest_json:
        return job_json_digest(config.job_json)
    try:
        from gputravel.manifest import JobManifest  # lazy: pydantic, for manifest jobs only
    except ImportError:
        raise BadInput("manifests are not built yet") from None
    manifest = JobManifest.from_json(config.manifest_json)
    if not config.job_json:  # the orchestrator would run any job while the holders approved one
        raise BadInput("manifest_json: an orchestrator with a manifest is launched with the manifest's job "
                       "(job_json) too")
    from gputravel.train.job import TrainConfig  # lazy: pydantic

    differs = manifest.admits(TrainConfig.from_json(config.job_json))
    if differs:
        raise BadInput(f"job_json: the job differs from its manifest in {', '.join(differs)}")
    return manifest.digest()
