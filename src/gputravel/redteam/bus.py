"""What the malicious hypervisor holds of the bus: BAR0, and every CVM's bounce buffers, read
and write (it holds the memfds), and what it captured from them (:class:`HostBus`); and the
doorbells it hands the CVMs instead of the device's own (:class:`Doorbells`).

:class:`HostBus` only reads, writes and remembers; when to do what is the adversary's
(:mod:`gputravel.redteam.host`), which calls it under its own locks: the bus keeps none.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import selectors
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gputravel.host.mux import CvmRegistration
from gputravel.protocol.layout import (
    GPFIFO_ENTRY,
    SEMAPHORE_RECORD_BYTES,
    SYSMEM_IOVA,
    U32,
    Bar0,
    Layout,
    PushChannel,
)

if TYPE_CHECKING:
    from gputravel.host.process import HostProcess

USER, KERNEL = PushChannel.USER, PushChannel.KERNEL
MAX_RECORDS = 32  # staging-slot captures kept per CVM for ExportRecords


@dataclass
class Captures:
    pushes: dict[tuple[int, int], bytes] = field(default_factory=dict)  # (channel, index) -> ciphertext
    records: dict[bytes, bytes] = field(default_factory=dict)  # digest -> staging slot content


class HostBus:
    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.host: HostProcess | None = None  # the host process it runs in, once its loop starts
        self.regs: dict[str, CvmRegistration] = {}
        self.mem: dict[str, mmap.mmap] = {}
        self.caps: dict[str, Captures] = {}
        self.seen_put = {USER: 0, KERNEL: 0}  # how far each channel's pushes have been captured
        self.travel_base: dict[str, int] = {}  # the user put when the GPU went to a CVM
        self.push_log: list[bytes] = []  # captured pushes not yet in the loot
        self._bar: mmap.mmap | None = None

    def add(self, reg: CvmRegistration, mem: mmap.mmap) -> None:
        """A CVM registered: its bounce buffers, mapped read-write."""
        self.regs[reg.cvm], self.mem[reg.cvm] = reg, mem
        self.caps.setdefault(reg.cvm, Captures())

    # ------------------------------------------------------------------ BAR0 and the doorbell
    def bar(self) -> mmap.mmap:
        if self._bar is None:
            fds = self.host.device_fds
            assert fds is not None
            self._bar = mmap.mmap(fds[0], self.host.bar_bytes, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return self._bar

    def reg32(self, offset: int) -> int:
        return U32.unpack_from(self.bar(), offset)[0]

    def set32(self, offset: int, value: int) -> None:
        U32.pack_into(self.bar(), offset, value)

    def ring_device(self) -> None:
        """Ring the device's own doorbell (relay a CVM's ring, or one of ours)."""
        os.eventfd_write(self.host.device_fds[1], 1)

    def pending_kernel(self) -> tuple[int, int, int]:
        """The kernel channel's get and put in BAR0, and how many entries lie between."""
        get, put = self.reg32(Bar0.get(KERNEL)), self.reg32(Bar0.put(KERNEL))
        return get, put, (put - get) % self.layout.gpfifo_entries

    # ------------------------------------------------------------------ looking
    def capture(self, cvm: str, channel: PushChannel) -> list[int]:
        """Pushes appended on ``channel`` since the last look: captured; their GPFIFO indices."""
        n = self.layout.gpfifo_entries
        put, last = self.reg32(Bar0.put(channel)) % n, self.seen_put[channel]
        fresh = [(last + i) % n for i in range((put - last) % n)]
        self.seen_put[channel] = put
        mem, bar = self.mem[cvm], self.bar()
        for index in fresh:
            iova, length, _ = GPFIFO_ENTRY.unpack_from(bar, Bar0.gpfifo_entry(self.layout, channel, index))
            start = iova - SYSMEM_IOVA
            if 0 <= start and start + length <= len(mem) and length <= 4096:
                ct = bytes(mem[start : start + length])
                self.caps[cvm].pushes[(int(channel), index)] = ct
                self.push_log.append(ct)
        return fresh

    def capture_records(self, cvm: str) -> None:
        """Keep what each staging slot of ``cvm`` holds now (the newest MAX_RECORDS contents)."""
        lay, mem, caps = self.layout, self.mem[cvm], self.caps[cvm]
        for slot in range(lay.staging_slots):
            off = lay.staging_slot_offset(slot)
            record = bytes(mem[off : off + lay.staging_slot_bytes])
            digest = hashlib.blake2b(record, digest_size=16).digest()
            if digest not in caps.records:
                caps.records[digest] = record
                while len(caps.records) > MAX_RECORDS:
                    caps.records.pop(next(iter(caps.records)))

    def take_pushes(self) -> list[bytes]:
        pushes, self.push_log = self.push_log, []
        return pushes

    # ------------------------------------------------------------------ touching
    def hand_over_semaphore(self, src: str, to: str) -> None:
        """Copy the user channel's latest semaphore record (its IV index is plain text) from
        ``src``'s bounce buffers into ``to``'s."""
        off = self.layout.semaphore_offset(USER)
        self.mem[to][off : off + SEMAPHORE_RECORD_BYTES] = self.mem[src][off : off + SEMAPHORE_RECORD_BYTES]

    def flip_record(self, cvm: str, slot: int) -> None:
        """Flip one ciphertext bit of the record in ``cvm``'s staging slot ``slot``."""
        self.mem[cvm][self.layout.staging_slot_offset(slot) + 1000] ^= 0x80

    def append_user_push(self, cvm: str, ct: bytes) -> int:
        """Write ``ct`` into ``cvm``'s push buffer as the user channel's next GPFIFO entry and
        move put past it (the device hears of it at the next doorbell); its index."""
        n = self.layout.gpfifo_entries
        index = self.reg32(Bar0.put(USER)) % n
        slot = self.layout.pushbuf_offset(USER, index)
        self.mem[cvm][slot : slot + len(ct)] = ct
        GPFIFO_ENTRY.pack_into(self.bar(), Bar0.gpfifo_entry(self.layout, USER, index),
                               self.layout.iova(slot), len(ct), 0)
        self.set32(Bar0.put(USER), (index + 1) % n)
        self.seen_put[USER] = (index + 1) % n
        return index


class Doorbells:
    """A doorbell is an MMIO write the hypervisor can trap: each CVM gets an eventfd of the
    host's own, and a thread calls ``on_ring(cvm)`` for every ring (which decides whether the
    device hears of it)."""

    def __init__(self, on_ring: Callable[[str], None]) -> None:
        self._on_ring = on_ring
        self._lock = threading.Lock()
        self._bells: dict[int, str] = {}  # our doorbell handed to each CVM -> that CVM
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)

    def start(self) -> None:
        threading.Thread(target=self._relay, daemon=True, name="doorbell-relay").start()

    def new(self, cvm: str) -> int:
        """A doorbell for ``cvm`` (the relay starts listening to it at once)."""
        bell = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        with self._lock:
            self._bells[bell] = cvm
        os.write(self._wake_w, b"x")
        return bell

    def _relay(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        known: set[int] = set()
        while True:
            for key, _ in sel.select():
                if key.data is None:
                    self._learn_bells(sel, known)
                    continue
                try:
                    os.eventfd_read(key.fd)
                except BlockingIOError:
                    continue
                self._on_ring(key.data)

    def _learn_bells(self, sel: selectors.BaseSelector, known: set[int]) -> None:
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        with self._lock:
            fresh = {fd: cvm for fd, cvm in self._bells.items() if fd not in known}
        for fd, cvm in fresh.items():
            sel.register(fd, selectors.EVENT_READ, cvm)
            known.add(fd)
