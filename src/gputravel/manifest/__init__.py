"""Job manifests (issue 28): what a holder approves by digest, and what may leave the orchestrator."""

from gputravel.manifest.files import load_manifest, manifest_from_toml, manifest_toml, write_manifest
from gputravel.manifest.model import DIGEST_BYTES, FORMAT, JobManifest
from gputravel.manifest.review import key_fingerprint
from gputravel.manifest.sections import (Broker, Data, Evaluation, JobSettings, Outputs, Recipient, Release, Workload,
                                         code_digest, schema_digest)

__all__ = ["DIGEST_BYTES", "FORMAT", "Broker", "Data", "Evaluation", "JobManifest", "JobSettings", "Outputs", "Recipient",
           "Release", "Workload", "code_digest", "key_fingerprint", "load_manifest",
           "manifest_from_toml", "manifest_toml", "schema_digest", "write_manifest"]
