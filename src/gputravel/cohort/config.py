"""What a local cohort is made of, checked when it is made, so nothing starts on a bad one."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from gputravel.cohort.capacity import VRAM_MARGIN_MIB
from gputravel.cohort.links import check_link_config
from gputravel.cohort.trust import SharedRoots, TrustOptions
from gputravel.crypto.pki import MEMBER_NAME
from gputravel.errors import BadInput
from gputravel.files import EVAL_SHARE, RAW, DatasetFormat, check_split, dataset_kind
from gputravel.protocol.hardware import EMULATED, hardware_profile
from gputravel.protocol.layout import Layout


# A holder's name keys its uid, directories and certificate: never another party's (a holder named
# "device" would run under the GPU's uid and read its firmware key: docs/security.md, threat 49).
# Nor a rank's orchestrator's (orchestrator-K, the CN of its certificate on the services).
RESERVED_NAMES = frozenset({"orchestrator", "host", "device", "tdx-module", "ca"})
RESERVED_TEXT = f"none of {', '.join(sorted(RESERVED_NAMES))} or orchestrator-N"
_RANK_ORCHESTRATOR = re.compile(r"orchestrator-[0-9]+")


def is_holder_name(name: object) -> bool:
    return (isinstance(name, str) and MEMBER_NAME.fullmatch(name) is not None and name not in RESERVED_NAMES
            and _RANK_ORCHESTRATOR.fullmatch(name) is None)


@dataclass(frozen=True)
class HolderSpec:
    name: str
    dataset: str
    format: DatasetFormat = RAW  # files.py DATASET_FORMATS
    die_mid_copy_on_travel: int = 0  # fault injection (tests, red team): see HolderConfig
    eval_share: float = EVAL_SHARE  # a "records" dataset's held-out share and its seed: see HolderConfig
    eval_seed: int = 0
    sign_release: bool = True  # signs the release its approved job's manifest names (HolderConfig)


def _check_schema(text: str) -> None:
    from gputravel.data.records import RecordSchema  # lazy: numpy, for records only

    try:
        RecordSchema.from_json(text)
    except BadInput as exc:
        raise BadInput(f"schema: {exc}") from None


@dataclass(frozen=True)
class CohortConfig:
    holders: tuple[HolderSpec, ...]
    buffer_bytes: int
    vram_bytes: int = 0  # 0: buffer plus 64 MiB
    layout: Layout = field(default_factory=Layout)
    workdir: str | None = None
    snoop: bool = False  # the host records every CVM's unprotected memory (snoop.bin)
    tap: bool = False  # holders reach the orchestrator through a recording TCP tap (tap.bin)
    audit_arrival: bool = False
    tokenizer: str = ""  # for training: the tokenizer every holder's tokens must come from
    # For training on records: the schema every holder's records must have (canonical JSON); "": tokens.
    schema: str = ""
    # The orchestrator's signed travel log; None: audit.log in the cohort's directory.
    audit_log: str | None = None
    boot_timeout: float = 60.0
    travel_timeout: float = 120.0
    # How long the orchestrator and holders wait for the device; None: their own defaults.
    device_timeout: float | None = None
    # The holder<->orchestrator links (cohort/links.py): a cap per link and direction in Mbit/s
    # (None: uncapped), and the kind: "auto", "netns", "token-bucket", "none".
    bandwidth_mbit: float | None = None
    link: str = "auto"
    # The chain of trust (cohort/trust.py); the defaults give an honest cohort.
    trust: TrustOptions = field(default_factory=TrustOptions)
    # Holders enrolled now (certificate, policy) that boot and join later: Cohort.add_holder.
    late_holders: tuple[HolderSpec, ...] = ()
    # Each party under its own uid (cohort/isolation.py): None: whenever root; True insists.
    isolate: bool | None = None
    # Directories the orchestrator writes into (a run directory), lent to its uid while it runs.
    output_dirs: tuple[str, ...] = ()
    # The hardware profile (protocol/hardware.py): the paper's measured times, or none; never a security input.
    hardware: str = EMULATED
    # Several GPUs' cohorts share vendor roots, in memory only (None: fresh ones); the device is GPU-EMU-k.
    roots: SharedRoots | None = field(default=None, repr=False, compare=False)
    # The training job (TrainConfig.canonical_json), part of the measurement holders pin; "": any.
    job_json: str = ""
    # The job's manifest (manifest/, canonical JSON) the holders approved by digest; "": the job alone.
    manifest_json: str = ""
    # Where the key broker keeps its secret: a run that resumes from a sealed checkpoint needs the
    # same one (None: inside the cohort's directory, gone when it closes).
    broker_dir: str | None = None
    gpu_index: int = 0

    def __post_init__(self) -> None:
        names = [h.name for h in self.holders]
        if not names:
            raise BadInput("a cohort needs at least one data holder")
        names += [h.name for h in self.late_holders]
        if len(set(names)) != len(names):
            raise BadInput("data holder names must be unique")
        for name in names:
            if not is_holder_name(name):
                raise BadInput(f"data holder name {name!r} is invalid: use 1-32 characters from a-z, 0-9 and '-', "
                               f"and {RESERVED_TEXT}")
        if self.buffer_bytes <= 0 or self.buffer_bytes % self.layout.record_bytes:
            raise BadInput(f"buffer size must be a positive multiple of {self.layout.record_bytes} bytes")
        for h in self.holders + self.late_holders:
            try:
                kind = dataset_kind(h.format)
            except ValueError as exc:
                raise BadInput(f"holder {h.name!r}: {exc}") from None
            exists = Path(h.dataset).is_file() if kind == "file" else Path(h.dataset).exists()
            if not exists:
                raise BadInput(f"dataset of holder {h.name!r} not found: {h.dataset}")
            try:
                check_split(h.eval_share, h.eval_seed)
            except ValueError as exc:
                raise BadInput(f"holder {h.name!r}: {exc}") from None
        if self.schema:
            _check_schema(self.schema)
        if type(self.gpu_index) is not int or self.gpu_index < 0:
            raise BadInput(f"gpu_index must be a non-negative integer, not {self.gpu_index!r}")
        if self.roots is not None and not isinstance(self.roots, SharedRoots):
            raise BadInput("roots must be the SharedRoots of a multi-GPU launcher")
        check_link_config(self.link, self.bandwidth_mbit, self.tap)
        hardware_profile(self.hardware)  # BadInput for an unknown profile

    @property
    def device_vram(self) -> int:
        return self.vram_bytes or self.buffer_bytes + (VRAM_MARGIN_MIB << 20)
