"""Messages between the supervisor and the processes it owns (never crosses a trust boundary
of the threat model: the supervisor stands for whoever launches each CVM)."""

from __future__ import annotations

from dataclasses import dataclass

from gputravel.orchestrator.machine import TravelReport  # noqa: F401  (re-exported: travels are reported as is)
from gputravel.protocol.codec import message


@message("ctl.ready")
@dataclass(frozen=True)
class Ready:
    role: str
    detail: dict[str, int]


@message("ctl.join")
@dataclass(frozen=True)
class JoinCohort:
    host: str
    port: int


@message("ctl.await_holders")
@dataclass(frozen=True)
class AwaitHolders:
    names: tuple[str, ...]
    timeout: float


@message("ctl.holders")
@dataclass(frozen=True)
class Holders:
    dataset_bytes: dict[str, int]


@message("ctl.travel")
@dataclass(frozen=True)
class DoTravel:
    holder: str
    dataset_offset: int


@message("ctl.failed")
@dataclass(frozen=True)
class Failed:
    kind: str  # the error class name
    reason: str


@message("ctl.enroll")
@dataclass(frozen=True)
class Enroll:
    """A member asks the launcher's cohort CA to certify the key it made itself (a CSR:
    public material only; the private key never leaves the member)."""

    name: str
    csr_pem: bytes


@message("ctl.certified")
@dataclass(frozen=True)
class Certified:
    cert_pem: bytes
    ca_pem: bytes


@message("ctl.shutdown")
@dataclass(frozen=True)
class Shutdown:
    pass



# Training is driven over the control link; configs and reports are JSON text because they
# are nested and heterogeneous, and never cross a trust boundary.
@message("ctl.train")
@dataclass(frozen=True)
class Train:
    """Run a training job inside the orchestrator CVM, fed by travels (the TravellingLoader)."""

    config_json: str
    run_dir: str  # "" for none
    resume_checkpoint: str  # a checkpoint of this job to continue from; "" to start afresh


@message("ctl.train_step")
@dataclass(frozen=True)
class TrainStep:
    """One optimizer step done (streamed to the supervisor for the live view)."""

    step: int
    loss: float
    tokens_per_s: float
    holder: str
    travels: int
    stall_share: float
    elapsed_s: float


@message("ctl.train_done")
@dataclass(frozen=True)
class TrainDone:
    report_json: str
