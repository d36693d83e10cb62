"""The GSP-style RPC queue: plaintext only for the SPDM handshake, encrypted after."""

from __future__ import annotations

from dataclasses import dataclass

from gputravel.crypto import spdm as _spdm
from gputravel.protocol.codec import message


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
