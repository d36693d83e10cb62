"""The emulated confidential GPU's firmware (GSP RPC queue, work channels, copy engines), sans-IO:
the device process calls :meth:`DeviceCore.service` when the doorbell rings. As H100 CC does, it
authenticates every push and record with receiver-tracked IVs, reads a record out of the staging
slot once and decrypts only that copy (a bad tag writes nothing and faults the channel until a
rotation on the kernel channel, whose keys only the orchestrator holds), wipes VRAM on a new SPDM
session, and answers attestation only on the encrypted RPC queue (docs/architecture.md).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from gputravel.crypto.channel import Receiver, Sender, derive_epoch_keys
from gputravel.crypto.spdm import Finish, GetCertificate, SpdmResponder
from gputravel.device.memory import PIECE_BYTES, DmaFault, DmaWindow, check_range, dma_view, fill, open_record
from gputravel.errors import DeviceError, GputravelError, ProtocolError
from gputravel.protocol.layout import (FAULT_REG, GPFIFO_ENTRY, PAGE, RPC_HEADER, SEMAPHORE_HEADER, TAG_BYTES, U32,
                                       Bar0, Layout, PushChannel)
from gputravel.crypto.labels import ALL_LABELS, PUSH_LABEL, SEM_LABEL, is_h2d
from gputravel.protocol.rpc import (AllocBuffer, BufferInfo, DeviceInfo, Evidence, GetDeviceInfo, GetEvidence,
                                    QueryBuffer, RpcError)
from gputravel.protocol.push import CopyFromVram, CopyToVram, GrantWindow, Memset, RotateKeys, SemaphoreRelease
from gputravel.protocol.codec import decode, encode

if TYPE_CHECKING:
    from gputravel.attest.gpu import EmulatedGpuFirmware
    from gputravel.crypto.device_identity import DeviceIdentity

Push = CopyToVram | CopyFromVram | Memset | RotateKeys | GrantWindow | SemaphoreRelease
USER_METHODS: tuple[type[Push], ...] = (CopyToVram, CopyFromVram, SemaphoreRelease)
KERNEL_METHODS: tuple[type[Push], ...] = (Memset, RotateKeys, GrantWindow, SemaphoreRelease)


@dataclass
class DeviceStats:
    faults: list[str] = field(default_factory=list)
    records_in: int = 0
    records_out: int = 0


class DeviceCore:
    def __init__(self, layout: Layout, vram: memoryview, bar: memoryview, identity: DeviceIdentity, *,
                 serial: str = "GPU-EMU-0", rng: Callable[[int], bytes] = os.urandom,
                 firmware: EmulatedGpuFirmware | None = None) -> None:
        self.layout, self.vram, self.bar, self.serial = layout, vram, bar, serial
        self._firmware = firmware  # answers GET_MEASUREMENTS; None: a device without attestation
        self.stats = DeviceStats()
        self._identity = identity  # its SPDM responder's key and certificate chain
        self._spdm: SpdmResponder | None = None
        self._session_secret: bytes | None = None
        self._epoch = -1
        self._rx: dict[str, Receiver] = {}
        self._tx: dict[str, Sender] = {}
        self._faulted: dict[PushChannel, str] = {}
        self._get = {ch: 0 for ch in PushChannel}
        self._rpc_seq = 0
        self._allocs: dict[int, int] = {}
        self._next_alloc = 0
        self._user_window: tuple[int, int] | None = None
        self._dma: DmaWindow | None = None
        self._piece = bytearray(min(PIECE_BYTES, layout.record_bytes))  # a record's DMA reads land here
        self._scratch = bytearray(layout.record_bytes)
        self._tokens = {ch: int.from_bytes(rng(4), "little") | 1 for ch in PushChannel}
        #: Called as soon as work asks for an interrupt, not after a batch: the CVM reuses slots as they free.
        self.on_interrupt: Callable[[], None] = lambda: None

    # ------------------------------------------------------------------ PCIe MUX side
    def attach(self, window: DmaWindow | None) -> None:
        """The IOMMU now maps ``window`` (or nothing). The device does not know who it is."""
        self._dma = window

    def _dma_view(self, iova: int, nbytes: int) -> memoryview:
        return dma_view(self._dma, iova, nbytes)

    # ------------------------------------------------------------------ doorbell
    def service(self) -> None:
        """Run whatever the doorbell announced; interrupts are raised as work completes."""
        self._service_rpc()
        for channel in (PushChannel.KERNEL, PushChannel.USER):
            self._service_channel(channel)

    # ------------------------------------------------------------------ RPC queue
    def _service_rpc(self) -> None:
        (put,) = U32.unpack_from(self.bar, Bar0.RPC_PUT)
        if put == self._rpc_seq:
            return
        try:
            reply, encrypted = self._handle_rpc(put)
        except GputravelError as exc:
            # Dropped without advancing: the requester times out, a later well-formed request works.
            self.stats.faults.append(f"rpc: {type(exc).__name__}")
            return
        self._rpc_seq = put
        try:
            self._write_rpc_response(put, reply, encrypted)
        except DmaFault:
            return
        U32.pack_into(self.bar, Bar0.RPC_GET, put)
        self.on_interrupt()

    def _handle_rpc(self, seq: int) -> tuple[object, bool]:
        lay = self.layout
        head = self._dma_view(lay.iova(lay.rpc_request_offset), RPC_HEADER.size)
        rseq, length, encrypted = RPC_HEADER.unpack(head)
        if rseq != seq or seq != (self._rpc_seq + 1) & 0xFFFFFFFF:
            raise ProtocolError("RPC sequence number out of order")
        body = bytes(self._dma_view(lay.iova(lay.rpc_request_offset) + RPC_HEADER.size, length))
        if encrypted:
            if self._session_secret is None:
                raise ProtocolError("encrypted RPC before a session exists")
            raw = self._rx["Lgsp_h2d_user"].decrypt(body, aad=U32.pack(seq))
            return self._rpc_call(decode(raw, expect=(GetDeviceInfo, AllocBuffer, QueryBuffer, GetEvidence))), True
        request = decode(body)
        if isinstance(request, GetDeviceInfo):
            return self._device_info(), False
        return self._spdm_step(request), False

    def _write_rpc_response(self, seq: int, reply: object, encrypted: bool) -> None:
        raw = encode(reply)
        if encrypted:
            raw = self._tx["Lgsp_d2h_user"].encrypt(raw, aad=U32.pack(seq))
        lay = self.layout
        slot = self._dma_view(lay.iova(lay.rpc_response_offset), RPC_HEADER.size + len(raw))
        slot[RPC_HEADER.size :] = raw
        RPC_HEADER.pack_into(slot, 0, seq, len(raw), int(encrypted))

    def _device_info(self) -> DeviceInfo:
        return DeviceInfo(serial=self.serial, vram_bytes=len(self.vram), layout_digest=self.layout.digest(),
                          session=self._session_secret is not None,
                          work_tokens=(self._tokens[PushChannel.USER], self._tokens[PushChannel.KERNEL]))

    def _spdm_step(self, request: object) -> object:
        if isinstance(request, GetCertificate):
            if self._session_secret is not None:
                self._wipe()  # a new owner: nothing of the old session may survive
            self._spdm = SpdmResponder(self._identity.private_key, self._identity.chain_der)
        if self._spdm is None:
            raise ProtocolError("SPDM message before GET_CERTIFICATE/KEY_EXCHANGE")
        try:
            reply = self._spdm.handle(request)
        except GputravelError:
            self._spdm = None
            raise
        if isinstance(request, Finish):
            self._session_secret = self._spdm.session_secret
            self._install_epoch(0)
        return reply

    def _rpc_call(self, request: object) -> object:
        if isinstance(request, GetDeviceInfo):
            return self._device_info()
        if isinstance(request, AllocBuffer):
            return self._alloc(request.nbytes)
        if isinstance(request, QueryBuffer):
            if (size := self._allocs.get(request.offset)) is None:
                return RpcError(reason=f"no VRAM buffer at offset {request.offset:#x}")
            return BufferInfo(offset=request.offset, nbytes=size)
        if isinstance(request, GetEvidence):
            return self._evidence(request.nonce)
        raise ProtocolError("unknown RPC")

    def _evidence(self, nonce: bytes) -> object:
        if self._firmware is None:
            return RpcError(reason="this device has no attestation firmware")
        if len(nonce) != 32:
            return RpcError(reason="the attestation nonce must be 32 bytes")
        return Evidence(blob=encode(self._firmware.get_evidence(nonce)))

    def _alloc(self, nbytes: int) -> object:
        size = -(-nbytes // PAGE) * PAGE
        if nbytes <= 0 or self._next_alloc + size > len(self.vram):
            return RpcError(reason=f"cannot allocate {nbytes} bytes of VRAM ({len(self.vram)} in all)")
        offset = self._next_alloc
        self._next_alloc += size
        self._allocs[offset] = nbytes
        return BufferInfo(offset=offset, nbytes=nbytes)

    # ------------------------------------------------------------------ keys
    def _install_epoch(self, epoch: int) -> None:
        """Keys of ``epoch`` from the session secret; message counters restart, channel counters stay."""
        assert self._session_secret is not None
        keys = derive_epoch_keys(self._session_secret, epoch, ALL_LABELS)
        for label, material in keys.items():
            live = self._rx.get(label) or self._tx.get(label)
            counter = live.channel_counter if live is not None else 1
            if is_h2d(label):
                self._rx[label] = Receiver(material, channel_counter=counter)
            else:
                self._tx[label] = Sender(material, channel_counter=counter)
        self._epoch = epoch

    def _wipe(self) -> None:
        fill(self.vram, 0)
        self._session_secret = None
        self._rx.clear()
        self._tx.clear()
        self._faulted.clear()
        self._allocs.clear()
        self._user_window = None
        self._next_alloc = 0
        self._epoch = -1
        for ch in PushChannel:
            self._get[ch] = 0
            U32.pack_into(self.bar, Bar0.get(ch), 0)
            U32.pack_into(self.bar, Bar0.put(ch), 0)
            U32.pack_into(self.bar, Bar0.put(ch) + FAULT_REG, 0)

    # ------------------------------------------------------------------ channels
    def _service_channel(self, channel: PushChannel) -> None:
        if channel in self._faulted or self._session_secret is None:
            return
        if U32.unpack_from(self.bar, Bar0.doorbell(channel))[0] != self._tokens[channel]:
            return  # nobody rang this channel with its work submission token
        entries = self.layout.gpfifo_entries
        # Re-read put after every entry: a pipelining CVM keeps appending while we work.
        while self._get[channel] != U32.unpack_from(self.bar, Bar0.put(channel))[0] % entries:
            get = self._get[channel]
            try:
                interrupt = self._run_entry(channel, get)
            except GputravelError as exc:  # IntegrityError, ProtocolError, DeviceError, and any other of ours
                self._fault(channel, exc)
                return
            self._get[channel] = (get + 1) % entries
            U32.pack_into(self.bar, Bar0.get(channel), self._get[channel])
            if interrupt:
                self.on_interrupt()

    def _fault(self, channel: PushChannel, exc: Exception) -> None:
        reason = f"{channel.name.lower()} channel: {type(exc).__name__}: {exc}"
        self._faulted[channel] = reason
        self.stats.faults.append(reason)
        U32.pack_into(self.bar, Bar0.put(channel) + FAULT_REG, 1)
        self.on_interrupt()

    def _run_entry(self, channel: PushChannel, index: int) -> bool:
        iova, length, _ = GPFIFO_ENTRY.unpack_from(self.bar, Bar0.gpfifo_entry(self.layout, channel, index))
        if length > 4096:
            raise ProtocolError("push longer than a push-buffer slot")
        ciphertext = bytes(self._dma_view(iova, length))
        raw = self._rx[PUSH_LABEL[channel]].decrypt(ciphertext)
        allowed = KERNEL_METHODS if channel is PushChannel.KERNEL else USER_METHODS
        push = decode(raw, expect=allowed)
        if not 0 <= push.release < 1 << 64:  # a holder has the user keys: its pushes are input too
            raise ProtocolError("semaphore release value out of range")
        self._execute(push)
        if push.release:
            self._release(channel, push.release)
        return push.interrupt

    def _execute(self, push: object) -> None:
        if isinstance(push, CopyToVram):
            self._copy_in(push)
        elif isinstance(push, CopyFromVram):
            self._copy_out(push)
        elif isinstance(push, Memset):
            check_range(push.offset, push.nbytes, len(self.vram))
            fill(self.vram[push.offset : push.offset + push.nbytes], push.value)
        elif isinstance(push, RotateKeys):
            self._rotate(push.epoch)
        elif isinstance(push, GrantWindow):
            check_range(push.offset, push.nbytes, len(self.vram))
            self._user_window = (push.offset, push.nbytes)

    def _check_user_window(self, offset: int, nbytes: int) -> None:
        """Copies run on the user channel: one record at most, inside the window the orchestrator granted."""
        if not 0 < nbytes <= self.layout.record_bytes:
            raise DeviceError("copy record size out of range")
        if self._user_window is None:
            raise DeviceError("no VRAM window is granted to the user channel")
        start, size = self._user_window
        check_range(offset - start, nbytes, size)

    def _copy_in(self, push: CopyToVram) -> None:
        self._check_user_window(push.dst_offset, push.nbytes)
        record = self._dma_view(push.src_iova, push.nbytes + TAG_BYTES)
        # Verified in the device's own memory, decrypted into private scratch: no unauthenticated byte reaches VRAM.
        plain = open_record(self._rx["Lce00_h2d_user"], record, self._piece, self._scratch)
        self.vram[push.dst_offset : push.dst_offset + push.nbytes] = plain
        self.stats.records_in += 1

    def _copy_out(self, push: CopyFromVram) -> None:
        self._check_user_window(push.src_offset, push.nbytes)
        out = self._dma_view(push.dst_iova, push.nbytes + TAG_BYTES)
        self._tx["Lce00_d2h_user"].encrypt_into(self.vram[push.src_offset : push.src_offset + push.nbytes], out)
        self.stats.records_out += 1

    def _rotate(self, epoch: int) -> None:
        if epoch <= self._epoch:
            raise ProtocolError("key rotation to an older epoch")
        self._install_epoch(epoch)
        # A rotation is also the reset of a faulted user channel: drop its pending entries.
        self._faulted.pop(PushChannel.USER, None)
        U32.pack_into(self.bar, Bar0.put(PushChannel.USER) + FAULT_REG, 0)
        (put,) = U32.unpack_from(self.bar, Bar0.put(PushChannel.USER))
        self._get[PushChannel.USER] = put % self.layout.gpfifo_entries
        U32.pack_into(self.bar, Bar0.get(PushChannel.USER), self._get[PushChannel.USER])

    def _release(self, channel: PushChannel, value: int) -> None:
        """Write the encrypted semaphore payload with its IV index, under a seqlock notifier."""
        sender = self._tx[SEM_LABEL[channel]]
        payload = sender.encrypt(value.to_bytes(8, "little"))
        lay = self.layout
        try:
            rec = self._dma_view(lay.iova(lay.semaphore_offset(channel)), SEMAPHORE_HEADER.size + len(payload))
        except DmaFault:
            return  # the write goes nowhere; whoever waits for it times out
        (notifier,) = struct.unpack_from("<Q", rec, 0)
        struct.pack_into("<Q", rec, 0, notifier + 1)  # odd: write in progress
        rec[SEMAPHORE_HEADER.size :] = payload
        struct.pack_into("<QII", rec, 8, sender.channel_counter, sender.message_counter, 0)
        struct.pack_into("<Q", rec, 0, notifier + 2)

    # ------------------------------------------------------------------ inspection (tests, redteam)
    @property
    def epoch(self) -> int:
        return self._epoch

    def faulted(self, channel: PushChannel) -> bool:
        return channel in self._faulted
