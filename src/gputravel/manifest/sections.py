"""The tables of a job manifest (issue 28), each validated strictly, its errors naming the TOML key.
[job] is built from TrainConfig's own fields, so the manifest and the one job schema never drift.
"""

from __future__ import annotations


import hashlib
import re
from typing import Annotated, Literal

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
from pydantic import AfterValidator, ConfigDict, Field, ValidationError, create_model

from gputravel.crypto.pki import MEMBER_NAME
from gputravel.files import EVAL_SHARE
from gputravel.train.job import JobPart, TrainConfig

# TrainConfig's settings named in [workload] and [data] rather than [job]: one value, one place.
ELSEWHERE = {"workload": "workload.name", "workload_code": "workload.code", "record_schema": "data.schema",
             "tokenizer": "data.tokenizer"}
_HEX = frozenset("0123456789abcdef")


def _hex(size: int, what: str) -> AfterValidator:
    def check(value: str) -> str:
        if value and (len(value) != size or not set(value) <= _HEX):
            raise ValueError(f"{size} lowercase hex digits ({what}) or \"\", got {value[:120]!r}")
        return value
    return AfterValidator(check)


def _name(value: str) -> str:
    if not MEMBER_NAME.fullmatch(value):
        raise ValueError(f"a name of {MEMBER_NAME.pattern}, got {value[:64]!r}")
    return value


def _x25519(value: str) -> str:
    try:
        raw = bytes.fromhex(value)
        X25519PublicKey.from_public_bytes(raw)
    except ValueError:
        raise ValueError(f"a raw X25519 public key, 64 hex digits, got {value[:80]!r}") from None
    if value != raw.hex():
        raise ValueError(f"a raw X25519 public key in lowercase hex, got {value[:80]!r}")
    return value


# What a reviewer reads on a terminal: no control character or escape can redraw what `job show` prints.
_PRINTABLE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


def _file_name(value: str) -> str:
    if value and (not _PRINTABLE.fullmatch(value) or value in (".", "..")):
        raise ValueError(f"a file's name of letters, digits, '.', '_' and '-', without a directory, got {value[:64]!r}")
    return value


def _workload_name(value: str) -> str:
    if not _PRINTABLE.fullmatch(value) or len(value) > 128:
        raise ValueError(f"a workload's name of letters, digits, '.', '_' and '-' (at most 128), got {value[:64]!r}")
    return value


def _metric(value: str) -> str:
    if not value.isidentifier() or not value.isascii() or len(value) > 64:
        raise ValueError(f"a metric's name (a Python identifier, as a workload's evaluate returns), got {value[:64]!r}")
    return value


def _indexed(exc: ValidationError) -> ValidationError:
    """`exc` with list positions in its locations written ``[0]``, as a TOML reader counts them."""
    errors = [{**e, "loc": tuple(f"[{p}]" if isinstance(p, int) else p for p in e["loc"])} for e in exc.errors()]
    return ValidationError.from_exception_data(exc.title, errors)  # type: ignore[arg-type]


Hex96 = Annotated[str, _hex(96, "a SHA-384")]
Hex64 = Annotated[str, _hex(64, "a SHA-256")]


class Part(JobPart):  # type: ignore[metaclass]  # JobPart's metaclass derives from pydantic's at runtime
    """A manifest table: errors name the TOML key (``release.quorum``), not a flag."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, serialize_by_alias=True)

    @classmethod
    def key(cls, loc: tuple[str, ...]) -> str:
        return ".".join(loc).replace(".[", "[")  # release.recipients[0].public_key

    @classmethod
    def explain(cls, exc: ValidationError) -> str:
        return super().explain(_indexed(exc))


# [job]: every TrainConfig setting but those named elsewhere, with TrainConfig's types, bounds and defaults.
JobSettings = create_model(  # type: ignore[call-overload]
    "JobSettings", __base__=Part,
    **{k: (f.annotation, f) for k, f in TrainConfig.model_fields.items() if k not in ELSEWHERE})


class Workload(Part):
    name: Annotated[str, AfterValidator(_workload_name)]  # TrainConfig.workload
    code: Hex96 = ""  # SHA-384 of the workload file's text; "": a shipped workload
    file: Annotated[str, AfterValidator(_file_name)] = ""  # the file's name, for review only


class Data(Part):
    schema_digest: Annotated[Hex64, Field(alias="schema")] = ""  # RecordSchema.digest(); "": tokens
    tokenizer: Literal["bytes", "gpt2"] = "bytes"  # TrainConfig.tokenizer: data.tokenizer.KNOWN's names


class Evaluation(Part):
    share: Annotated[float, Field(ge=0, lt=1)] = EVAL_SHARE  # held out by each holder, never trained on
    metrics: list[Annotated[str, AfterValidator(_metric)]] = ["loss", "accuracy"]


class Outputs(Part):
    model: Literal["release", "sealed"] = "release"  # release: to the recipients after a quorum signs
    checkpoints: Literal["sealed", "none"] = "sealed"
    samples: bool = False  # generated text can repeat training data word for word
    metrics: bool = True  # report.json, metrics.csv and plots in the run directory


class Recipient(Part):
    name: Annotated[str, AfterValidator(_name)]
    public_key: Annotated[str, AfterValidator(_x25519)]

    @classmethod
    def of(cls, name: str, key: str | bytes | X25519PublicKey) -> Recipient:
        """A recipient from its key: raw bytes, hex, or the key itself."""
        if isinstance(key, X25519PublicKey):
            key = key.public_bytes_raw()
        return cls(name=name, public_key=key.hex() if isinstance(key, bytes) else key)

    def key_bytes(self) -> bytes:
        return bytes.fromhex(self.public_key)


def _certificate(value: str) -> str:
    if len(value) != 96 or not set(value) <= _HEX:
        raise ValueError(f"a certificate's SHA-384, 96 lowercase hex digits, got {value[:120]!r}")
    return value


def _broker_key(value: str) -> str:
    if not value:
        return value
    try:
        key = serialization.load_der_public_key(bytes.fromhex(value))
    except ValueError:
        key = None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP384R1) \
            or value != bytes.fromhex(value).hex():
        raise ValueError(f"a key broker's P-384 public key (SubjectPublicKeyInfo DER, lowercase hex), got {value[:80]!r}")
    return value


Certificates = dict[Annotated[str, AfterValidator(_name)], Annotated[str, AfterValidator(_certificate)]]


class Release(Part):
    holders: list[Annotated[str, AfterValidator(_name)]]  # the n who may sign (a cohort's holder names)
    quorum: Annotated[int, Field(ge=1)]  # k
    recipients: list[Recipient] = []
    # Each signer's own TLS certificate (SHA-384 of its DER), which it made itself: a signature counts
    # only under it. {}: the certificates the orchestrator's measurement binds (a local cohort's CA).
    certificates: Certificates = {}


class Broker(Part):
    # The key broker that seals the checkpoints and the model; "": the one the orchestrator's measurement names.
    identity: Annotated[str, AfterValidator(_broker_key)] = ""


def code_digest(text: str) -> str:
    """SHA-384 hex of a workload file's text; "" for none (a shipped workload)."""
    return hashlib.sha384(text.encode()).hexdigest() if text else ""


def schema_digest(schema_json: str) -> str:
    """The record schema's digest (data/records.py); "" for a token job."""
    if not schema_json:
        return ""
    from gputravel.data.records import RecordSchema  # lazy: numpy, for records jobs only

    return RecordSchema.from_json(schema_json).digest()
