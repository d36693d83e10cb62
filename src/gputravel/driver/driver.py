"""The GPU driver inside every CVM: pushes, semaphores, RPCs, the copy API and context migration."""

from __future__ import annotations

import os
import struct
import time
from typing import Callable, TypeVar

from gputravel.driver.context import CONTEXT_VERSION, DriverContext, pack_context, unpack_context
from gputravel.crypto.channel import KeyMaterial, Receiver, Sender
from gputravel.errors import (
    BadInput,
    ChannelFaulted,
    ContextBlobError,
    DeviceError,
    IllegalTransition,
    IntegrityError,
    PeerTimeout,
    ProtocolError,
)
from gputravel.protocol.layout import (
    FAULT_REG,
    GPFIFO_ENTRY,
    RPC_HEADER,
    PUSH_SLOT_BYTES,
    SEMAPHORE_HEADER,
    TAG_BYTES,
    U32,
    Bar0,
    PushChannel,
)
from gputravel.crypto.labels import PUSH_LABEL, SEM_LABEL, USER_LABELS, is_h2d
from gputravel.protocol.rpc import BufferInfo, DeviceInfo, GetDeviceInfo, QueryBuffer, RpcError
from gputravel.protocol.push import CopyFromVram, CopyToVram
from gputravel.protocol.codec import decode, encode
from gputravel.driver.link import DeviceLink

R = TypeVar("R")


class ChannelKeys:
    """Crypto state of one or both push channels, keyed by label (h2d: Sender, d2h: Receiver)."""

    def __init__(self) -> None:
        self.tx: dict[str, Sender] = {}
        self.rx: dict[str, Receiver] = {}

    def install(self, keys: dict[str, KeyMaterial]) -> None:
        """Take new keys; message counters restart, channel counters are kept (as H100 does)."""
        for label, material in keys.items():
            live = self.tx.get(label) or self.rx.get(label)
            chan = live.channel_counter if live is not None else 1
            if is_h2d(label):
                self.tx[label] = Sender(material, channel_counter=chan)
            else:
                self.rx[label] = Receiver(material, channel_counter=chan)


class Driver:
    """One CVM's driver. ``clock`` is injectable so timeouts are testable."""

    def __init__(self, link: DeviceLink, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.link = link
        self.layout = link.layout
        self.clock = clock
        self.keys = ChannelKeys()
        self.epoch: int | None = None
        self.info: DeviceInfo | None = None
        self._put = {ch: 0 for ch in PushChannel}
        self._sem = {ch: 0 for ch in PushChannel}
        self._issued = {ch: 0 for ch in PushChannel}  # the last release value handed out, confirmed or not
        self._rpc_tx = self._rpc_rx = 0
        self._sys = memoryview(link.sysmem)

    # ------------------------------------------------------------------ boot
    def probe(self, timeout: float = 10.0) -> DeviceInfo:
        """Boot (paper 4.1): join the RPC queue where it stands, check the device, learn its tokens."""
        if self.epoch is None:
            self._join_rpc_queue()
        info = self.ask(GetDeviceInfo(), DeviceInfo, encrypted=False, timeout=timeout)
        if info.layout_digest != self.layout.digest():
            raise ProtocolError("device uses another bounce-buffer layout")
        self.info = info
        return info

    def _join_rpc_queue(self) -> None:
        self._rpc_tx = self._rpc_rx = U32.unpack_from(self.link.bar, Bar0.RPC_GET)[0]

    def join_queues_where_they_stand(self) -> None:
        """Take the user GPFIFO put and RPC sequence numbers from BAR0. Public: it moves only this
        CVM's own state; the device's push and RPC authentication is what stands in the way."""
        self._put[PushChannel.USER] = self._get(PushChannel.USER)
        self._join_rpc_queue()

    @property
    def has_context(self) -> bool:
        return self.epoch is not None

    def _require_context(self, action: str) -> int:
        """The key epoch of the context this driver holds; IllegalTransition if it holds none."""
        if self.epoch is None:
            raise IllegalTransition(f"driver {self.link.cvm}", "no-context", action)
        return self.epoch

    # ------------------------------------------------------------------ RPC queue
    def rpc(self, request: object, *, encrypted: bool = True, timeout: float = 10.0) -> object:
        seq = (self._rpc_tx + 1) & 0xFFFFFFFF
        raw = encode(request)
        if encrypted:
            self._require_context("send an RPC")
            raw = self.keys.tx["Lgsp_h2d_user"].encrypt(raw, aad=U32.pack(seq))
        lay = self.layout
        off = lay.rpc_request_offset
        if RPC_HEADER.size + len(raw) > lay.rpc_response_offset - off:
            raise BadInput("RPC request too large for its slot")
        self._sys[off + RPC_HEADER.size : off + RPC_HEADER.size + len(raw)] = raw
        RPC_HEADER.pack_into(self._sys, off, seq, len(raw), int(encrypted))
        self._rpc_tx = seq
        U32.pack_into(self.link.bar, Bar0.RPC_PUT, seq)
        self.link.ring()
        self._wait(lambda: U32.unpack_from(self.link.bar, Bar0.RPC_GET)[0] == seq, timeout, "RPC reply")
        return self._read_rpc_response(seq, encrypted)

    def _read_rpc_response(self, seq: int, encrypted: bool) -> object:
        off = self.layout.rpc_response_offset
        rseq, length, renc = RPC_HEADER.unpack_from(self._sys, off)
        if rseq != seq or bool(renc) != encrypted or length > 64 * 1024:
            raise ProtocolError("RPC response does not match the request")
        body = bytes(self._sys[off + RPC_HEADER.size : off + RPC_HEADER.size + length])
        if encrypted:
            body = self.keys.rx["Lgsp_d2h_user"].decrypt(body, aad=U32.pack(seq))
        self._rpc_rx = seq
        reply = decode(body)
        if isinstance(reply, RpcError):
            raise DeviceError(reply.reason)
        return reply

    def ask(self, request: object, want: type[R], *, encrypted: bool = True, timeout: float = 10.0) -> R:
        """An RPC whose reply must be a ``want``."""
        reply = self.rpc(request, encrypted=encrypted, timeout=timeout)
        if not isinstance(reply, want):
            raise ProtocolError(f"unexpected reply to {type(request).__name__}")
        return reply

    def query_buffer(self, offset: int, timeout: float = 10.0) -> BufferInfo:
        return self.ask(QueryBuffer(offset=offset), BufferInfo, timeout=timeout)

    # ------------------------------------------------------------------ pushes and semaphores
    def submit(self, channel: PushChannel, push: object, timeout: float = 10.0) -> None:
        """Encrypt a push into its slot, append a GPFIFO entry, ring the doorbell."""
        if channel is PushChannel.USER:
            self._require_context("submit work")
        elif PUSH_LABEL[channel] not in self.keys.tx:
            raise IllegalTransition(f"driver {self.link.cvm}", "no-kernel-keys", "submit kernel work")
        entries = self.layout.gpfifo_entries
        put = self._put[channel]
        self._wait(lambda: (put + 1) % entries != self._get(channel), timeout, "GPFIFO space")
        ciphertext = self.keys.tx[PUSH_LABEL[channel]].encrypt(encode(push))
        if len(ciphertext) > PUSH_SLOT_BYTES:
            raise BadInput("push larger than a push-buffer slot")
        slot = self.layout.pushbuf_offset(channel, put)
        self._sys[slot : slot + len(ciphertext)] = ciphertext
        bar = self.link.bar
        GPFIFO_ENTRY.pack_into(bar, Bar0.gpfifo_entry(self.layout, channel, put), self.layout.iova(slot), len(ciphertext), 0)
        self._put[channel] = (put + 1) % entries
        U32.pack_into(bar, Bar0.put(channel), self._put[channel])
        U32.pack_into(bar, Bar0.doorbell(channel), self.info.work_tokens[int(channel)] if self.info else 0)
        self.link.ring()

    def _get(self, channel: PushChannel) -> int:
        """The device's GPFIFO get, brought into the ring: the host can write any value to BAR0."""
        return int(U32.unpack_from(self.link.bar, Bar0.get(channel))[0]) % self.layout.gpfifo_entries

    def next_release(self, channel: PushChannel) -> int:
        """A release value never handed out: a held-back push's late release must not pass for a later one."""
        return self._reserve(channel, 1)

    def _reserve(self, channel: PushChannel, count: int) -> int:
        first = max(self._issued[channel], self._sem[channel]) + 1
        self._issued[channel] = first + count - 1
        return first

    def semaphore(self, channel: PushChannel) -> int:
        self._poll_semaphore(channel)
        return self._sem[channel]

    def _poll_semaphore(self, channel: PushChannel) -> None:
        off = self.layout.semaphore_offset(channel)
        size = SEMAPHORE_HEADER.size + 8 + TAG_BYTES
        for _ in range(1000):  # seqlock: retry while the device is mid-write
            before = struct.unpack_from("<Q", self._sys, off)[0]
            record = bytes(self._sys[off : off + size])
            if before % 2 == 0 and struct.unpack_from("<Q", self._sys, off)[0] == before:
                break
        else:
            return
        _, chan, msg, _ = SEMAPHORE_HEADER.unpack_from(record)
        receiver = self.keys.rx.get(SEM_LABEL[channel])
        if receiver is None or (chan, msg) <= (receiver.channel_counter, receiver.message_counter):
            return  # nothing newer than what we already accepted
        try:
            value = int.from_bytes(receiver.accept_at(msg, chan, record[SEMAPHORE_HEADER.size :]), "little")
        except IntegrityError:
            return  # forged, or stale from another epoch: ignore, the device's real one will come
        self._sem[channel] = max(self._sem[channel], value)

    def wait_release(self, channel: PushChannel, value: int, timeout: float = 10.0, *, poll: bool = True) -> None:
        """Wait until the device released ``value`` (``poll=False``: sleep on the interrupt at once)."""
        self._wait(lambda: self.semaphore(channel) >= value, timeout, f"semaphore {value}", channel, poll)

    def faulted(self, channel: PushChannel) -> bool:
        return bool(U32.unpack_from(self.link.bar, Bar0.put(channel) + FAULT_REG)[0])

    def _wait(self, ready: Callable[[], bool], timeout: float, what: str, channel: PushChannel | None = None,
              poll: bool = True) -> None:
        deadline = self.clock() + timeout
        # Yield-poll briefly before sleeping, as CUDA does: most waits are shorter than a wake-up.
        spin_until = time.perf_counter() + (self.link.spin_s if poll else 0.0)
        while not ready():
            if channel is not None and self.faulted(channel):
                raise ChannelFaulted(f"{channel.name.lower()} channel faulted while waiting for {what}")
            left = deadline - self.clock()
            if left <= 0:
                raise PeerTimeout(f"device did not answer within {timeout:g} s (waiting for {what})")
            if time.perf_counter() < spin_until:
                os.sched_yield()
                continue
            self.link.wait_interrupt(min(left, 0.05))

    # ------------------------------------------------------------------ copy API (paper 5.5)
    def copy_to_vram(self, data: memoryview, dst_offset: int, *, buffer_bytes: int, timeout: float = 30.0) -> None:
        """Copy ``data`` into VRAM through the staging slots, pipelined; nothing is sent if it won't fit."""
        self._require_context("copy")
        if len(data) > buffer_bytes:
            raise BadInput(f"chunk of {len(data)} bytes is larger than the {buffer_bytes}-byte dataset buffer")
        if len(data) == 0:
            raise BadInput("nothing to copy: the chunk is empty")
        lay = self.layout
        rec, slots = lay.record_bytes, lay.staging_slots
        encrypt = self.keys.tx["Lce00_h2d_user"].encrypt_into
        count = -(-len(data) // rec)
        base = self._reserve(PushChannel.USER, count) - 1
        for k in range(count):
            if k >= slots:
                self.wait_release(PushChannel.USER, base + k - slots + 1, timeout)
            piece = data[k * rec : (k + 1) * rec]
            slot = lay.staging_slot_offset(k % slots)
            encrypt(piece, self._sys[slot : slot + len(piece) + TAG_BYTES])
            push = CopyToVram(src_iova=lay.iova(slot), nbytes=len(piece), dst_offset=dst_offset + k * rec,
                              release=base + k + 1, interrupt=True)
            self.submit(PushChannel.USER, push, timeout)
        self.wait_release(PushChannel.USER, base + count, timeout)

    def copy_from_vram(self, src_offset: int, nbytes: int, *, timeout: float = 30.0) -> bytearray:
        """Read VRAM back through the staging slots (decrypting each record here)."""
        self._require_context("copy")
        lay = self.layout
        out = bytearray(nbytes)
        piece = bytearray(lay.record_bytes)  # our own memory, where each record is read into once
        open_once = self.keys.rx["Lce00_d2h_user"].decrypt_once_into
        for start in range(0, nbytes, lay.record_bytes):
            n = min(lay.record_bytes, nbytes - start)
            slot = lay.staging_slot_offset(0)
            value = self.next_release(PushChannel.USER)
            self.submit(PushChannel.USER, CopyFromVram(src_offset=src_offset + start, nbytes=n, dst_iova=lay.iova(slot),
                                                       release=value, interrupt=True), timeout)
            self.wait_release(PushChannel.USER, value, timeout)
            # The slot is host-writable: each byte is read once into our memory, only that verified.
            open_once(self._sys[slot : slot + n + TAG_BYTES], memoryview(out)[start : start + n], piece)
        return out

    # ------------------------------------------------------------------ context migration
    def export_context(self) -> bytes:
        """Pack the user channel's state; this driver stops using it until a context comes back."""
        return pack_context(self._take_user_context())

    def _take_user_context(self) -> DriverContext:
        epoch = self._require_context("export the context")
        ctx = DriverContext(
            version=CONTEXT_VERSION,
            layout=self.layout.digest(),
            epoch=epoch,
            senders=tuple(self.keys.tx[label].export_state() for label in USER_LABELS if is_h2d(label)),
            receivers=tuple(self.keys.rx[label].export_state() for label in USER_LABELS if not is_h2d(label)),
            # The next party's releases start above every value handed out here, confirmed or not.
            semaphore=max(self._sem[PushChannel.USER], self._issued[PushChannel.USER]),
            gpfifo_put=self._put[PushChannel.USER],
            work_token=self.info.work_tokens[0] if self.info else 0,
            rpc_tx_seq=self._rpc_tx,
            rpc_rx_seq=self._rpc_rx,
        )
        self._drop_user_context()
        return ctx

    def _drop_user_context(self) -> None:
        for label in USER_LABELS:
            self.keys.tx.pop(label, None)
            self.keys.rx.pop(label, None)
        self.epoch = None

    def import_context(self, blob: bytes, *, epoch: int | None = None) -> DriverContext:
        ctx = unpack_context(blob, layout=self.layout.digest(), epoch=epoch)
        labels = {s.label for s in ctx.senders} | {r.label for r in ctx.receivers}
        if labels != set(USER_LABELS):
            raise ContextBlobError("context blob does not carry exactly the user channel keys")
        self._adopt(ctx)
        return ctx

    def _adopt(self, ctx: DriverContext) -> None:
        # Validate before touching any state: a refused blob leaves this driver as it was.
        if self.info is not None and ctx.work_token != self.info.work_tokens[0]:
            raise ContextBlobError("context blob carries another work submission token")
        if not 0 <= ctx.gpfifo_put < self.layout.gpfifo_entries:
            raise ContextBlobError("context blob puts the user channel outside its GPFIFO ring")
        for state in ctx.senders:
            self.keys.tx[state.label] = Sender.from_state(state)
        for state in ctx.receivers:
            self.keys.rx[state.label] = Receiver.from_state(state)
        self._sem[PushChannel.USER] = ctx.semaphore
        self._issued[PushChannel.USER] = max(self._issued[PushChannel.USER], ctx.semaphore)
        self._put[PushChannel.USER] = ctx.gpfifo_put
        self._rpc_tx, self._rpc_rx = ctx.rpc_tx_seq, ctx.rpc_rx_seq
        self.epoch = ctx.epoch
