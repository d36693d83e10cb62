"""The GSP-style RPC queue: plaintext only for the SPDM handshake, encrypted after."""

from __future__ import annotations

from gputravel.crypto import spdm as _spdm
from gputravel.protocol.codec import Message, register


class GetDeviceInfo(Message, tag="rpc.device_info"):
    pass


class DeviceInfo(Message, tag="rpc.device_info.reply"):
    serial: str
    vram_bytes: int
    layout_digest: str
    session: bool
    work_tokens: tuple[int, int]  # work submission tokens of the USER and KERNEL channels


class AllocBuffer(Message, tag="rpc.alloc"):
    nbytes: int


class QueryBuffer(Message, tag="rpc.query"):
    offset: int


class BufferInfo(Message, tag="rpc.buffer"):
    offset: int
    nbytes: int


class RpcError(Message, tag="rpc.error"):
    reason: str


class GetEvidence(Message, tag="rpc.get_evidence"):
    """GET_MEASUREMENTS for ``nonce``, encrypted RPC only: the evidence comes from the device
    that holds the SPDM session key (paper 4.5, GPU phase)."""

    nonce: bytes


class Evidence(Message, tag="rpc.evidence"):
    blob: bytes  # an encoded attest.GpuEvidence


# crypto.spdm's structs (which may not import this package), so the plaintext RPC slot carries
# them before a session exists.
for _cls in (_spdm.GetCertificate, _spdm.Certificate, _spdm.KeyExchange, _spdm.KeyExchangeResponse,
             _spdm.Finish, _spdm.FinishResponse):
    register(_cls)
