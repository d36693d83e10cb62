"""The orchestrator's driver: sole owner of the SPDM session secret and the kernel channel. What
the host can write moves positions here, never the ledger: a rotation counts once the device
confirmed it under the new kernel key; one that cannot be confirmed halts travel."""

from __future__ import annotations

import time
from collections.abc import Callable

from gputravel.driver.context import DriverContext, pack_context, unpack_context
from gputravel.crypto.channel import derive_epoch_keys
from gputravel.crypto.spdm import SpdmRequester
from gputravel.errors import ContextBlobError, GputravelError, IllegalTransition, ProtocolError
from gputravel.protocol.layout import U32, Bar0, PushChannel
from gputravel.crypto.labels import ALL_LABELS, USER_LABELS
from gputravel.protocol.rpc import AllocBuffer, BufferInfo, DeviceInfo, Evidence, GetDeviceInfo, GetEvidence
from gputravel.protocol.push import GrantWindow, Memset, RotateKeys
from gputravel.driver.driver import ChannelKeys, Driver
from gputravel.driver.link import DeviceLink
from gputravel.driver.epochs import EpochLedger


class OrchestratorDriver(Driver):
    def __init__(self, link: DeviceLink, *, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(link, clock=clock)
        self.__session_secret: bytes | None = None
        self.key_epoch = -1  # survives export: the epoch the device is on
        self._exported: DriverContext | None = None
        self._kernel_issued = 0  # the last kernel release value submitted, confirmed or not
        self._rotating: int | None = None  # the release value of a rotation submitted, not finished
        self.ledger = EpochLedger()

    # ------------------------------------------------------------------ boot (the orchestrator boots last)
    def establish_session(self, requester: SpdmRequester | None = None, timeout: float = 10.0) -> None:
        """SPDM-style handshake over the plaintext RPC queue; derive the epoch-0 keys."""
        req = requester or SpdmRequester()
        if self.info is None:
            self.probe(timeout)
        elif self.__session_secret is not None:  # re-keying: join the queue where the device is
            self._join_rpc_queue()
        req.handle_certificate(self.rpc(req.get_certificate(), encrypted=False, timeout=timeout))
        finish = req.handle_key_exchange_response(self.rpc(req.key_exchange(), encrypted=False, timeout=timeout))
        req.handle_finish_response(self.rpc(finish, encrypted=False, timeout=timeout))
        # The device wiped VRAM and every channel (device/core.py, _wipe): start over with it.
        self.__session_secret = req.session_secret
        self.keys = ChannelKeys()
        self._put = dict.fromkeys(self._put, 0)
        self._exported = self._rotating = None
        self.ledger.new_session()
        self._install(0)

    # Fail-closed recovery: a new secret and wiped VRAM, so no key a holder kept opens anything after.
    rekey = establish_session

    def _install(self, epoch: int) -> None:
        assert self.__session_secret is not None
        self.keys.install(derive_epoch_keys(self.__session_secret, epoch, ALL_LABELS))
        self.epoch = epoch
        self.key_epoch = epoch

    def _require_session(self, action: str) -> None:
        if self.__session_secret is None:
            raise IllegalTransition("orchestrator driver", "no-session", action)

    # ------------------------------------------------------------------ GSP RPCs
    def alloc_buffer(self, nbytes: int, timeout: float = 10.0) -> BufferInfo:
        return self.ask(AllocBuffer(nbytes=nbytes), BufferInfo, timeout=timeout)

    def get_evidence(self, nonce: bytes, timeout: float = 10.0) -> bytes:
        """The device's signed attestation evidence for ``nonce``, asked inside our session."""
        self._require_session("ask for attestation evidence")
        return self.ask(GetEvidence(nonce=nonce), Evidence, timeout=timeout).blob

    def reclaim_rpc_queue(self, timeout: float = 10.0) -> DeviceInfo:
        """After a lend: rejoin the RPC queue and prove, encrypted, that the session is still ours."""
        self._require_session("reclaim the RPC queue")
        if self._exported is not None:
            raise IllegalTransition("orchestrator driver", "context-away", "reclaim the RPC queue")
        self._join_rpc_queue()
        info = self.ask(GetDeviceInfo(), DeviceInfo, timeout=timeout)
        if not info.session:
            raise ProtocolError("the device no longer holds our session")
        return info

    def alloc_dataset_buffer(self, nbytes: int, timeout: float = 10.0) -> BufferInfo:
        """Allocate the dataset buffer and grant the user channel that range, and only that."""
        buf = self.alloc_buffer(nbytes, timeout)
        self._kernel(lambda v: GrantWindow(offset=buf.offset, nbytes=buf.nbytes, release=v, interrupt=True), timeout)
        return buf

    # ------------------------------------------------------------------ the orchestrator's own copies
    def copy_to_vram(self, data: memoryview, dst_offset: int, *, buffer_bytes: int, timeout: float = 30.0) -> None:
        """The orchestrator's own copy (the TLS baseline): never under an epoch a holder had."""
        self.ledger.use_for_copy()
        super().copy_to_vram(data, dst_offset, buffer_bytes=buffer_bytes, timeout=timeout)

    def copy_from_vram(self, src_offset: int, nbytes: int, *, timeout: float = 30.0) -> bytearray:
        self.ledger.use_for_copy()
        return super().copy_from_vram(src_offset, nbytes, timeout=timeout)

    @property
    def epoch_fresh(self) -> bool:
        """No party has had the current epoch's user keys: it may travel."""
        return self.ledger.fresh

    # ------------------------------------------------------------------ kernel channel
    def _kernel(self, push_factory: Callable[[int], object], timeout: float) -> None:
        self.wait_release(PushChannel.KERNEL, self._submit_kernel(push_factory, timeout), timeout)
        self._resync()

    def _submit_kernel(self, push_factory: Callable[[int], object], timeout: float,
                       action: str = "use the kernel channel") -> int:
        """Submit ``push_factory(release value)`` on the kernel channel; returns the value."""
        self._require_session(action)
        value = self._next_kernel_release()
        self.submit(PushChannel.KERNEL, push_factory(value), timeout)
        return value

    def _next_kernel_release(self) -> int:
        """A release value no kernel push used: a timed-out push's late release must not confirm the next."""
        self._kernel_issued = max(self._kernel_issued, self.semaphore(PushChannel.KERNEL)) + 1
        return self._kernel_issued

    def _resync(self) -> None:
        """After a confirmed kernel push (all before it ran), continue the queues where the device is."""
        self.join_queues_where_they_stand()
        U32.pack_into(self.link.bar, Bar0.put(PushChannel.USER), self._put[PushChannel.USER])

    def scrub(self, offset: int, nbytes: int, timeout: float = 10.0) -> None:
        """Device-side memset of the dataset buffer: nothing of the last chunk may travel on."""
        self.finish_scrub(self.start_scrub(offset, nbytes, timeout), timeout)

    def start_scrub(self, offset: int, nbytes: int, timeout: float = 10.0) -> int:
        """Submit the scrub (kernel work: a travel exports meanwhile); ``finish_scrub`` waits for it."""
        return self._submit_kernel(
            lambda v: Memset(offset=offset, nbytes=nbytes, value=0, release=v, interrupt=True), timeout)

    def finish_scrub(self, value: int, timeout: float = 10.0) -> bytes | None:
        """Wait for the scrub; a fresh context blob if the one exported meanwhile no longer matches."""
        # Sleep at once: the device fills large buffers on every core, a polling CVM would take one.
        self.wait_release(PushChannel.KERNEL, value, timeout, poll=False)
        sent = self._exported
        if sent is None:
            self._resync()
            return None
        # Nothing honest moves the user channel between a rotation and here. If something did (kept keys,
        # hidden kernel work), take the context back and export again; IVs behind the device's fail closed.
        get = self._get(PushChannel.USER)
        rpc = U32.unpack_from(self.link.bar, Bar0.RPC_GET)[0]
        if (get, rpc, rpc) == (sent.gpfifo_put, sent.rpc_tx_seq, sent.rpc_rx_seq):
            return None
        self._adopt(sent)
        self._exported = None
        self._resync()
        return self._pack_export()  # replaces the first blob, which leaves only after this confirmation

    def rotate(self, timeout: float = 10.0) -> int:
        """The next key epoch, once the device confirms under the new kernel key; else fail closed (6.3)."""
        if self._exported is not None:
            raise IllegalTransition("orchestrator driver", "context-away", "rotate keys")
        self.start_rotation(timeout)
        return self.finish_rotation(timeout)

    def start_rotation(self, timeout: float = 10.0) -> int:
        """Submit the rotation (kernel work: a travel imports meanwhile); ``finish_rotation`` waits."""
        self._require_session("rotate keys")
        if self._rotating is not None:
            raise IllegalTransition("orchestrator driver", "rotating", "start another rotation")
        epoch = self.key_epoch + 1  # key_epoch moves only when the rotation is finished
        try:
            self._rotating = self._submit_kernel(lambda v: RotateKeys(epoch=epoch, release=v, interrupt=True),
                                                 timeout, "rotate keys")
        except GputravelError as exc:  # say, the host made the ring look full (BAR0 get)
            self.ledger.halt(f"the rotation to key epoch {epoch} could not be submitted ({type(exc).__name__})")
            raise
        return epoch

    def finish_rotation(self, timeout: float = 10.0) -> int:
        """Take back a context still away, install the new epoch's keys, wait for the confirmation."""
        if self._rotating is None:
            raise IllegalTransition("orchestrator driver", "not-rotating", "finish a rotation")
        value, self._rotating = self._rotating, None
        epoch = self.key_epoch + 1
        self.abandon_travel()
        # Keys first (the confirmation comes under them); the ledger moves only once it came.
        self.ledger.halt(f"the rotation to key epoch {epoch} was not confirmed by the device")
        self._install(epoch)
        self.wait_release(PushChannel.KERNEL, value, timeout)
        self.ledger.rotated(epoch)  # confirmed under the new kernel key, which only the device has
        self._resync()  # the device dropped whatever was pending on the user channel
        return epoch

    @property
    def rotating(self) -> bool:
        return self._rotating is not None

    # ------------------------------------------------------------------ travel
    def export_for_travel(self) -> bytes:
        """The current epoch's user context for one holder's travel, if no party had that epoch."""
        self._require_session("export the context")
        if self._exported is not None:
            raise IllegalTransition("orchestrator driver", "context-away", "export the context")
        self.ledger.export()
        return self._pack_export()

    def _pack_export(self) -> bytes:
        self._exported = self._take_user_context()
        return pack_context(self._exported)

    def import_returned(self, blob: bytes) -> DriverContext:
        """Take back the context a holder returns; refuse one from another epoch, altered or stale."""
        if self._exported is None:
            raise IllegalTransition("orchestrator driver", "context-home", "import a returned context")
        sent = self._exported
        ctx = unpack_context(blob, layout=self.layout.digest(), epoch=sent.epoch)
        _check_same_keys(sent, ctx)
        _check_consistent(sent, ctx)
        self._adopt(ctx)
        self._exported = None
        return ctx

    def abandon_travel(self) -> None:
        """The context never came back: take it back as sent (the next rotation drops its work)."""
        if self._exported is None:
            return
        self._adopt(self._exported)
        self._exported = None
        self._join_rpc_queue()  # the holder may have moved the RPC queue before it died

    @property
    def away(self) -> bool:
        return self._exported is not None


def _check_same_keys(sent: DriverContext, back: DriverContext) -> None:
    def keys(ctx: DriverContext) -> dict[str, tuple[bytes, bytes]]:
        return {s.label: (s.key, s.iv_mask) for s in ctx.senders + ctx.receivers}

    if keys(sent) != keys(back) or set(keys(back)) != set(USER_LABELS):
        raise ContextBlobError("returned context blob carries keys that were not exported")


#: How far a travel may move a semaphore or RPC sequence: far more than it pushes, far from a wrap.
MAX_ADVANCE = 1 << 32


def _check_consistent(sent: DriverContext, back: DriverContext) -> None:
    """A travel moves message counters, positions and sequence numbers only forward, and boundedly;
    a channel counter moved (IVs pushed out of step with the device) or a stale blob is refused."""
    def counters(ctx: DriverContext) -> dict[str, tuple[int, int]]:
        return {s.label: (s.channel_counter, s.message_counter) for s in ctx.senders + ctx.receivers}

    before, after = counters(sent), counters(back)
    if any(after[label][0] != before[label][0] for label in before):
        raise ContextBlobError("returned context blob is inconsistent: a channel counter changed during the travel")
    if any(after[label][1] < before[label][1] for label in before):
        raise ContextBlobError("returned context blob is stale: counters went backwards")
    moved = ((sent.semaphore, back.semaphore), (sent.rpc_tx_seq, back.rpc_tx_seq), (sent.rpc_rx_seq, back.rpc_rx_seq))
    if any(now < was for was, now in moved):
        raise ContextBlobError("returned context blob is stale: semaphore or RPC sequence went backwards")
    if any(now - was > MAX_ADVANCE for was, now in moved):
        raise ContextBlobError("returned context blob is inconsistent: semaphore or RPC sequence moved too far")
