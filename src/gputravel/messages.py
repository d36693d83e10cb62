"""Every message that crosses a trust boundary, as frozen dataclasses registered with the wire codec.

Grouped by who speaks:
- pushes: method streams a driver encrypts into a push buffer for the device to execute;
- rpc: the GSP-style RPC queue (plaintext only for the SPDM handshake, encrypted after);
- host: the PCIe MUX's control plane (CVM <-> host <-> device), with descriptors alongside;
- travel: orchestrator <-> data holder over TLS.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .crypto import spdm as _spdm
from .wire import message

# ============================================================================ key labels
#: Labels of the keys a data holder receives in a context blob (one key per CE keyspace and
#: direction, as H100 does: e.g. ``Lce00_h2d_user``).
USER_LABELS = (
    "Lwlc_h2d_user",  # pushes on the user work-launch channel
    "Llcic_d2h_user",  # its tracking-semaphore payloads
    "Lce00_h2d_user",  # bulk copy records into VRAM
    "Lce00_d2h_user",  # bulk copy records out of VRAM
    "Lgsp_h2d_user",  # RPC requests
    "Lgsp_d2h_user",  # RPC responses
)
#: Labels of the orchestrator's privileged channel: scrub, rotate, reset. Never exported, so a
#: holder (even colluding with the host) cannot forge a rotation or its completion.
KERNEL_LABELS = ("Lwlc_h2d_kernel", "Llcic_d2h_kernel")
ALL_LABELS = USER_LABELS + KERNEL_LABELS
#: Push key and tracking-semaphore key of each work-launch channel (index: layout.PushChannel).
PUSH_LABEL = ("Lwlc_h2d_user", "Lwlc_h2d_kernel")
SEM_LABEL = ("Llcic_d2h_user", "Llcic_d2h_kernel")


# ============================================================================ pushes
@message("push.copy_to_vram")
@dataclass(frozen=True)
class CopyToVram:
    """Decrypt one record from a staging slot (IOVA) into VRAM at ``dst_offset``."""

    src_iova: int
    nbytes: int
    dst_offset: int
    release: int  # tracking-semaphore value to release afterwards (0: none)
    interrupt: bool


@message("push.copy_from_vram")
@dataclass(frozen=True)
class CopyFromVram:
    """Encrypt ``nbytes`` of VRAM at ``src_offset`` into a staging slot (IOVA)."""

    src_offset: int
    nbytes: int
    dst_iova: int
    release: int
    interrupt: bool


@message("push.memset")
@dataclass(frozen=True)
class Memset:
    """Scrub: fill a VRAM range with ``value`` (kernel channel only)."""

    offset: int
    nbytes: int
    value: int
    release: int
    interrupt: bool


@message("push.rotate")
@dataclass(frozen=True)
class RotateKeys:
    """Move every channel to the keys of ``epoch`` (kernel channel only).

    Also clears a faulted user channel and discards its pending GPFIFO entries: after a
    rotation the device and the orchestrator agree on fresh counters again.
    """

    epoch: int
    release: int
    interrupt: bool


@message("push.grant_window")
@dataclass(frozen=True)
class GrantWindow:
    """Open the VRAM range the user channel may copy to and from (kernel channel only).

    The orchestrator grants exactly the dataset buffer, so a holder holding the user keys
    can reach that buffer and nothing else of protected memory (model, other allocations).
    """

    offset: int
    nbytes: int
    release: int
    interrupt: bool


@message("push.semaphore")
@dataclass(frozen=True)
class SemaphoreRelease:
    release: int
    interrupt: bool


# ============================================================================ RPC queue
@message("rpc.device_info")
@dataclass(frozen=True)
class GetDeviceInfo:
    pass


@message("rpc.device_info.reply")
@dataclass(frozen=True)
class DeviceInfo:
    serial: str
    vram_bytes: int
    layout_digest: str
    session: bool
    work_tokens: tuple[int, int]  # work submission tokens of the USER and KERNEL channels


@message("rpc.alloc")
@dataclass(frozen=True)
class AllocBuffer:
    nbytes: int


@message("rpc.query")
@dataclass(frozen=True)
class QueryBuffer:
    offset: int


@message("rpc.buffer")
@dataclass(frozen=True)
class BufferInfo:
    offset: int
    nbytes: int


@message("rpc.error")
@dataclass(frozen=True)
class RpcError:
    reason: str


@message("rpc.get_evidence")
@dataclass(frozen=True)
class GetEvidence:
    """GET_MEASUREMENTS over the session: the device's signed evidence for ``nonce`` (32 bytes).

    Encrypted RPC only: the orchestrator asks inside the SPDM session it just opened, so the
    evidence comes from the device that holds the session key (paper 4.5, GPU phase)."""

    nonce: bytes


@message("rpc.evidence")
@dataclass(frozen=True)
class Evidence:
    blob: bytes  # an encoded attest.GpuEvidence


# SPDM messages are the sans-IO dataclasses of crypto.spdm; registering them lets the same
# plaintext RPC slot carry them before a session exists.
for _cls in (_spdm.GetCertificate, _spdm.Certificate, _spdm.KeyExchange, _spdm.KeyExchangeResponse,
             _spdm.Finish, _spdm.FinishResponse):
    message(f"spdm.{_cls.__name__}")(_cls)


# ============================================================================ host (PCIe MUX)
@message("host.device_attach")
@dataclass(frozen=True)
class DeviceAttach:
    """Device -> host at power-on. fds: [BAR0 memfd, doorbell eventfd]. Never VRAM."""

    serial: str
    bar_bytes: int


@message("host.register")
@dataclass(frozen=True)
class RegisterCvm:
    """CVM -> host: save my DMA mappings and interrupt endpoint. fds: [sysmem memfd, irq eventfd]."""

    cvm: str
    iova: int
    nbytes: int


@message("host.registered")
@dataclass(frozen=True)
class Registered:
    """Host -> CVM. fds: [BAR0 memfd, doorbell eventfd]: BAR mappings stay in every CVM."""

    bar_bytes: int


@message("host.switch")
@dataclass(frozen=True)
class SwitchRequest:
    target: str


@message("host.switched")
@dataclass(frozen=True)
class Switched:
    """Host -> the CVM that asked. ``seq`` numbers the MUX's switches: an ``Attached`` with a
    lower number is older than this switch. ``elapsed_ns``: the MUX's own time to re-route."""

    target: str
    elapsed_ns: int
    seq: int


@message("host.attached")
@dataclass(frozen=True)
class Attached:
    """Host -> the CVM the GPU was just switched to, when another CVM asked for the switch.

    The orchestrator hands its context over while the MUX switches, so the holder learns
    here when the GPU is its own (and the orchestrator, when a holder sends it home). The
    host is untrusted: a false notice only makes the CVM's pushes go unseen (a timeout),
    as a host that never switches would."""

    target: str
    elapsed_ns: int
    seq: int


@message("host.error")
@dataclass(frozen=True)
class HostError:
    reason: str


@message("host.attach_cvm")
@dataclass(frozen=True)
class AttachCvm:
    """Host -> device: drop current DMA mappings, map these. fds: [sysmem memfd, irq eventfd]."""

    cvm: str
    iova: int
    nbytes: int


@message("host.ack")
@dataclass(frozen=True)
class DeviceAck:
    cvm: str


# ============================================================================ device <-> orchestrator
@message("device.vram_request")
@dataclass(frozen=True)
class VramRequest:
    """Orchestrator -> device over their private link: the VRAM window for running kernels."""


@message("device.vram")
@dataclass(frozen=True)
class VramGrant:
    """fds: [VRAM memfd]. Emulates kernels the orchestrator launches reading protected memory."""

    vram_bytes: int


# ============================================================================ travel (over TLS)
@message("travel.hello")
@dataclass(frozen=True)
class HolderHello:
    """Holder -> orchestrator on joining: its dataset's size and manifest (SHA-256 per piece),
    and the tokenizer its tokens were made with ("" for a dataset of raw bytes)."""

    holder: str
    dataset_bytes: int
    piece_bytes: int
    manifest: tuple[bytes, ...]
    tokenizer: str


@message("travel.welcome")
@dataclass(frozen=True)
class Welcome:
    cohort: str


@message("travel.request")
@dataclass(frozen=True)
class TravelRequest:
    """Orchestrator -> holder: the GPU is switched to you; fill ``buffer`` from ``offset``."""

    travel_id: int
    buffer_offset: int
    buffer_bytes: int
    dataset_offset: int
    context: bytes = field(repr=False)  # context blob: keys inside, never printed


@message("travel.chunk")
@dataclass(frozen=True)
class ChunkInfo:
    dataset_offset: int
    nbytes: int
    digest: bytes  # SHA-256 over the SHA-256 of each piece of the chunk


@message("travel.result")
@dataclass(frozen=True)
class TravelResult:
    travel_id: int
    context: bytes = field(repr=False)  # context blob: keys inside, never printed
    chunk: ChunkInfo
    steps_ns: dict[str, int]  # dh_import, dh_copy, dh_export, o_switch, handler
    #: Non-zero bytes the holder found in the buffer on arrival (-1: not checked). A holder
    #: may read the buffer back before copying to audit that the previous chunk was scrubbed.
    nonzero_on_arrival: int


@message("travel.refused")
@dataclass(frozen=True)
class TravelRefused:
    """The holder could not copy; it still sent the GPU home and returned the context."""

    travel_id: int
    context: bytes = field(repr=False)  # context blob: keys inside, never printed
    reason: str
    steps_ns: dict[str, int]


@message("travel.bye")
@dataclass(frozen=True)
class Bye:
    reason: str
