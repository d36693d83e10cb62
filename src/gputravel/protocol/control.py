"""Supervisor <-> the processes it owns; no trust boundary (it stands for each CVM's launcher)."""

from __future__ import annotations

from gputravel.protocol.codec import Message
from gputravel.protocol.travel import ChunkInfo

#: Step names of the paper's Table 1, in cycle order (the keys of a TravelReport's steps).
STEPS = ("o_cleanup", "o_export", "dh_switch", "dh_import", "dh_copy", "dh_export", "tls", "o_switch", "o_import", "o_rotate")


class Ready(Message, tag="ctl.ready"):
    role: str
    detail: dict[str, int]


class JoinCohort(Message, tag="ctl.join"):
    host: str
    port: int


class AwaitHolders(Message, tag="ctl.await_holders"):
    names: tuple[str, ...]
    timeout: float


class Holders(Message, tag="ctl.holders"):
    dataset_bytes: dict[str, int]


class DoTravel(Message, tag="ctl.travel"):
    holder: str
    dataset_offset: int


# A travel is reported to the supervisor as the orchestrator's machine made it.
class TravelReport(Message, tag="report.travel"):
    travel_id: int
    holder: str
    chunk: ChunkInfo | None  # None when the holder refused
    steps_ms: dict[str, float]
    total_ms: float
    verify_ms: float
    refused: str | None
    nonzero_on_arrival: int  # what the holder's arrival audit found (-1: not audited)


# The centralised TLS baseline (paper 7.2; orchestrator/baseline.py), reported like a travel.
class DoBaseline(Message, tag="ctl.baseline"):
    """Supervisor -> orchestrator: fill the dataset buffer the baseline way."""

    holder: str
    dataset_offset: int


class BaselineReport(Message, tag="report.baseline"):
    travel_id: int
    holder: str
    chunk: ChunkInfo  # digest checked against the holder's manifest over what VRAM holds
    steps_ms: dict[str, float]  # read, tls, gpu_write
    total_ms: float  # request sent to GPU write done (verification not included, as for a travel)
    verify_ms: float


class Failed(Message, tag="ctl.failed"):
    kind: str  # the error class name
    reason: str


class Enroll(Message, tag="ctl.enroll"):
    """A member's CSR for the launcher's cohort CA: its private key never leaves it."""

    name: str
    csr_pem: bytes


class Certified(Message, tag="ctl.certified"):
    cert_pem: bytes
    ca_pem: bytes


# ----------------------------------------------------------------------------- membership
# Joining and leaving a running cohort (paper 4.5), in the order the supervisor drives.
class Joined(Message, tag="ctl.member.joined"):
    """Holder -> supervisor: attested the orchestrator and was welcomed."""

    holder: str
    measurement: bytes  # the orchestrator measurement its quote carried (and the policy pins)
    gpu_serial: str  # the GPU whose evidence (for the holder's nonce) the holder verified
    gpu_verified_at: int  # when the holder verified it (unix seconds)


class LendGpu(Message, tag="ctl.member.lend"):
    holder: str


class GpuLent(Message, tag="ctl.member.lent"):
    holder: str


class ProbeGpu(Message, tag="ctl.member.probe"):
    pass


class Probed(Message, tag="ctl.member.probed"):
    holder: str


class ReclaimGpu(Message, tag="ctl.member.reclaim"):
    pass


class GpuReclaimed(Message, tag="ctl.member.reclaimed"):
    pass


class Leave(Message, tag="ctl.member.leave"):
    reason: str


class Left(Message, tag="ctl.member.left"):
    holder: str


class AwaitDeparture(Message, tag="ctl.member.await_departure"):
    holder: str
    timeout: float


class Departed(Message, tag="ctl.member.departed"):
    holder: str
    reason: str


class Shutdown(Message, tag="ctl.shutdown"):
    pass


# Training configs and reports travel as JSON text: nested, heterogeneous, never untrusted.
class Train(Message, tag="ctl.train"):
    """Run a training job inside the orchestrator CVM, fed by travels (the TravellingLoader)."""

    config_json: str
    run_dir: str  # "" for none
    resume_checkpoint: str  # a checkpoint of this job to continue from; "" to start afresh
    # Data parallelism (issue 14; world_size 1: alone): rank 0's torch.distributed "host:port",
    # the ranks' interface ("": gloo's choice), every rank's holders, the pair keys' context.
    rank: int
    world_size: int
    master: str
    ifname: str
    shares: tuple[tuple[str, ...], ...]
    ranks_context: bytes


class TrainStep(Message, tag="ctl.train_step"):
    """One optimizer step done (streamed to the supervisor for the live view)."""

    step: int
    loss: float
    tokens_per_s: float
    holder: str
    travels: int
    stall_share: float
    elapsed_s: float
    evaluated: dict[str, float]  # held-out metrics over all holders, at an evaluation step (else empty)


class TrainDone(Message, tag="ctl.train_done"):
    report_json: str
