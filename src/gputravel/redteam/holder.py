"""The malicious data holder (paper 3.1, 6.1): a real holder CVM process whose travels go through the real
driver, device and host, but which keeps every context blob (the keys in it) and, on the red team's orders,
dumps VRAM, works after handing the GPU back, returns stale or forged blobs, refuses or never returns the GPU,
uses kept keys later and tries them on what the host captured. What it reads goes to its loot."""

from __future__ import annotations

import os
import selectors
from pathlib import Path
from typing import Any

import msgspec
from msgspec import structs

from gputravel.cohort.entry import load_config
from gputravel.crypto.channel import Receiver
from gputravel.driver.context import DriverContext, pack_context, unpack_context
from gputravel.errors import GputravelError, IntegrityError, TransportClosed
from gputravel.protocol.layout import SEMAPHORE_HEADER, TAG_BYTES, PushChannel
from gputravel.protocol.travel import TravelRequest
from gputravel.protocol.push import CopyFromVram
from gputravel.holder.steps import CopyChunk, ExportBlob, Exported, StepFailed, SwitchBack
from gputravel.protocol.control import JoinCohort, Ready, Shutdown
from gputravel.holder.cvm import DataHolder, HolderConfig
from gputravel.holder.membership import join as join_cohort
from gputravel.transport.base import Transport
from gputravel.redteam.bus import (AskQuote, DecryptCaptured, Did, Event, HolderNews, MarkRow, ProbePaths, Query,
                                   SetTravelMode, UseKeptKeys, event)
from gputravel.redteam.guess import candidates
from gputravel.redteam.loot import Loot
from gputravel.redteam.probes import ask_quote, probe


# ----------------------------------------------------------------------------- forging and trying kept keys
def rewound(ctx: DriverContext) -> DriverContext:
    """Every message counter and the semaphore back to zero: the IVs of this epoch used again."""
    senders = tuple(structs.replace(s, message_counter=0) for s in ctx.senders)
    return structs.replace(ctx, senders=senders, semaphore=0)


def first_sender(ctx: DriverContext, **change: Any) -> DriverContext:
    """The first sender's state changed: a channel counter moved forward (the orchestrator's next IVs on
    that channel would no longer be the device's), or a key replaced by one of mallory's own."""
    first, *rest = ctx.senders
    return structs.replace(ctx, senders=(structs.replace(first, **change), *rest))


def try_open(state, message: int, ct: bytes) -> bytes | None:
    """The plaintext if ``ct`` opens as message ``message`` on ``state``'s key and channel; else None."""
    try:
        rx = Receiver.from_state(structs.replace(state, message_counter=0))
        return rx.accept_at(message, state.channel_counter, ct)
    except GputravelError:
        return None


#: The forged blobs a travel mode hands back, and how the news says what was forged.
FORGERIES = {
    "stale-counters": (rewound, "counters rewound"),
    "counters-forward": (lambda c: first_sender(c, channel_counter=c.senders[0].channel_counter + 1),
                         "the channel counter of its first sender moved forward by one"),
    "altered-keys": (lambda c: first_sender(c, key=os.urandom(32)), "a key replaced"),
}


MODES = ("honest", "dump", "work-after-return", "stale-epoch", "stale-counters", "counters-forward", "altered-keys",
         "corrupted", "refuse", "never-return", "vanish")
MAX_IV_GUESSES = 32  # message counters tried per key and ciphertext
# Which kept keys are worth trying on which captured ciphertext.
LABELS_FOR = {"record": ("Lce00_h2d_user", "Lce00_d2h_user"), "push": ("Lwlc_h2d_user",)}


class _WalkedAway(Exception):
    """Mallory stops mid-travel, keeping the GPU. Not a GputravelError, so the dispatch does not hand it to
    the travel machine, which stays mid-travel until ``abort()``."""


class MaliciousHolder(DataHolder):
    """A DataHolder with the same machine and dispatch; only some steps of its ``ACTIONS`` misbehave."""

    def __init__(self, config: HolderConfig, loot_dir: Path, **parts) -> None:
        super().__init__(config, **parts)  # what DataHolder.from_config opened
        self.loot = Loot(loot_dir, "holder")
        self.kept: list[bytes] = []  # every blob given or exported, oldest first
        self.exported: list[bytes] = []  # the blobs it exported at the end of its travels
        self.mode = "honest"  # what the next travel does
        self.buffer: tuple[int, int] | None = None
        self._news = _News()
        self._misbehaving = "honest"  # what the travel under way does
        self._exported_now = b""  # what the travel under way exported (b"": nothing yet)

    # ------------------------------------------------------------------ travels
    def serve_travel(self, req: TravelRequest) -> None:
        self._misbehaving, self.mode = self.mode, "honest"
        self._exported_now = b""
        self.kept.append(req.context)  # as nobody honest would
        self.buffer = (req.buffer_offset, req.buffer_bytes)
        try:
            super().serve_travel(req)
        except _WalkedAway:
            pass  # the GPU stays here; the machine is reset when the red team has it join again
        else:
            if self._misbehaving == "work-after-return":  # the GPU is home; the keys just returned are still in hand
                self._news.event(Did.WORK_AFTER_RETURN, "after handing the GPU back: submitted a read of the buffer "
                                 "with the keys it returned")
                self._with_kept(self._exported_now, lambda: self._read("after returning the GPU", *self.buffer, 1.0,
                                                                       kept=True))
        self._snapshot()

    def _at_copy(self, act: CopyChunk, timeout: float | None) -> object:
        """The GPU is ours and the buffer granted: dump it, walk away, refuse, or copy."""
        mode = self._misbehaving
        if mode in ("dump", "never-return"):  # what is left in the buffer before copying anything?
            self._read("inside the granted window", act.buffer_offset, act.buffer_bytes, self.config.device_timeout)
        if mode in ("never-return", "vanish"):
            quiet = " (and never used it: its keys' counters stay as exported)" if mode == "vanish" else ""
            self._news.event(Did.KEPT_GPU, "kept the GPU: never switched back, never replied" + quiet, place=mode)
            raise _WalkedAway
        if mode == "refuse":  # quiet: no push, so the exported counters stay in step with the device
            self._news.event(Did.REFUSED, "refused the travel on purpose without touching the GPU, and handed the GPU and "
                             "context back")
            return StepFailed("mallory refuses this travel")
        return DataHolder.ACTIONS[CopyChunk](self, act, timeout)

    def _before_switch_back(self, act: SwitchBack, timeout: float | None) -> object:
        """Copied (or not): with the GPU still ours, try the rest of VRAM first."""
        if self._misbehaving == "dump":
            assert self.buffer is not None
            offset, nbytes = self.buffer
            for where, at in (("just past the granted window", offset + nbytes),
                              ("16 MiB past the granted window", offset + nbytes + (16 << 20))):
                self._read(where, at, 4096, 1.0)
        return DataHolder.ACTIONS[SwitchBack](self, act, timeout)

    def _export_and_pick(self, act: ExportBlob, timeout: float | None) -> Exported:
        """Export (keeping a copy), and hand back a blob: perhaps not that one."""
        exported = DataHolder.ACTIONS[ExportBlob](self, act, timeout)
        assert isinstance(exported, Exported)
        self.kept.append(exported.blob)
        self.exported.append(exported.blob)
        self._exported_now = exported.blob
        return Exported(self._returned(self._misbehaving, exported.blob))

    #: The honest holder's steps, but for these three (holder/cvm.py carries each out).
    ACTIONS = {**DataHolder.ACTIONS, CopyChunk: _at_copy, SwitchBack: _before_switch_back,
               ExportBlob: _export_and_pick}

    def _returned(self, mode: str, blob: bytes) -> bytes:
        """The blob handed back: the real one, or a stale or altered one."""
        if mode == "stale-epoch" and len(self.exported) > 1:
            what, blob = "the context blob of an earlier travel (older key epoch)", self.exported[-2]
        elif mode in FORGERIES:
            forge, forged = FORGERIES[mode]
            what = f"a context blob with {forged}, checksum recomputed"
            blob = pack_context(forge(unpack_context(blob, layout=self.config.layout.digest())))
        elif mode == "corrupted":
            what, blob = "a context blob with one byte flipped", blob[:-40] + bytes([blob[-40] ^ 0x01]) + blob[-39:]
        else:
            return blob
        self._news.event(Did.RETURNED_BLOB, f"returned {what}", place=mode)
        return blob

    # ------------------------------------------------------------------ kept keys
    def use_kept_keys(self, order: UseKeptKeys) -> None:
        assert self.buffer is not None, "no travel yet: nothing kept"
        for blob in list(reversed(self.exported))[: order.blobs]:
            epoch = unpack_context(blob, layout=self.config.layout.digest()).epoch
            self._news.event(Did.USED_KEPT_KEYS, f"used the keys of epoch {epoch} it kept", count=epoch)
            where = f"with kept epoch-{epoch} keys"
            self._with_kept(blob, lambda where=where: self._read(where, *self.buffer, order.timeout, kept=True))
            self._with_kept(blob, lambda: self._rpc(order.timeout))
        self._snapshot()

    def _with_kept(self, blob: bytes, attempt) -> None:
        """Adopt a kept context, line it up with where the device stands, try, drop it. Nothing it lines
        up with is secret: BAR0's get and last RPC, and the plain IV index of the last semaphore release."""
        drv = self.driver
        drv.import_context(blob)
        drv.join_queues_where_they_stand()
        _, chan, msg, _ = SEMAPHORE_HEADER.unpack_from(drv.link.sysmem, self.config.layout.semaphore_offset(PushChannel.USER))
        if chan:
            for table, label in ((drv.keys.tx, "Lwlc_h2d_user"), (drv.keys.rx, "Llcic_d2h_user")):
                state = structs.replace(table[label].export_state(), channel_counter=chan, message_counter=msg)
                table[label] = type(table[label]).from_state(state)
        try:
            attempt()
        finally:
            drv.export_context()  # drop it again (it stays in self.kept)

    def _read_any_iv(self, offset: int, nbytes: int, timeout: float) -> bytearray:
        """copy_from_vram, except that each record is opened at whichever IV works (the number
        of reads the device served this epoch is not published, so try them)."""
        drv, lay = self.driver, self.config.layout
        rx = drv.keys.rx["Lce00_d2h_user"].export_state()
        out = bytearray()
        for start in range(0, nbytes, lay.record_bytes):
            n = min(lay.record_bytes, nbytes - start)
            slot, value = lay.staging_slot_offset(0), drv.next_release(PushChannel.USER)
            drv.submit(PushChannel.USER, CopyFromVram(src_offset=offset + start, nbytes=n, dst_iova=lay.iova(slot),
                                                      release=value, interrupt=True), timeout)
            drv.wait_release(PushChannel.USER, value, timeout)
            ct = bytes(drv.link.sysmem[slot : slot + n + TAG_BYTES])
            plain = next((p for m in range(1, 2 * MAX_IV_GUESSES) if (p := try_open(rx, m, ct)) is not None), None)
            if plain is None:
                raise IntegrityError("no IV opens the record")
            out += plain
        return out

    def _read(self, where: str, offset: int, nbytes: int, timeout: float, *, kept: bool = False) -> None:
        self._news.attempts += 1
        try:
            data = (self._read_any_iv(offset, nbytes, timeout) if kept
                    else self.driver.copy_from_vram(offset, nbytes, timeout=timeout))
        except GputravelError as exc:
            self._news.fail(Did.READ, f"read {where}", exc, place=where)
            return
        self.loot.keep("read", data)
        nonzero = len(data) - data.count(0)
        self._news.bytes_read += len(data)
        self._news.nonzero_read += nonzero
        self._news.event(Did.READ, f"read {len(data)} bytes {where}: {nonzero} not zero", place=where,
                         nbytes=len(data), count=nonzero)

    def _rpc(self, timeout: float) -> None:
        self._news.attempts += 1
        try:
            self.driver.query_buffer(self.buffer[0], timeout=timeout)
        except GputravelError as exc:
            self._news.fail(Did.RPC, "encrypted RPC", exc)
            return
        self._news.event(Did.RPC, "an encrypted RPC with kept keys was answered")

    # ------------------------------------------------------------------ collusion
    def decrypt_captured(self, order: DecryptCaptured) -> None:
        """Every kept key (or the newest ones), every plausible IV, on every ciphertext the host handed over."""
        frames = msgspec.msgpack.decode(Path(order.path).read_bytes(), type=list[tuple[str, bytes]])
        blobs = self.kept[-order.newest :] if order.newest > 0 else self.kept
        contexts = [unpack_context(b, layout=self.config.layout.digest()) for b in blobs]
        states = [s for ctx in contexts for s in ctx.senders + ctx.receivers]  # every key worth trying
        pairs = [(s, ct) for kind, ct in frames for s in states if s.label in LABELS_FOR.get(kind, ())]
        guesses = range(1, MAX_IV_GUESSES + 1)  # each tried: candidates() skips only the IVs whose tag cannot match
        opened = [p for s, ct in pairs for m in candidates(s, guesses, ct) if (p := try_open(s, m, ct)) is not None]
        tried = len(pairs) * MAX_IV_GUESSES
        self.loot.keep("decrypted", b"".join(opened))
        self._news.attempts += tried
        self._news.decrypted += len(opened)
        epochs = sorted({ctx.epoch for ctx in contexts})
        self._news.event(Did.DECRYPT, f"tried {len(states)} kept keys (of {len(blobs)} blobs, key epochs "
                         f"{', '.join(map(str, epochs))}) x {MAX_IV_GUESSES} IVs on {len(frames)} captured "
                         f"ciphertexts: {len(opened)} opened", count=len(opened), nbytes=tried)

    # ------------------------------------------------------------------ loot and news
    def _snapshot(self) -> None:
        self.loot.snapshot("sysmem", memoryview(self.driver.link.sysmem))
        self.loot.keep("blobs", b"".join(self.kept))

    def event(self, *events: Event) -> None:
        self._news.events.extend(events)

    def news(self) -> HolderNews:
        news, self._news = self._news.message(), _News()
        return news


class _News:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.errors: list[str] = []
        self.bytes_read = self.nonzero_read = self.decrypted = self.attempts = 0

    def event(self, did: Did, text: str, **fields: Any) -> None:
        self.events.append(event(did, text, **fields))

    def fail(self, did: Did, what: str, exc: GputravelError, **fields: Any) -> None:
        self.errors.append(type(exc).__name__)
        self.event(did, f"{what}: {type(exc).__name__}", error=type(exc).__name__, **fields)

    def message(self) -> HolderNews:
        return HolderNews(tuple(self.events), tuple(self.errors), self.bytes_read, self.nonzero_read,
                          self.decrypted, self.attempts)


# ----------------------------------------------------------------------------- the process
def serve(payload: dict, control: Transport) -> None:
    """``python -m gputravel.redteam.entry holder CONFIG CONTROL_FD``."""
    loot_dir = Path(payload.pop("loot_dir"))
    holder = MaliciousHolder.from_config(load_config(HolderConfig, payload), loot_dir=loot_dir)
    holder.boot()
    control.send(Ready(role=holder.config.name, detail={"dataset_bytes": holder.dataset.size}))
    sel = selectors.DefaultSelector()
    sel.register(control.fileno(), selectors.EVENT_READ, "control")
    while True:
        for key, _ in sel.select():
            if key.data == "control":
                if not _order(holder, control.recv().message, control, sel):
                    return
            else:
                _from_orchestrator(holder, sel)


def _order(holder: MaliciousHolder, cmd: object, control: Transport, sel: selectors.BaseSelector) -> bool:
    if isinstance(cmd, Shutdown):
        return False
    if isinstance(cmd, JoinCohort):
        # a link the orchestrator dropped, not yet noticed; whatever travel it walked away from (never-return)
        _forget_orchestrator(holder, sel)
        if join_cohort(holder, cmd, control):
            assert holder.orchestrator is not None
            sel.register(holder.orchestrator.fileno(), selectors.EVENT_READ, "orchestrator")
        return True
    if isinstance(cmd, MarkRow):
        holder.loot.mark(cmd.row)
    elif isinstance(cmd, SetTravelMode):
        holder.mode = cmd.mode if cmd.mode in MODES else "honest"
    elif isinstance(cmd, UseKeptKeys):
        holder.use_kept_keys(cmd)
    elif isinstance(cmd, DecryptCaptured):
        holder.decrypt_captured(cmd)
    elif isinstance(cmd, ProbePaths):  # from this process, under mallory's own uid
        holder.event(*(probe(t, holder.loot) for t in cmd.targets))
    elif isinstance(cmd, AskQuote):
        holder.event(ask_quote(cmd, holder.loot))
    elif not isinstance(cmd, Query):
        return True
    control.send(holder.news())
    return True


def _forget_orchestrator(holder: MaliciousHolder, sel: selectors.BaseSelector) -> None:
    if holder.orchestrator is not None:
        sel.unregister(holder.orchestrator.fileno())
    holder.drop_orchestrator()  # closes the link and ends any travel or attestation on it


def _from_orchestrator(holder: MaliciousHolder, sel: selectors.BaseSelector) -> None:
    assert holder.orchestrator is not None
    try:
        msg = holder.orchestrator.recv(timeout=30).message
    except (TransportClosed, GputravelError):
        _forget_orchestrator(holder, sel)
        holder.event(event(Did.CONNECTION_DROPPED, "the orchestrator dropped the connection"))
        return
    if isinstance(msg, TravelRequest):  # anything else (a Bye) needs nothing here
        holder.serve_travel(msg)
