"""The malicious hypervisor, run as the host process's hooks: it has only what a real one has (paper 3.1,
6.2), every CVM's bounce buffers, BAR0, the doorbells and the MUX, never VRAM, the SPDM secret or a key.
It snapshots bounce buffers at every doorbell and switch, captures every push, and takes its orders from
the red team's driver over ``adversary.sock`` (:mod:`gputravel.redteam.bus`)."""

from __future__ import annotations

import functools
import json
import mmap
import queue
import selectors
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from gputravel.errors import GputravelError, ProtocolError, TransportClosed
from gputravel.host.mux import CvmRegistration, SwitchPlan
from gputravel.host.process import HostProcess
from gputravel.protocol.parties import ORCHESTRATOR
from gputravel.protocol.layout import FAULT_REG, Bar0, Layout, PushChannel
from gputravel.transport.stream import StreamTransport
from gputravel.transport.unix import accept_unix, listen_unix
from gputravel.redteam.bus import (ArmDrop, ArmExposePrefix, ArmForgeGet, ArmRoute, ArmTamper, AskQuote, Did,
                                   Doorbells, Event, ExportRecords, ForceSwitch, HostBus, HostNews, MarkRow, ProbePaths,
                                   Query, event)
from gputravel.redteam.loot import Loot
from gputravel.redteam.probes import ask_quote, probe

USER, KERNEL = PushChannel.USER, PushChannel.KERNEL


@dataclass
class _Drop:
    order: ArmDrop
    active: bool = False
    left: int = 0


class HostAdversary:
    """The host's hooks (host.process.HostHooks), and the orders it takes from the red team."""

    def __init__(self, workdir: Path) -> None:
        cfg = json.loads((workdir / "config.json").read_text())
        self.layout = Layout(**cfg["layout"])
        self.bus = HostBus(self.layout)
        self.host: HostProcess | None = None  # the host process whose hooks these are, once it serves
        self.loot = Loot(workdir / "loot", "host")
        self.lock = threading.RLock()  # the adversary's state; never held for long (the relay needs it)
        self._loot_lock = threading.Lock()  # the loot files and captured records (the snapshot worker)
        self._snaps: queue.Queue[str] = queue.Queue()  # CVMs whose bounce buffers to snapshot
        self._orch_kernel_put = 0  # the kernel put the orchestrator last announced with a doorbell
        self._last_user_cvm = ""  # whose bounce buffers hold the user channel's latest semaphore
        self._fault_up = {USER: False, KERNEL: False}
        self._faults = {USER: 0, KERNEL: 0}
        self._events: list[Event] = []
        self._tamper: ArmTamper | None = None
        self._drop: _Drop | None = None
        self._expose: ArmExposePrefix | None = None
        self._route: ArmRoute | None = None
        self._hidden_put: int | None = None
        self._forge: ArmForgeGet | None = None
        self._forge_due = False  # the GPU went to the forge's victim: the next switch home fires it
        self._forged_get: int | None = None  # the value we wrote into BAR0's kernel get, until the device rewrites it
        self._bells = Doorbells(self._on_ring)
        self._listener = listen_unix(workdir / "adversary.sock", backlog=4)
        self._sel: selectors.BaseSelector | None = None

    # ------------------------------------------------------------------ host hooks
    def on_serve(self, host: HostProcess, sel: selectors.BaseSelector) -> None:
        self.host = self.bus.host = host
        self._sel = sel
        sel.register(self._listener, selectors.EVENT_READ, self._accept)
        threading.Thread(target=self._snapshotter, daemon=True, name="snapshots").start()

    def on_register(self, reg: CvmRegistration, doorbell: int) -> int:
        """A CVM registers: map its memory read-write, give it a doorbell of ours."""
        mem = mmap.mmap(reg.sysmem_fd, reg.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with self.lock:
            self.bus.regs[reg.cvm], self.bus.mem[reg.cvm] = reg, mem
        return self._bells.new(reg.cvm)

    def on_switch(self, requester: str, plan: SwitchPlan) -> tuple[CvmRegistration, CvmRegistration]:
        """A CVM asked for a switch: note it, snapshot, and route it as ordered."""
        target = plan.target.cvm
        with self.lock:
            self._check_faults()
            for cvm in {plan.previous, target} - {None}:
                self._snaps.put(cvm)
            self._event(Did.SWITCH_ASKED, f"switch: {requester or 'someone'} asked for the GPU to go to {target}",
                        party=target, place=requester)
            if requester == ORCHESTRATOR and target != ORCHESTRATOR:  # a travel starts
                self.bus.seen_put[USER] = self.bus.reg32(Bar0.put(USER))
                self.bus.travel_base[target] = self.bus.seen_put[USER]
                self._forge_due = self._forge_due or (self._forge is not None and self._forge.victim == target)
            forge = self._forge
            if forge is not None and self._forge_due and target == ORCHESTRATOR:
                self._forge, self._forge_due = None, False
                # BAR0 get := put + 1: the orchestrator's driver finds no room in the kernel ring
                real, put, _ = self.bus.pending_kernel()
                self._forged_get = forged = (put + 1) % self.layout.gpfifo_entries
                self.bus.set32(Bar0.get(KERNEL), forged)
                self._event(Did.FORGED_GET, f"{requester} asked for the GPU to go home: forged BAR0's kernel GPFIFO "
                            f"get ({real} -> {forged}, put + 1), so the kernel ring looks full to the orchestrator as "
                            "it submits the rotation")
                threading.Thread(target=self._unforge_kernel_get, args=(forged, real, time.monotonic() + forge.hold_s),
                                 daemon=True, name="forged-get").start()
            tamper = self._tamper
            if tamper is not None and tamper.kind == "replay" and requester == tamper.victim:
                self._tamper = None
                self.bus.capture(requester, USER)  # whatever the relay has not looked at yet
                self._replay(requester, tamper.user_push)  # the victim is done: the device is idle
            drop = self._drop
            if drop is not None and not drop.active and requester == drop.order.after_return_of and target == ORCHESTRATOR:
                drop.active = True
                self._event(Did.DROPPING, f"{requester} handed the GPU back: dropping doorbells now", party=requester)
            order = self._route
            if order is not None and order.requester == requester and order.target == target:
                self._route = None
                self._event(Did.ROUTED, f"{requester} asked for the GPU to go to {target}: mapped {order.dma}'s "
                            f"memory, routed {order.irq}'s interrupt", party=order.dma, place=order.irq)
                return self.bus.regs[order.dma], self.bus.regs[order.irq]
        return plan.target, plan.target

    # ------------------------------------------------------------------ orders
    def _accept(self) -> None:
        peer = accept_unix(self._listener, "red-team")
        assert self._sel is not None
        self._sel.register(peer.fileno(), selectors.EVENT_READ, functools.partial(self._order, peer))

    def _order(self, peer: StreamTransport) -> None:
        try:
            msg = peer.recv(timeout=10).message
        except (TransportClosed, ProtocolError):
            assert self._sel is not None
            self._sel.unregister(peer.fileno())
            peer.close()
            return
        error = ""
        try:
            self._obey(msg)
        except (GputravelError, KeyError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        peer.send(self._news(error))

    def _obey(self, msg: object) -> None:
        if isinstance(msg, MarkRow):
            self._snaps.join()  # what was seen so far belongs to the attack before
            with self._loot_lock:
                self._flush_pushes()
                self.loot.mark(msg.row)
        elif isinstance(msg, ExportRecords):
            self._export_records(msg)
        elif isinstance(msg, (ProbePaths, AskQuote)):  # from this process, under the host's own uid
            with self._loot_lock:
                events = ([probe(t, self.loot) for t in msg.targets] if isinstance(msg, ProbePaths)
                          else [ask_quote(msg, self.loot)])
            with self.lock:
                self._events += events
        elif isinstance(msg, ForceSwitch):
            self._force_switch(msg)
        elif not isinstance(msg, Query):
            with self.lock:
                if isinstance(msg, ArmTamper):
                    self._tamper = msg
                elif isinstance(msg, ArmDrop):
                    self._drop = _Drop(msg, active=not msg.after_return_of, left=msg.kernel_rings)
                elif isinstance(msg, ArmExposePrefix):
                    self._expose = msg
                elif isinstance(msg, ArmRoute):
                    self._route = msg
                elif isinstance(msg, ArmForgeGet):
                    self._forge, self._forge_due = msg, False
                else:
                    raise ProtocolError(f"unknown order {type(msg).__name__}")

    def _force_switch(self, order: ForceSwitch) -> None:
        with self.lock:
            self._check_faults()
            if order.hide_kernel:
                get, self._hidden_put, pending = self.bus.pending_kernel()
                self.bus.set32(Bar0.put(KERNEL), get)
                self._event(Did.HID_KERNEL, f"hid {pending} pending kernel-channel entries from the device",
                            count=pending)
            elif self._hidden_put is not None:
                self.bus.set32(Bar0.put(KERNEL), self._hidden_put)
                self._hidden_put = None
                self._event(Did.UNHID_KERNEL, "let the device see the pending kernel-channel entries again")
            if self.host.mux.current:
                self._snaps.put(self.host.mux.current)
            if self._last_user_cvm and self._last_user_cvm != order.dma:  # collusion: see HostBus
                self.bus.hand_over_semaphore(self._last_user_cvm, order.dma)
        self.host.mux.switch(order.dma)
        self.host.attach(self.bus.regs[order.dma], self.bus.regs[order.irq])
        self._event(Did.FORCED_SWITCH, f"switched the GPU to {order.dma} unasked (interrupt to {order.irq})",
                    party=order.dma, place=order.irq)

    def _export_records(self, order: ExportRecords) -> None:
        self._snaps.join()
        records, pushes = self.bus.records[order.cvm], self.bus.pushes[order.cvm]
        with self._loot_lock:
            frames = [("record", r) for r in records.values() if r.count(0) < len(r)]
        with self.lock:
            frames += [("push", p) for p in pushes.values()]
        Path(order.path).parent.mkdir(parents=True, exist_ok=True)
        Path(order.path).write_bytes(msgspec.msgpack.encode(frames))  # ciphertexts, each tagged with its kind
        self._event(Did.HANDED_OVER, f"handed over {len(records)} staging records and {len(pushes)} pushes "
                    f"of {order.cvm}", party=order.cvm, count=len(records))

    def _news(self, error: str) -> HostNews:
        with self.lock:
            self._check_faults()
            news = HostNews(tuple(self._events), self._faults[USER], self._faults[KERNEL], error)
            self._events, self._faults = [], {USER: 0, KERNEL: 0}
        return news

    # ------------------------------------------------------------------ the doorbell relay
    def _on_ring(self, cvm: str) -> None:
        """A CVM rang: capture its pushes, decide whether the device hears of it; snapshot aside, to stay fast."""
        with self.lock:
            fresh = {ch: self.bus.capture(cvm, ch) for ch in PushChannel}
            if fresh[USER]:
                self._last_user_cvm = cvm
            announced = False
            if cvm == ORCHESTRATOR:  # did the orchestrator announce kernel work with this doorbell?
                put = self.bus.reg32(Bar0.put(KERNEL))
                announced, self._orch_kernel_put = put != self._orch_kernel_put, put
            self._check_faults()
            forward = self._decide(cvm, fresh, announced)
        if forward:
            self.bus.ring_device()
        self._snaps.put(cvm)

    def _snapshotter(self) -> None:
        while True:
            cvms = [self._snaps.get()]
            while not self._snaps.empty():
                cvms.append(self._snaps.get_nowait())
            with self._loot_lock:
                for cvm in set(cvms):
                    self.loot.snapshot(f"sysmem-{cvm}", memoryview(self.bus.mem[cvm]))
                    self.bus.capture_records(cvm)
                self._flush_pushes()
            for _ in cvms:
                self._snaps.task_done()

    def _flush_pushes(self) -> None:
        with self.lock:
            pushes, self.bus.push_log = self.bus.push_log, []
        self.loot.keep("pushes", b"".join(pushes))

    def _decide(self, cvm: str, fresh: dict[PushChannel, list[int]], announced: bool) -> bool:
        drop = self._drop
        if drop is not None and drop.active:
            if announced:
                drop.left -= 1
                self._event(Did.DROPPED_KERNEL_RING, "dropped the orchestrator's doorbell for kernel-channel work")
                if drop.left <= 0:
                    self._drop = None
            else:
                self._event(Did.DROPPED_RING, f"dropped a doorbell of {cvm}", party=cvm)
            return False
        expose = self._expose
        if expose is not None and announced:
            self._expose = None
            get, _, pending = self.bus.pending_kernel()
            if pending <= expose.entries:
                self._event(Did.NOTHING_TO_HOLD, f"found only {pending} pending kernel-channel entries when the "
                            "orchestrator rang: nothing left to hold back", count=pending)
            else:
                self.bus.set32(Bar0.put(KERNEL), (get + expose.entries) % self.layout.gpfifo_entries)
                self._event(Did.EXPOSED, f"let the device see only {expose.entries} of {pending} pending "
                            "kernel-channel entries", count=expose.entries)
            return True
        tamper = self._tamper
        if tamper is not None and tamper.kind == "flip" and cvm == tamper.victim and fresh[USER]:
            return self._flip_step(tamper, cvm, fresh[USER])
        return True

    def _unforge_kernel_get(self, forged: int, real: int, deadline: float) -> None:
        """At the deadline, the real get back so the next travel finds room, unless the device wrote get since."""
        while time.monotonic() < deadline:
            if self.bus.reg32(Bar0.get(KERNEL)) != forged:
                with self.lock:
                    self._check_faults()  # reports that the device rewrote it
                return
            time.sleep(0.005)
        with self.lock:
            if self.bus.reg32(Bar0.get(KERNEL)) == forged and self._forged_get == forged:
                self.bus.set32(Bar0.get(KERNEL), real)
                self._forged_get = None
                self._event(Did.UNFORGED_GET, f"wrote the real kernel get ({real}) back into BAR0: the ring has "
                            "room again")

    def _flip_step(self, tamper: ArmTamper, cvm: str, fresh: list[int]) -> bool:
        """Flip a bit of the record of user push ``user_push`` before the device hears of it."""
        n = self.layout.gpfifo_entries
        base = self.bus.travel_base.get(cvm, 0)
        rel = {(i - base) % n for i in fresh}
        target = tamper.user_push
        if target in rel:
            self._tamper = None
            slot = tamper.staging_slot
            self.bus.mem[cvm][self.layout.staging_slot_offset(slot) + 1000] ^= 0x80  # one ciphertext bit
            late = (self.bus.reg32(Bar0.get(USER)) - base) % n > target
            self._event(Did.FLIPPED, f"flipped one ciphertext bit of the record in {cvm}'s staging slot {slot} (user "
                        f"push {target})" + (" - too late, the device had already taken it" if late else ""),
                        party=cvm, count=target, place="late" if late else "")
            return True
        if target - 1 in rel:
            self._event(Did.HELD_RING, f"held back {cvm}'s doorbell for user push {target - 1}", party=cvm,
                        count=target - 1)
            return False
        return True

    def _replay(self, cvm: str, push: int) -> None:
        """Write a push captured in this travel back as a new entry and ring the doorbell."""
        n = self.layout.gpfifo_entries
        old = self.bus.pushes[cvm].get((USER, (self.bus.travel_base.get(cvm, 0) + push) % n))
        if old is None:
            self._event(Did.REPLAY_MISSED, f"could not replay: push {push} of {cvm} was not captured", party=cvm,
                        count=push)
            return
        index = self.bus.append_user_push(cvm, old)
        self.bus.ring_device()
        self._event(Did.REPLAYED, f"wrote {cvm}'s captured user push {push} back as a new entry (same epoch, same "
                    "channel) and rang the doorbell", party=cvm, count=push)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and self.bus.reg32(Bar0.get(USER)) % n == index:
            if self.bus.reg32(Bar0.put(USER) + FAULT_REG):
                break
            time.sleep(0.005)

    # ------------------------------------------------------------------ looking
    def _check_faults(self) -> None:
        if self._forged_get is not None and self.bus.reg32(Bar0.get(KERNEL)) != self._forged_get:
            self._forged_get = None
            self._event(Did.GET_REWRITTEN, "BAR0's kernel get no longer holds the forged value: the device rewrote it")
        for ch in PushChannel:
            up = self.bus.reg32(Bar0.put(ch) + FAULT_REG) != 0
            if up and not self._fault_up[ch]:
                self._faults[ch] += 1
                self._event(Did.FAULT_FLAG, f"BAR0: the device raised the {ch.name.lower()} channel's fault flag",
                            place=ch.name.lower())
            self._fault_up[ch] = up

    def _event(self, did: Did, text: str, **fields: Any) -> None:
        with self.lock:
            self._events.append(event(did, text, **fields))
