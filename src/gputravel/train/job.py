"""The training job, described once (issue 26): `TrainConfig` is the one validated model that the
demo's options, the services' ``[job]`` table, checkpoints, the measured job (``canonical_json``,
which holders pin) and FedAvg all build or read, so a job has one set of defaults and rules.

A later part of the job is a nested `JobPart` with a default, so jobs written before it still read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from gputravel.errors import BadInput
from gputravel.train.schedule import POLICIES

WORKLOADS = ("gpt2", "image", "tabular")  # shipped (gputravel/workloads); any other name is a file's, with its code
LOADERS = ("travelling", "local", "baseline")  # baseline: the centralised TLS way (orchestrator/baseline.py)
MAX_THREADS = 256  # torch crashes far above
#: MiB the training process holds besides the model and its batch (about 300 measured, rounded up).
TORCH_MIB = 400


def _torch_seed(value: int) -> int:
    if not -(1 << 63) <= value < 1 << 64:  # what torch.manual_seed takes
        raise ValueError(f"an integer from -2^63 to 2^64 - 1 (torch's seeds), got {value}")
    return value


def _canonical_schema(text: str) -> str:
    from gputravel.data.records import RecordSchema  # lazy: numpy, for records jobs only

    try:
        return RecordSchema.from_json(text).canonical_json()
    except BadInput as exc:
        raise ValueError(f"record_schema: {exc}") from None


Positive = Annotated[int, Field(gt=0)]
Count = Annotated[int, Field(ge=0)]


class _SaysWhich(type(BaseModel)):  # type: ignore[misc]
    """Made in code, a job part that does not validate is a BadInput naming each bad value by its
    `key`; nested in another model, pydantic's ValidationError is left for that model's reader."""

    def __call__(cls, *args: Any, **values: Any) -> Any:
        try:
            return super().__call__(*args, **values)
        except ValidationError as exc:
            raise BadInput(cls.explain(exc)) from None


class JobPart(BaseModel, metaclass=_SaysWhich):
    """Strict about types (a quoted number is an error), no unknown key, frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    WHAT: ClassVar[str] = "a job part"  # how a refusal names what it read

    @classmethod
    def from_json(cls, text: str | bytes) -> Self:
        """The part `text` holds (as its canonical JSON wrote it); BadInput otherwise."""
        try:
            values = json.loads(text)
        except ValueError as exc:
            raise BadInput(f"{cls.WHAT}'s JSON is malformed ({exc})") from None
        if not isinstance(values, Mapping):
            raise BadInput(f"{cls.WHAT} is a table of settings, got {type(values).__name__}")
        return cls(**values)

    @classmethod
    def key(cls, loc: tuple[str, ...]) -> str:
        """How an error names the value at `loc`: its flag, ``--seq-len``."""
        return "--" + "-".join(loc).replace("_", "-")

    @classmethod
    def explain(cls, exc: ValidationError) -> str:
        """pydantic's errors, one line each: ``KEY: expected ..., got ...``."""
        lines = []
        for err in exc.errors():
            loc, msg = tuple(str(p) for p in err["loc"]), err["msg"].removeprefix("Value error, ")
            if err["type"] == "value_error" and not loc and ": " in msg:  # a check across values names its own
                name, _, msg = msg.partition(": ")
                loc = tuple(name.split("."))
            if err["type"] == "extra_forbidden":
                said = "unknown key"
            elif err["type"] == "missing":
                said = "missing (required)"
            elif err["type"] == "value_error":
                said = msg if msg.startswith("expected") else f"expected {msg}"
            else:
                said = f"expected {msg.removeprefix('Input should be ')}, got {err['input']!r}"
            lines.append(f"{cls.key(loc) if loc else 'job'}: {said}")
        return "\n".join(lines)


class TrainConfig(JobPart):
    WHAT: ClassVar[str] = "a training job"
    steps: Positive = 300
    batch: Positive = 8
    seq_len: Positive = 64
    buffer_bytes: Positive = 64 << 10  # the dataset buffer in the GPU's protected memory
    schedule: Literal[POLICIES] = "round_robin"  # type: ignore[valid-type]  # which holder the GPU visits next
    seed: Annotated[int, AfterValidator(_torch_seed)] = 0  # the model's initialisation and the sample's
    lr: Annotated[float, Field(gt=0, lt=1)] = 1e-3
    weight_decay: Annotated[float, Field(ge=0)] = 0.1
    warmup_steps: Count = 20
    n_layer: Positive = 6
    n_head: Positive = 4
    n_embd: Positive = 256  # a multiple of n_head
    vocab_size: Positive = 257  # the tokenizer's (the demo and `cohort init` set both from the holders' data)
    # data.tokenizer.KNOWN's names, written out: that module costs a service numpy's import (60 ms).
    tokenizer: Literal["bytes", "gpt2"] = "bytes"
    threads: Annotated[int, Field(gt=0, le=MAX_THREADS)] = 2  # same value, same losses
    sample_tokens: Count = 200  # text sampled at the end; 0: none
    checkpoint_every: Count = 100  # steps; 0: only at the end
    loader: Literal[LOADERS] = "travelling"  # type: ignore[valid-type]
    # Issue 27: what trains. A file's text travels in the job, so the measurement holders pin covers it.
    workload: Annotated[str, Field(min_length=1, max_length=128)] = "gpt2"
    workload_code: Annotated[str, Field(max_length=1 << 20)] = ""
    record_schema: str = ""  # the holders' record schema (data/records.py), canonical JSON; "": tokens
    eval_every: Count = 0  # steps between evaluations on the holders' held-out records; 0: only at the end
    script: bool = False  # workload_code is a training script with its own loop (workloads/script.py)
    # Issue 29: DP-SGD through Opacus to a target epsilon at dp_delta (0: no DP), each example's
    # gradient clipped to dp_max_grad_norm, the privacy spent counted by dp_accountant.
    dp_epsilon: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    dp_delta: Annotated[float, Field(gt=0, lt=1)] = 1e-5
    dp_max_grad_norm: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    dp_accountant: Literal["rdp", "prv", "gdp"] = "rdp"
    # Issue 31: gradients cast to this dtype before the sealed all-reduce of several GPUs (half the
    # bytes sealed and sent; other numerics, so off by default).
    ddp_compress: Literal["none", "fp16", "bf16"] = "none"
    # Issue 27: MiB of travelled records (or tokens) the orchestrator keeps in its own memory, so a
    # visit kept trains again without travelling (train/loader.py Kept); 0: every visit travels.
    resident_mib: Annotated[int, Field(ge=0, le=1 << 20)] = 0
    # Records: shuffled within each visit, or (all) in one shuffle over every holder's training records,
    # torch's DataLoader(shuffle=True) over them kept (train/whole.py); resident_mib must hold them.
    shuffle: Literal["visit", "all"] = "visit"

    @model_validator(mode="after")
    def _model_shape(self) -> TrainConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd: expected a multiple of n_head ({self.n_head}), got {self.n_embd}")
        if not self.workload_code and self.workload not in WORKLOADS:
            raise ValueError(f"workload: expected one of {', '.join(WORKLOADS)} or a workload file, got {self.workload!r}")
        if self.workload_code and self.workload in WORKLOADS:
            raise ValueError(f"workload: a workload file's name must not be a shipped one's ({self.workload!r}): rename it")
        if self.record_schema and _canonical_schema(self.record_schema) != self.record_schema:
            raise ValueError("record_schema: expected a schema's canonical JSON (data/records.py)")
        if self.script and not self.workload_code:
            raise ValueError("script: expected a script's text in workload_code")
        if self.dp_epsilon and not self.records:  # train/privacy.py: Poisson samples of whole records
            raise ValueError("dp_epsilon: expected 0 for GPT-2's token windows: DP-SGD trains on records (image, "
                             "tabular or a workload file: --workload)")
        if self.dp_epsilon and self.dp_accountant == "gdp":  # Opacus: "can underestimate privacy expenditure"
            raise ValueError("dp_accountant: expected rdp or prv: Opacus's gdp accountant is an approximation that "
                             "can understate the epsilon spent")
        if self.dp_epsilon and self.script:
            raise ValueError("dp_epsilon: expected 0 for a training script, which draws its own batches: gputravel "
                             "cannot sample them nor account for them (make it a workload file)")
        if self.shuffle == "all" and not self.records:
            raise ValueError("shuffle: expected visit for GPT-2's token windows (all shuffles records: --workload)")
        if self.resident_mib and self.dp_epsilon:  # train/privacy.py keeps them all, whatever this says
            raise ValueError("resident_mib: expected 0 with DP-SGD, which keeps every training record resident itself")
        if self.shuffle == "all" and self.dp_epsilon:
            raise ValueError("shuffle: expected visit with DP-SGD, which draws its own Poisson sample each step")
        if self.shuffle == "all" and not self.resident_mib:
            raise ValueError("resident_mib: expected the MiB every training record takes (at least 1) with shuffle "
                             "all, which keeps them all for the job")
        if self.workload == "gpt2" and not self.workload_code and self.record_schema:
            raise ValueError("workload: expected one that trains on records (image, tabular or a file: --workload), "
                             "got gpt2, which trains on tokens")
        return self

    @property
    def records(self) -> bool:
        """Does this job train on records (not GPT-2's token windows)?"""
        return bool(self.workload_code) or self.workload != "gpt2"

    @classmethod
    def from_dict(cls, values: object) -> TrainConfig:
        """The job `values` (as `to_dict` wrote them) describe; BadInput otherwise."""
        if not isinstance(values, Mapping):
            raise BadInput(f"a training job is a table of settings, got {type(values).__name__}")
        return cls(**values)

    def to_dict(self) -> dict:
        return self.model_dump()

    def canonical_json(self) -> str:
        """The job as JSON, one way only (keys sorted, no spaces): what is measured and pinned."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def replace(self, **changes: Any) -> TrainConfig:
        """This job with `changes`, checked as a new job is."""
        return type(self)(**{**self.to_dict(), **changes})

    def differences(self, other: TrainConfig | None) -> list[str]:
        """The settings in which `other` differs from this job (every one, if there is none)."""
        fields = type(self).model_fields
        return sorted(k for k in fields if other is None or getattr(other, k, None) != getattr(self, k))

    def params(self) -> int:
        """The model's parameters (train/model.py's GPT, lm_head tied to wte, block_size seq_len)."""
        c, layers = self.n_embd, self.n_layer
        return (self.vocab_size + self.seq_len) * c + layers * (12 * c * c + 13 * c) + 2 * c

    def memory_mib(self) -> int:
        """About the most memory one step takes, MiB: torch, 16 bytes a parameter (weights, grads,
        AdamW's moments) and backward's float32 activations (no T x T: SDPA's flash kernel on CPU).
        Checked against measured peaks: the demo's model, B 8, T 64 to 4096. A records workload's
        model is its own: torch's share only (the shipped ones are small)."""
        if self.records:
            return TORCH_MIB + 2 * self.resident_mib  # twice while kept records first arrive
        tokens = self.batch * self.seq_len
        activations = 4 * tokens * (20 * self.n_layer * self.n_embd + 3 * self.vocab_size + 2 * self.n_embd)
        return TORCH_MIB + 2 * self.resident_mib + -(-(16 * self.params() + activations) // (1 << 20))

