"""What a local cohort is made of: its data holders and how the supervisor runs it.

A :class:`CohortConfig` is checked when it is made (unique names, datasets that exist, a
buffer of whole records, a link the machine can give), so nothing starts on a bad one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gputravel.cohort.capacity import VRAM_MARGIN_MIB
from gputravel.cohort.links import check_link_config
from gputravel.cohort.trust import SharedRoots, TrustOptions
from gputravel.crypto.pki import MEMBER_NAME
from gputravel.errors import BadInput
from gputravel.files import RAW, DatasetFormat, dataset_kind
from gputravel.protocol.hardware import EMULATED, hardware_profile
from gputravel.protocol.layout import Layout


# A data holder's name keys its process, uid, directories and certificate in the cohort: the
# members' own rule (crypto/pki.MEMBER_NAME, what a holder checks at boot), checked here
# before anything is made for it, and never a name the cohort's other parties are keyed by. A
# holder named "device" would otherwise run under the emulated GPU's uid (the second hostile
# review of session 23 showed it reading the GPU's firmware key).
RESERVED_NAMES = frozenset({"orchestrator", "host", "device", "tdx-module", "ca"})


def is_holder_name(name: object) -> bool:
    """Whether `name` may name a data holder (the launcher's rule, and `cohort init`'s)."""
    return isinstance(name, str) and MEMBER_NAME.fullmatch(name) is not None and name not in RESERVED_NAMES


@dataclass(frozen=True)
class HolderSpec:
    name: str
    dataset: str
    format: DatasetFormat = RAW  # files.py DATASET_FORMATS
    die_mid_copy_on_travel: int = 0  # fault injection (tests, red team): see HolderConfig


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
    # The orchestrator's signed travel log (orchestrator/travel_log.py); None: audit.log in the
    # cohort's directory (gone with it unless `workdir` is set).
    audit_log: str | None = None
    boot_timeout: float = 60.0
    travel_timeout: float = 120.0
    # How long the orchestrator and holders wait for the device (a semaphore, an RPC, a switch);
    # None: their own defaults. The red team makes it small so dropped pushes time out quickly.
    device_timeout: float | None = None
    # The holder<->orchestrator links (cohort/links.py): a cap per link and direction in
    # Mbit/s (None: uncapped), and the kind: "auto" (netns-tc when capped and namespaces work,
    # else the in-process token bucket; no shaping when uncapped), "netns", "token-bucket", "none".
    bandwidth_mbit: float | None = None
    link: str = "auto"
    # The chain of trust (cohort/trust.py): the defaults give an honest cohort; tests break one
    # link on purpose to see it refused.
    trust: TrustOptions = field(default_factory=TrustOptions)
    # Holders enrolled now (certificate, policy) that boot and join later: Cohort.add_holder.
    late_holders: tuple[HolderSpec, ...] = ()
    # Each party under its own uid, non-dumpable (cohort/isolation.py): None (auto) whenever
    # the launcher is root; False turns it off; True insists (BadInput without root).
    isolate: bool | None = None
    # Directories the orchestrator writes into (a training run directory): lent to its uid
    # while the cohort runs, given back at close. Paths in them reach it however deep they lie.
    output_dirs: tuple[str, ...] = ()
    # The hardware the cohort stands for (protocol/hardware.py): "emulated" injects nothing;
    # "paper-h100" holds the switches, the copy, the baseline's read and write and the context
    # exchange to the paper's measured times. Never a security input.
    hardware: str = EMULATED
    # Several GPUs (cohort/gpus.py): every GPU chains to one GPU vendor root and every TDX quote
    # to one CPU-TEE root, as in reality. `roots` are those roots, in the multi-GPU launcher's
    # memory only (it drops them once every cohort has booted); None: this cohort makes fresh
    # roots of its own. `gpu_index` k names this cohort's device GPU-EMU-k.
    roots: SharedRoots | None = field(default=None, repr=False, compare=False)
    # The training job the orchestrator runs (train/job.py TrainConfig.canonical_json): part of its measurement,
    # which the holders pin; "": any job (a cohort that travels, or the red team's).
    job_json: str = ""
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
                               f"and none of {', '.join(sorted(RESERVED_NAMES))}")
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

        if type(self.gpu_index) is not int or self.gpu_index < 0:
            raise BadInput(f"gpu_index must be a non-negative integer, not {self.gpu_index!r}")
        if self.roots is not None and not isinstance(self.roots, SharedRoots):
            raise BadInput("roots must be the SharedRoots of a multi-GPU launcher")
        check_link_config(self.link, self.bandwidth_mbit, self.tap)
        hardware_profile(self.hardware)  # BadInput for an unknown profile

    @property
    def device_vram(self) -> int:
        return self.vram_bytes or self.buffer_bytes + (VRAM_MARGIN_MIB << 20)
