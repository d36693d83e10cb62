"""One TOML file per party (issue 16): its schema, how it is read, and what is checked before
a service starts. Unknown keys and loose types are errors (a typo is never a silent default),
each a BadInput naming file and dotted key. No field holds a key: each party makes its own.
"""

from __future__ import annotations

import math

import os
import re
import socket
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError
from pydantic import field_validator, model_validator

from gputravel.attest.policy import GpuRequirements, Policy
from gputravel.attest.provision import REFERENCE_FILE
from gputravel.cohort.config import RESERVED_TEXT, is_holder_name
from gputravel.crypto.pki import MEMBER_NAME
from gputravel.errors import BadInput
from gputravel.files import EVAL_SHARE, TOKENS, DatasetFormat, dataset_kind
from gputravel.protocol.layout import MIB, PAGE, Layout
from gputravel.train.job import TrainConfig

if TYPE_CHECKING:  # the engine's module costs every other service 60 ms to import
    from gputravel.orchestrator.cvm import OrchestratorConfig

__all__ = ["BrokerService", "GpuService", "HolderService", "HostService", "JobSection", "LayoutSection", "OrchestratorService",
           "PolicySection", "ServiceConfig", "check_before_start", "explain_built", "gpu_socket", "host_party",
           "load_service", "orchestrator_engine_config", "orchestrator_party", "party_name", "public_file",
           "quoting_socket", "validate_service", "BROKER", "PARTIES", "MAX_SOCKET_PATH", "ORCHESTRATOR"]

PARTIES = ("host", "gpu", "orchestrator", "holder", "broker")
ORCHESTRATOR = "orchestrator"
BROKER = "broker"  # the key broker's party (broker/, standing for Trustee/KBS)
ORCHESTRATOR_PATTERN = r"^orchestrator(-[1-9][0-9]{0,2})?$"  # orchestrator_party's names
HEX64_PATTERN = r"^([0-9a-f]{64})?$"
NAME_PATTERN = f"^{MEMBER_NAME.pattern}$"  # the members' own rule (crypto/pki.py)
HEX96_PATTERN = r"^[0-9a-f]{96}$"
_KEYED = re.compile(r"^[a-z_.]+: ")
_SHOULD = re.compile(r"^(\w+) should (be|match|have) (.*)$", re.DOTALL)


def _absolute(value: str) -> str:
    if not os.path.isabs(value):
        raise ValueError(f"an absolute path, got {value!r}")
    return value


def _absolute_or_none(value: str) -> str:
    return _absolute(value) if value else value


def _power_of_two(value: int) -> int:
    if value & (value - 1) or not PAGE <= value <= 64 * MIB:
        raise ValueError(f"a power of two between {PAGE} and {64 * MIB}, got {value}")
    return value


# sun_path holds 108 bytes with the NUL: a longer path is refused by key here, not at bind time.
MAX_SOCKET_PATH = 107


def _fits_socket(value: str) -> str:
    size = len(os.fsencode(value))
    if size > MAX_SOCKET_PATH:
        raise ValueError(f"a path of at most {MAX_SOCKET_PATH} bytes, a Unix socket's limit, got {size} bytes: "
                         "choose a shorter directory for the cohort (the demo makes its own under $TMPDIR)")
    return value


def _fits_beside(key: str, what: str, socket_path: str) -> None:
    try:
        _fits_socket(socket_path)
    except ValueError as exc:
        raise ValueError(f"{key}: {what} beside it needs {exc}") from None


def gpu_socket(boot_lock: str) -> str:
    """The GPU's private-link socket lies beside its boot lock (run/gpu-K.sock, run/gpu-K.lock)."""
    return str(Path(boot_lock).with_suffix(".sock"))


def host_party(index: int) -> str:
    """The party name of GPU `index`'s host route; GPU 0's keeps the one-GPU name."""
    return "host" if index == 0 else f"host-{index}"


def orchestrator_party(rank: int) -> str:
    return ORCHESTRATOR if rank == 0 else f"{ORCHESTRATOR}-{rank}"


STATUS_FILE = "status.json"  # in a service's state_dir, and as the orchestrator publishes it
AUDIT_LOG = "audit.log"  # the orchestrator's signed travel log, in its state_dir and published


def public_file(orchestrator: str, name: str) -> str:
    """The public file `name` of `orchestrator` (a party name): rank K's prefixed (orchestrator-K-audit.log)."""
    return name if orchestrator == ORCHESTRATOR else f"{orchestrator}-{name}"


def quoting_socket(state_dir: str) -> str:
    """Where the orchestrator's TDX module listens: a directory of its own beside the orchestrator's state."""
    state = Path(state_dir)
    return str(state.parent / f"{state.name}-tdx" / "quote.sock")


AbsPath = Annotated[str, AfterValidator(_absolute)]
SocketPath = Annotated[str, AfterValidator(_absolute), AfterValidator(_fits_socket)]
Name = Annotated[str, Field(pattern=NAME_PATTERN)]


def _member(value: str) -> str:
    if not is_holder_name(value):  # the launcher's rule: a holder never takes another party's name
        raise ValueError(f"a holder's name: {RESERVED_TEXT}")
    return value


MemberName = Annotated[Name, AfterValidator(_member)]
Port = Annotated[int, Field(ge=1, le=65535)]
Seconds = Annotated[float, Field(gt=0)]
Hardware = Literal["emulated", "paper-h100"]  # protocol/hardware.py PROFILES (a test keeps them equal)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _not_root(value: int) -> int:
    if value == 0:
        raise ValueError("an account other than root's (uid 0): a party never runs as root; "
                         "-1 runs it as whoever starts its service")
    return value


# -1: the party runs as whoever starts its service; never 0 (security row 51)
Uid = Annotated[int, Field(ge=-1), AfterValidator(_not_root)]


class _Service(_Section):
    """Every party's file: its cohort (whose registry checks it), state directory and `uid` (its account as root)."""

    cohort_dir: AbsPath
    uid: Uid = -1
    state_dir: AbsPath

    _source: str = PrivateAttr(default="<config>")

    @property
    def source(self) -> str:
        return self._source


class LayoutSection(_Section):
    record_bytes: Annotated[int, AfterValidator(_power_of_two)] = MIB
    staging_slots: Annotated[int, Field(ge=2, le=256)] = 8
    gpfifo_entries: Annotated[int, Field(ge=4, le=4096)] = 64

    def to_layout(self) -> Layout:
        return Layout(self.record_bytes, self.staging_slots, self.gpfifo_entries)


class PolicySection(_Section):
    orchestrator_measurements: Annotated[list[Annotated[str, Field(pattern=HEX96_PATTERN)]], Field(min_length=1)]
    gpu_driver_versions: list[str] = []  # empty: any
    max_evidence_age_s: Annotated[int, Field(ge=2)] = 3600
    # The job manifests' digests (`gputravel job approve`) this holder sends data to; empty: none.
    approved_jobs: list[Annotated[str, Field(pattern=HEX96_PATTERN)]] = []
    # The key broker, the other signers and the recipients this holder confirmed with them (job approve
    # --broker, --signer, --recipient): a manifest naming others is refused (service/vouch.py).
    known_broker: Annotated[str, Field(pattern=r"^(sha256:[0-9a-f]{32})?$")] = ""
    known_signers: dict[Name, Annotated[str, Field(pattern=r"^[0-9a-f]{32,96}$")]] = {}
    known_recipients: dict[Name, Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{32}$")]] = {}
    # The epsilon (DP-SGD, issue 29) every job it approves may spend of its data together, counted in
    # its signed privacy ledger (service/budget.py); inf: no cap. A job without DP-SGD spends inf.
    epsilon_cap: Annotated[float, Field(gt=0)] = math.inf

    def to_policy(self, trust_dir: str) -> Policy:
        return Policy(tuple(bytes.fromhex(m) for m in self.orchestrator_measurements),
                      GpuRequirements(driver_versions=tuple(self.gpu_driver_versions)), self.max_evidence_age_s,
                      Path(trust_dir) / REFERENCE_FILE,
                      approved_jobs=tuple(bytes.fromhex(j) for j in self.approved_jobs))


class JobSection(TrainConfig):
    """The training job (train/job.py) and its run directory; trained on what the GPU brings."""

    run_dir: AbsPath

    @classmethod
    def key(cls, loc: tuple[str, ...]) -> str:
        return ".".join(("job", *loc))

    @field_validator("loader")
    @classmethod
    def _on_the_gpu(cls, value: str) -> str:
        if value == "local":
            raise ValueError("'travelling' or 'baseline' (the services train on what the GPU brings), got 'local'")
        return value

    @field_validator("buffer_bytes")
    @classmethod
    def _whole_pages(cls, value: int) -> int:
        if value % PAGE:
            raise ValueError(f"a multiple of {PAGE} (whole pages of the GPU's memory), got {value}")
        return value

    def train_config(self) -> TrainConfig:
        return TrainConfig(**self.model_dump(exclude={"run_dir"}))


class HostService(_Service):
    party: Literal["host"]
    index: Annotated[int, Field(ge=0)] = 0  # the GPU whose host route this is (host_party)
    socket: SocketPath
    hardware: Hardware = "emulated"


class GpuService(_Service):
    party: Literal["gpu"]
    index: Annotated[int, Field(ge=0)] = 0
    host_socket: SocketPath
    link_socket: SocketPath  # where the orchestrator takes its private link (VRAM grants)
    boot_lock: AbsPath  # held while a CVM probes the GPU at boot (paper 4.1: one at a time)
    vram_bytes: Annotated[int, Field(gt=0)]
    layout: LayoutSection
    orchestrator_uid: Uid = -1  # the only peer the GPU hands VRAM to on its link (-1: any local process)

    @property
    def serial(self) -> str:
        return f"GPU-EMU-{self.index}"


class OrchestratorService(_Service):
    party: Literal["orchestrator"]
    host_socket: SocketPath
    gpu_link_socket: SocketPath
    boot_lock: AbsPath
    trust_dir: AbsPath
    public_dir: AbsPath
    listen_host: str = "127.0.0.1"
    listen_port: Port
    holders: Annotated[list[MemberName], Field(min_length=1)]
    hardware: Hardware = "emulated"
    device_timeout: Seconds = 10.0
    holder_timeout: Seconds = 60.0
    max_evidence_age_s: Annotated[int, Field(ge=2)] = 3600
    layout: LayoutSection
    job: JobSection
    tdx_uid: Uid = -1  # its TDX module's own account (the module stands for the CPU)
    # Several GPUs: rank `rank` of one job; `shares`, every rank's holders (empty: one GPU). The
    # ranks meet at rank 0's ranks_host:ranks_port and bind their keys to ranks_context.
    rank: Annotated[int, Field(ge=0)] = 0
    shares: list[list[Name]] = []
    ranks_host: str = "127.0.0.1"
    ranks_port: Annotated[int, Field(ge=0, le=65535)] = 0
    ranks_context: Annotated[str, Field(pattern=HEX64_PATTERN)] = ""
    # Where the key broker that seals its checkpoints and model listens. Its identity, and the
    # certificates release signatures count under, are what the job's manifest names, as the broker and
    # each holder made them (service/job.py); never this file's, which its operator writes.
    broker_socket: Annotated[str, AfterValidator(_absolute_or_none), AfterValidator(_fits_socket)] = ""
    # The job manifest its holders approve by digest (canonical JSON, gputravel.manifest); "": the job alone.
    manifest_json: str = ""

    @field_validator("holders")
    @classmethod
    def _holders(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"unique member names, got {value}")
        return value

    @model_validator(mode="after")
    def _its_share(self) -> OrchestratorService:
        if not self.shares:
            if self.rank or self.ranks_port or self.ranks_context:
                raise ValueError("rank: expected 0 with no ranks_port and no ranks_context: shares is empty (one GPU)")
            return self
        if len(self.shares) < 2 or self.rank >= len(self.shares):
            raise ValueError(f"shares: expected one share for each of 2 or more ranks, rank {self.rank} among them, "
                             f"got {len(self.shares)}")
        placed = [n for share in self.shares for n in share]
        if len(set(placed)) != len(placed) or not all(self.shares):
            raise ValueError(f"shares: expected every share non-empty and a holder in one share only (a holder "
                             f"serves one GPU), got {self.shares}")
        if sorted(self.holders) != sorted(self.shares[self.rank]):
            raise ValueError(f"holders: expected this rank's share {self.shares[self.rank]}, got {self.holders}")
        if not self.ranks_port or not self.ranks_context:
            raise ValueError("ranks_port: expected rank 0's port and a ranks_context with several ranks")
        return self

    @property
    def world_size(self) -> int:
        return max(1, len(self.shares))

    @model_validator(mode="after")
    def _fits(self) -> OrchestratorService:
        _fits_beside("state_dir", "its TDX module's socket", quoting_socket(self.state_dir))
        if self.manifest_json:
            _manifest_admits(self.manifest_json, self.job)
        if self.job.buffer_bytes % self.layout.record_bytes:
            raise ValueError(f"job.buffer_bytes: expected a multiple of layout.record_bytes "
                             f"({self.layout.record_bytes}), got {self.job.buffer_bytes}")
        return self


def party_name(cfg: ServiceConfig) -> str:
    """The party a service's config is for, as it logs and registers ("gpu-0", "holder-north", ...)."""
    if isinstance(cfg, GpuService):
        return f"gpu-{cfg.index}"
    if isinstance(cfg, HolderService):
        return f"holder-{cfg.name}"
    if isinstance(cfg, HostService):
        return host_party(cfg.index)
    if isinstance(cfg, BrokerService):
        return BROKER
    return orchestrator_party(cfg.rank)


def orchestrator_engine_config(cfg: OrchestratorService, *, pki_dir: str, trust_dir: str) -> OrchestratorConfig:
    """The engine's config; its placement is not measured, so init's measurement is the running service's."""
    from gputravel.orchestrator.cvm import OrchestratorConfig  # lazy: every other service would pay 60 ms

    return OrchestratorConfig(
        host_socket=cfg.host_socket, pki_dir=pki_dir, layout=cfg.layout.to_layout(),
        buffer_bytes=cfg.job.buffer_bytes, listen_host=cfg.listen_host, listen_port=cfg.listen_port,
        holder_timeout=cfg.holder_timeout, device_timeout=cfg.device_timeout,
        # As the demo (jobs/training.py): holders whose tokens came from another tokenizer, or whose
        # records have another schema than the job's, are refused.
        tokenizer=cfg.job.tokenizer, schema=cfg.job.record_schema,
        trust_dir=trust_dir, audit_log=os.path.join(cfg.state_dir, AUDIT_LOG), hardware=cfg.hardware,
        # The job (and its manifest) go into RTMR[3], which a holder's policy approves by digest.
        job_json=cfg.job.train_config().canonical_json(), manifest_json=cfg.manifest_json,
        broker_socket=cfg.broker_socket)


def _manifest_admits(manifest_json: str, job: JobSection) -> None:
    """The orchestrator runs the manifest's job and no other (orchestrator/job.py checks it again)."""
    from gputravel.manifest import JobManifest  # lazy: for configs with a manifest only

    try:
        differs = JobManifest.from_json(manifest_json).admits(job.train_config())
    except BadInput as exc:
        raise ValueError(f"manifest_json: expected a job manifest's JSON: {str(exc).splitlines()[0]}") from None
    if differs:
        raise ValueError(f"job: expected the manifest's job; it differs in {', '.join(differs)}")


class HolderService(_Service):
    party: Literal["holder"]
    name: MemberName
    host_socket: SocketPath
    boot_lock: AbsPath  # the GPU's socket lies beside it (gpu_socket), checked below
    trust_dir: AbsPath
    public_dir: AbsPath
    data: AbsPath
    format: DatasetFormat = TOKENS  # the data of a training job (files.py DATASET_FORMATS)
    # A "records" dataset's held-out share, never trained on, and the seed that picks it (HolderConfig).
    eval_share: Annotated[float, Field(ge=0, lt=1)] = EVAL_SHARE
    eval_seed: Annotated[int, Field(ge=0)] = 0
    orchestrator: Annotated[str, Field(pattern=ORCHESTRATOR_PATTERN)] = ORCHESTRATOR  # the party it joins
    orchestrator_host: str = "127.0.0.1"
    orchestrator_port: Port
    hardware: Hardware = "emulated"
    device_timeout: Seconds = 30.0
    layout: LayoutSection
    policy: PolicySection
    # Sign the release of a job's model to the recipients its approved manifest names (false: decline).
    sign_release: bool = True

    @model_validator(mode="after")
    def _gpu_socket_fits(self) -> HolderService:
        _fits_beside("boot_lock", "the GPU's socket", gpu_socket(self.boot_lock))
        return self


class BrokerService(_Service):
    """The key broker: it releases keys only to an orchestrator quoting one of `accepted_measurements`
    (MRTDs, which cohort init computes as it does the holders' pins), bound to its quoted job."""

    party: Literal["broker"]
    socket: SocketPath
    trust_dir: AbsPath  # holds the CPU-TEE quoting root's certificate
    accepted_measurements: Annotated[list[Annotated[str, Field(pattern=HEX96_PATTERN)]],
                                     Field(min_length=1, max_length=64)]

    def broker_config(self, state_dir: str) -> dict:
        """broker/process.py BrokerConfig's keys, its state where the service keeps it."""
        return {"socket": self.socket, "state_dir": state_dir, "trust_dir": self.trust_dir,
                "accepted_measurements": list(self.accepted_measurements)}


ServiceConfig = Union[HostService, GpuService, OrchestratorService, HolderService, BrokerService]
_ANY = TypeAdapter(Annotated[ServiceConfig, Field(discriminator="party")])


def _read_toml(path: Path) -> dict:
    if path.exists() and not path.is_file():  # a FIFO would block the read, a device never end it
        raise BadInput(f"{path}: not a regular file")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise BadInput(f"{path}: not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"{path}: cannot be read ({exc.__class__.__name__})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once a level: a few hundred nested arrays or tables
        raise BadInput(f"{path}: not valid TOML: nested too deeply") from None


def _explain(err: dict) -> str:
    kind, loc = err["type"], [str(part) for part in err["loc"]]
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        got = f", got {err['input'].get('party')!r}" if "party" in err["input"] else " (missing)"
        return f"party: expected one of {', '.join(map(repr, PARTIES))}{got}"
    key = ".".join(loc[1:])  # loc[0] is the party's tag
    msg = err["msg"].removeprefix("Value error, ")
    if kind == "extra_forbidden":
        return f"{key}: unknown key"
    if kind == "missing":
        return f"{key}: missing (required)"
    if kind == "value_error" and _KEYED.match(msg):  # a check across keys names its key itself
        return f"{key}.{msg}" if key else msg
    got = "" if kind == "value_error" else f", got {err['input']!r}"
    return f"{key}: expected {_expectation(msg)}{got}"


def _expectation(msg: str) -> str:
    """pydantic's "String should match pattern 'p'" as "a string matching pattern 'p'"."""
    found = _SHOULD.match(msg)
    if found is None:
        return msg
    subject, verb, rest = found.group(1).lower(), found.group(2), found.group(3)
    if verb == "be":
        return rest
    return f"a {subject} {'matching' if verb == 'match' else 'with'} {rest}"


def validate_service(raw: dict, source: str, party: str | None = None) -> ServiceConfig:
    if party is not None and raw.get("party") != party:
        raise BadInput(f"{source}: party: expected {party!r} (the role being started), got {raw.get('party')!r}")
    try:
        cfg = _ANY.validate_python(raw)
    except ValidationError as exc:
        raise BadInput("\n".join(f"{source}: {_explain(e)}" for e in exc.errors())) from None
    cfg._source = source
    return cfg


def explain_built(exc: ValidationError, source: str) -> BadInput:
    """A config built in code (`cohort init`) that its schema refuses, worded as a file's."""
    return BadInput("\n".join(f"{source}: {_explain({**e, 'loc': ('', *e['loc'])})}" for e in exc.errors()))


def load_service(path: str | Path, party: str | None = None) -> ServiceConfig:
    """Read and validate one party's TOML file; `party` given: it must be that party's."""
    path = Path(path)
    return validate_service(_read_toml(path), str(path), party)


def _paths(cfg: ServiceConfig) -> list[tuple[str, str, str]]:
    checks = [(key, os.path.dirname(getattr(cfg, key)), "directory") for key in
              ("state_dir", "socket", "host_socket", "link_socket", "gpu_link_socket", "boot_lock") if hasattr(cfg, key)]
    checks += [(key, getattr(cfg, key), "directory") for key in ("trust_dir", "public_dir") if hasattr(cfg, key)]
    if isinstance(cfg, HolderService):
        checks.append(("data", cfg.data, dataset_kind(cfg.format)))
    return checks


def _port_free(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on, or None (with SO_REUSEADDR, as the real listener)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot resolve {host!r} ({exc.strerror or exc})"
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            return f"{host}:{port} is not free ({exc.strerror or exc})"
    return None


def check_before_start(cfg: ServiceConfig) -> None:
    """What can be checked before anything starts, beyond the schema; BadInput names file and key."""
    problems = []
    for key, path, kind in _paths(cfg):
        ok = {"directory": os.path.isdir, "file": os.path.isfile, "path": os.path.exists}[kind](path)
        if not ok:
            problems.append(f"{key}: expected an existing {kind} {path!r}")
    if isinstance(cfg, OrchestratorService):
        why = _port_free(cfg.listen_host, cfg.listen_port)
        if why:
            problems.append(f"listen_port: expected a free port: {why}")
    if problems:
        raise BadInput("\n".join(f"{cfg.source}: {p}" for p in problems))
