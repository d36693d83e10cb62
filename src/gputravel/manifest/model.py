"""The job manifest (issue 28): what a holder approves byte for byte. It names the workload by the
digest of its code, the training settings, the record schema's digest, the evaluation, the outputs
allowed to leave and the k-of-n release (the tables: sections.py).

Its digest is what the orchestrator extends into RTMR[3] and what a holder's policy lists.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import ClassVar, Literal

from pydantic import ValidationError, model_validator

from gputravel.manifest.review import describe_lines
from gputravel.manifest.sections import (ELSEWHERE, Broker, Data, Evaluation, JobSettings, Outputs, Part, Recipient,
                                         Release, Workload, code_digest, schema_digest)
from gputravel.train.job import TrainConfig

FORMAT = "gputravel-job-v1"
DIGEST_LABEL = b"gputravel job manifest v1\0"
DIGEST_BYTES = 48  # SHA-384, as a TDX RTMR


def _manifest_key(name: str) -> str:
    return ELSEWHERE.get(name, f"job.{name}")


class JobManifest(Part):
    WHAT: ClassVar[str] = "a job manifest"
    format: Literal["gputravel-job-v1"]
    workload: Workload
    job: JobSettings = JobSettings()
    data: Data = Data()
    evaluation: Evaluation = Evaluation()
    outputs: Outputs = Outputs()
    release: Release
    broker: Broker = Broker()

    @model_validator(mode="after")
    def _consistent(self) -> JobManifest:
        self._as_train_config()
        rel, records = self.release, self.workload.code != "" or self.workload.name != "gpt2"
        if len(set(rel.holders)) != len(rel.holders):
            raise ValueError(f"release.holders: expected each holder named once, got {rel.holders}")
        if not rel.holders:
            raise ValueError("release.holders: expected at least one holder who may sign")
        if rel.quorum > len(rel.holders):
            raise ValueError(f"release.quorum: expected at most {len(rel.holders)} (the holders named), got {rel.quorum}")
        certified = set(rel.certificates)
        if certified and certified != set(rel.holders):
            odd = sorted(certified ^ set(rel.holders))[0]
            raise ValueError(f"release.certificates: expected one for each holder in release.holders, or none; "
                             f"{odd!r} is in one and not the other")
        if len(set(rel.certificates.values())) != len(rel.certificates):
            raise ValueError("release.certificates: expected each holder's own certificate, got one named twice")
        names = [r.name for r in rel.recipients]
        if len(set(names)) != len(names):
            raise ValueError(f"release.recipients: expected each recipient named once, got {names}")
        if self.outputs.model == "release" and not rel.recipients:
            raise ValueError("release.recipients: expected at least one recipient, as outputs.model is \"release\" "
                             "(or set outputs.model = \"sealed\")")
        if records and not self.data.schema_digest:
            raise ValueError(f"data.schema: expected the record schema's digest: workload {self.workload.name!r} "
                             "trains on records (gputravel job init --schema-from DIR)")
        if not records and self.data.schema_digest:
            raise ValueError("data.schema: expected \"\": gpt2 trains on tokens, not records")
        if self.workload.file and not self.workload.code:
            raise ValueError("workload.file: expected \"\": a shipped workload has no file (workload.code is \"\")")
        if len(set(self.evaluation.metrics)) != len(self.evaluation.metrics):
            raise ValueError(f"evaluation.metrics: expected each metric named once, got {self.evaluation.metrics}")
        return self

    def _as_train_config(self) -> None:
        """TrainConfig's own rules across settings (n_embd a multiple of n_head, a file's name not a
        shipped one's...), checked on a stand-in for the code, whose text the manifest does not hold."""
        values = {**self.job.model_dump(), "workload": self.workload.name, "tokenizer": self.data.tokenizer,
                  "workload_code": "# stand-in" if self.workload.code else ""}
        try:
            TrainConfig.model_validate(values)
        except ValidationError as exc:
            err = exc.errors()[0]
            msg = err["msg"].removeprefix("Value error, ")
            if not err["loc"] and ": " in msg:
                name, _, msg = msg.partition(": ")
                raise ValueError(f"{_manifest_key(name)}: {msg}") from None
            raise ValueError(f"{_manifest_key(str(err['loc'][0]))}: {msg}") from None

    # ------------------------------------------------------------------ what the holders pin
    def to_json(self) -> str:
        """The manifest as JSON, one way only (keys sorted, no spaces): what is digested."""
        return json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"), allow_nan=False)

    def digest(self) -> bytes:
        """SHA-384 over a label and the canonical JSON: TOML layout, comments and order never change it."""
        return hashlib.sha384(DIGEST_LABEL + self.to_json().encode()).digest()

    def digest_hex(self) -> str:
        return self.digest().hex()

    # ------------------------------------------------------------------ manifests and jobs
    @classmethod
    def for_job(cls, cfg: TrainConfig, *, holders: Iterable[str], quorum: int,
                recipients: Iterable[Recipient | tuple[str, str | bytes]] = (), outputs: Outputs | None = None,
                evaluation: Evaluation | None = None, certificates: dict[str, str] | None = None,
                broker_key: str = "") -> JobManifest:
        """The manifest of the concrete job `cfg` (its code and schema by digest); BadInput naming the key."""
        file = f"{cfg.workload}.py" if cfg.workload_code else ""
        return cls(format=FORMAT,
                   workload=Workload(name=cfg.workload, code=code_digest(cfg.workload_code), file=file),
                   job=JobSettings(**cfg.model_dump(exclude=set(ELSEWHERE))),
                   data=Data(schema=schema_digest(cfg.record_schema), tokenizer=cfg.tokenizer),
                   evaluation=evaluation or Evaluation(), outputs=outputs or Outputs(),
                   release=Release(holders=list(holders), quorum=quorum,
                                   recipients=[r if isinstance(r, Recipient) else Recipient.of(*r) for r in recipients],
                                   certificates=dict(certificates or {})),
                   broker=Broker(identity=broker_key))

    def with_parties(self, certificates: dict[str, str], broker_key: str) -> JobManifest:
        """This manifest naming each signer's certificate and the key broker (a cohort's own, as its
        parties made them); BadInput naming the key at fault."""
        data = self.model_dump()
        data["release"]["certificates"] = dict(certificates)
        data["broker"] = {"identity": broker_key}
        return type(self).model_validate(data)

    def admits(self, cfg: TrainConfig) -> list[str]:
        """The keys in which the concrete job `cfg` differs from this manifest's; [] if it is its job."""
        theirs = {"workload.name": cfg.workload, "workload.code": code_digest(cfg.workload_code),
                  "data.schema": schema_digest(cfg.record_schema), "data.tokenizer": cfg.tokenizer,
                  **{f"job.{k}": v for k, v in cfg.model_dump(exclude=set(ELSEWHERE)).items()}}
        ours = {"workload.name": self.workload.name, "workload.code": self.workload.code,
                "data.schema": self.data.schema_digest, "data.tokenizer": self.data.tokenizer,
                **{f"job.{k}": v for k, v in self.job.model_dump().items()}}
        return sorted(k for k in ours if ours[k] != theirs.get(k))

    def recipient_keys(self) -> dict[str, bytes]:
        """Each recipient's raw X25519 public key, by name."""
        return {r.name: r.key_bytes() for r in self.release.recipients}

    def describe(self) -> str:
        """What a holder reviews before approving (`gputravel job show`), ending with the digest."""
        return "\n".join([f"job manifest ({self.format})",
                          *describe_lines(self.workload, self.job.model_dump(), self.data, self.evaluation,
                                          self.outputs, self.release, self.broker),
                          f"digest      {self.digest_hex()}"])

