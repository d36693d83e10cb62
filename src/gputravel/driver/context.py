"""The context blob: what a driver needs to reach the device from another CVM (paper 5.2, 5.3),
checksummed so corruption is caught before any field is trusted. It holds keys: TLS only, never logged."""

from __future__ import annotations

import hashlib

from gputravel.crypto.channel import ChannelState
from gputravel.crypto.labels import Direction, direction_of
from gputravel.errors import ContextBlobError, ProtocolError
from gputravel.protocol.codec import Message, decode, encode, register

CONTEXT_VERSION = 1

register(ChannelState)  # tagged "crypto.channel_state" in crypto/, which may not import the codec


class DriverContext(Message, tag="context.v1"):
    version: int
    layout: str  # Layout.digest(): slots must sit at the same IOVAs in both CVMs
    epoch: int
    senders: tuple[ChannelState, ...]  # directions this driver encrypts (h2d)
    receivers: tuple[ChannelState, ...]  # directions this driver decrypts (d2h)
    semaphore: int  # last user tracking-semaphore value observed
    gpfifo_put: int
    work_token: int
    rpc_tx_seq: int  # last RPC request sequence number sent
    rpc_rx_seq: int  # last RPC response sequence number accepted

    def __repr__(self) -> str:  # keys live in senders/receivers: never print them
        return f"DriverContext(v{self.version}, epoch={self.epoch}, put={self.gpfifo_put})"


class SealedContext(Message, tag="context.sealed", secret=("body",)):
    body: bytes
    sha256: bytes


def pack_context(ctx: DriverContext) -> bytes:
    body = encode(ctx)
    return encode(SealedContext(body=body, sha256=hashlib.sha256(body).digest()))


def unpack_context(blob: bytes, *, layout: str, epoch: int | None = None) -> DriverContext:
    """Decode and validate a blob; raise ContextBlobError naming what is wrong (never a value)."""
    try:
        sealed = decode(blob, expect=SealedContext)
        if hashlib.sha256(sealed.body).digest() != sealed.sha256:  # before any field is decoded
            raise ProtocolError("checksum mismatch")
        ctx = decode(sealed.body, expect=DriverContext)
    except ProtocolError as exc:
        raise ContextBlobError(f"context blob is corrupted: {exc}") from None
    if ctx.version != CONTEXT_VERSION:
        raise ContextBlobError(f"context blob version {ctx.version} is not supported (want {CONTEXT_VERSION})")
    if ctx.layout != layout:
        raise ContextBlobError("context blob is for another bounce-buffer layout")
    if epoch is not None and ctx.epoch != epoch:
        raise ContextBlobError(f"context blob is from key epoch {ctx.epoch}, expected epoch {epoch}")
    _check_channels(ctx)
    return ctx


def _check_channels(ctx: DriverContext) -> None:
    """Each channel once, on its side: else a check by label could see one copy, the driver install another."""
    labels = [s.label for s in ctx.senders + ctx.receivers]
    if len(labels) != len(set(labels)):
        raise ContextBlobError("context blob carries a channel twice")
    # An unknown label has no side here; the importers want exactly USER_LABELS.
    wrong = [s for s in ctx.senders if direction_of(s.label) is Direction.D2H]
    wrong += [r for r in ctx.receivers if direction_of(r.label) is Direction.H2D]
    if wrong:
        raise ContextBlobError("context blob carries a channel on the wrong side")
