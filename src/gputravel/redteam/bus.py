"""The red team's two buses: the orders its driver gives the adversaries and what they report back (typed
messages, an :class:`Event` for each thing done or seen), and what the malicious hypervisor holds of the PCIe
bus (:class:`HostBus`: BAR0 and every CVM's bounce buffers; :class:`Doorbells`: the doorbells it hands out).
The orders are how the colluders coordinate (paper 6.3), no trust boundary; reports never carry plaintext or
keys, what an attacker read goes to its loot. HostBus keeps no locks: the adversary calls it under its own."""

from __future__ import annotations

import enum
import hashlib
import mmap
import os
import selectors
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

from gputravel.host.mux import CvmRegistration
from gputravel.protocol.codec import Message
from gputravel.protocol.layout import GPFIFO_ENTRY, SEMAPHORE_RECORD_BYTES, SYSMEM_IOVA, U32, Bar0, Layout, PushChannel

if TYPE_CHECKING:
    from gputravel.host.process import HostProcess

USER, KERNEL = PushChannel.USER, PushChannel.KERNEL


class Did(enum.StrEnum):
    """What an adversary did or saw; each comment says which of the :class:`Event`'s fields the kind fills."""

    # the host
    SWITCH_ASKED = "switch-asked"  # party: the target; place: who asked
    DROPPING = "dropping"  # party: who handed the GPU back, after which every doorbell is dropped
    DROPPED_KERNEL_RING = "dropped-kernel-ring"  # the orchestrator's doorbell announcing kernel work
    DROPPED_RING = "dropped-ring"  # party: whose doorbell
    ROUTED = "routed"  # party: whose memory the device was given; place: whose interrupt
    FORCED_SWITCH = "forced-switch"  # party: whose memory; place: whose interrupt
    HID_KERNEL = "hid-kernel"  # count: pending kernel entries hidden from the device
    UNHID_KERNEL = "unhid-kernel"
    EXPOSED = "exposed"  # count: pending kernel entries the device was let see
    NOTHING_TO_HOLD = "nothing-to-hold"  # count: all the pending kernel entries there were
    FORGED_GET = "forged-get"  # BAR0's kernel get forged to put + 1
    UNFORGED_GET = "unforged-get"  # the real get written back
    GET_REWRITTEN = "get-rewritten"  # the device wrote the kernel get over the forged one
    HELD_RING = "held-ring"  # party: whose doorbell; count: its user push
    FLIPPED = "flipped"  # party: whose staging slot; count: the user push; place: "late" if too late
    REPLAYED = "replayed"  # party: whose push; count: its user push
    REPLAY_MISSED = "replay-missed"  # party; count: the push that was not captured
    FAULT_FLAG = "fault-flag"  # place: the channel ("user" or "kernel") whose fault flag went up
    HANDED_OVER = "handed-over"  # party: whose captures; count: staging records
    # the malicious holder
    KEPT_GPU = "kept-gpu"  # place: the mode ("never-return", or "vanish": the keys never used)
    REFUSED = "refused"  # a travel refused on purpose, the GPU untouched
    RETURNED_BLOB = "returned-blob"  # place: the travel mode that chose the blob handed back
    WORK_AFTER_RETURN = "work-after-return"
    USED_KEPT_KEYS = "used-kept-keys"  # count: the key epoch
    READ = "read"  # place: where; nbytes: read back; count: of them not zero; error: or why none
    RPC = "rpc"  # an encrypted RPC with kept keys; error: why it went unanswered
    DECRYPT = "decrypt"  # count: ciphertexts opened; nbytes: tries (key x IV x ciphertext)
    CONNECTION_DROPPED = "connection-dropped"  # the orchestrator dropped the connection
    # either
    PROBED = "probed"  # party: whose; place: what; nbytes: read; count: entries listed; error: errno
    FORK_CONTROL = "fork-control"  # nbytes: read of a dumpable fork of itself
    QUOTE = "quote"  # nbytes: the quote's; error: why none; place: the module's reason


class Event(Message, tag="redteam.event"):
    """One thing an adversary did or saw: fields that verdicts read, and ``text``, in words for people."""

    did: Did
    party: str
    place: str
    count: int
    nbytes: int
    error: str
    text: str


def event(did: Did, text: str, *, party: str = "", place: str = "", count: int = 0, nbytes: int = 0,
          error: str = "") -> Event:
    """An :class:`Event` (wire messages take no defaults; this gives them)."""
    return Event(did, party, place, count, nbytes, error, text)


def happened(events: tuple[Event, ...], did: Did, **match: object) -> list[Event]:
    """The events of kind ``did`` whose fields equal ``match``."""
    return [e for e in events if e.did == did and all(getattr(e, k) == v for k, v in match.items())]


class MarkRow(Message, tag="redteam.mark_row"):
    row: str


class Query(Message, tag="redteam.query"):
    """Host or holder: only your news."""


# ----------------------------------------------------------------------------- host orders
class ArmTamper(Message, tag="redteam.host.tamper"):
    """In ``victim``'s next travel, ``flip`` a bit of the record in ``staging_slot`` before the device hears
    of ``user_push`` (counted from the switch), or ``replay`` that push when the victim hands the GPU back."""

    victim: str
    kind: str  # "flip" | "replay"
    user_push: int
    staging_slot: int


class ArmDrop(Message, tag="redteam.host.drop"):
    """Once ``after_return_of`` hands the GPU back (at once if empty), drop every doorbell until
    ``kernel_rings`` of the orchestrator's announcing kernel work have been dropped."""

    after_return_of: str
    kernel_rings: int


class ArmExposePrefix(Message, tag="redteam.host.expose"):
    """At the orchestrator's next kernel doorbell, let the device see only ``entries`` pending entries."""

    entries: int


class ArmForgeGet(Message, tag="redteam.host.forge_get"):
    """When the GPU comes home after a travel to ``victim``, forge BAR0's kernel ``get`` to ``put + 1`` (the
    ring looks full as the rotation is submitted); after ``hold_s`` the real ``get`` goes back."""

    victim: str
    hold_s: float


class ArmRoute(Message, tag="redteam.host.route"):
    """The next switch to ``target`` that ``requester`` asks for maps ``dma`` and routes ``irq`` instead."""

    requester: str
    target: str
    dma: str
    irq: str


class ForceSwitch(Message, tag="redteam.host.switch"):
    """Switch the GPU now, unasked; ``hide_kernel``: first hide pending kernel work (put := get) until the next."""

    dma: str
    irq: str
    hide_kernel: bool


class ExportRecords(Message, tag="redteam.host.records"):
    cvm: str
    path: str


class HostNews(Message, tag="redteam.host.news"):
    events: tuple[Event, ...]  # since the last report
    user_faults: int  # device fault flags the host saw raised in BAR0, since the last report
    kernel_faults: int
    error: str  # "" unless the order failed


# ----------------------------------------------------------------------------- holder orders
class SetTravelMode(Message, tag="redteam.holder.mode"):
    mode: str  # how to behave on the next travel: one of holder.MODES


class UseKeptKeys(Message, tag="redteam.holder.kept"):
    """With each of the ``blobs`` newest blobs kept, join the device's queues, read the buffer, ask an RPC."""

    blobs: int
    timeout: float


class DecryptCaptured(Message, tag="redteam.holder.decrypt"):
    """Try kept keys (of every blob, or of the ``newest`` only) on what the host captured (ExportRecords)."""

    path: str
    newest: int


class HolderNews(Message, tag="redteam.holder.news"):
    events: tuple[Event, ...]  # since the last report
    errors: tuple[str, ...]  # the typed errors its attempts ended in (class names)
    bytes_read: int  # bytes it read back from the device (decrypted), any holder's
    nonzero_read: int  # how many of those were not zero
    decrypted: int  # ciphertexts it managed to decrypt with kept keys
    attempts: int


# ----------------------------------------------------------------------------- both
class ProbeTarget(Message, tag="redteam.probe.target"):
    owner: str
    what: str
    path: str
    how: str  # "read" (``ranges``, or from the start), "list" (a directory), "fork" (the control, on itself)
    ranges: tuple[tuple[int, int], ...]  # (offset, length)


class ProbePaths(Message, tag="redteam.probe"):
    """From your own process (your uid), try each target; keep what you get; report each as an event."""

    targets: tuple[ProbeTarget, ...]


class AskQuote(Message, tag="redteam.quote"):
    """Ask the TDX module at ``socket_path`` for a quote over ``report_data`` of your choosing."""

    socket_path: str
    report_data: bytes


# ----------------------------------------------------------------------------- the host's hold on the bus
MAX_RECORDS = 32  # staging-slot captures kept per CVM for ExportRecords


class HostBus:
    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.host: HostProcess | None = None  # the host process it runs in, once its loop starts
        self.regs: dict[str, CvmRegistration] = {}
        self.mem: dict[str, mmap.mmap] = {}
        # per CVM: (channel, index) -> a push's ciphertext; digest -> a staging slot's content
        self.pushes: defaultdict[str, dict[tuple[int, int], bytes]] = defaultdict(dict)
        self.records: defaultdict[str, dict[bytes, bytes]] = defaultdict(dict)
        self.seen_put = {USER: 0, KERNEL: 0}  # how far each channel's pushes have been captured
        self.travel_base: dict[str, int] = {}  # the user put when the GPU went to a CVM
        self.push_log: list[bytes] = []  # captured pushes not yet in the loot
        self._bar: mmap.mmap | None = None

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
                self.pushes[cvm][(int(channel), index)] = ct
                self.push_log.append(ct)
        return fresh

    def capture_records(self, cvm: str) -> None:
        """Keep what each staging slot of ``cvm`` holds now (the newest MAX_RECORDS contents)."""
        lay, mem, records = self.layout, self.mem[cvm], self.records[cvm]
        for slot in range(lay.staging_slots):
            off = lay.staging_slot_offset(slot)
            record = bytes(mem[off : off + lay.staging_slot_bytes])
            digest = hashlib.blake2b(record, digest_size=16).digest()
            if digest not in records:
                records[digest] = record
                while len(records) > MAX_RECORDS:
                    records.pop(next(iter(records)))

    # ------------------------------------------------------------------ touching
    def hand_over_semaphore(self, src: str, to: str) -> None:
        """Copy the user channel's latest semaphore record (its IV index is plain) from ``src``'s memory to ``to``'s."""
        off = self.layout.semaphore_offset(USER)
        self.mem[to][off : off + SEMAPHORE_RECORD_BYTES] = self.mem[src][off : off + SEMAPHORE_RECORD_BYTES]

    def append_user_push(self, cvm: str, ct: bytes) -> int:
        """Write ``ct`` as the user channel's next GPFIFO entry of ``cvm`` and move put past it; its index."""
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
    """A doorbell is an MMIO write the hypervisor can trap: each CVM gets an eventfd of the host's own, and
    a thread calls ``on_ring(cvm)`` for every ring (which decides whether the device hears of it)."""

    def __init__(self, on_ring: Callable[[str], None]) -> None:
        self._on_ring = on_ring
        self._sel = selectors.EpollSelector()  # epoll: a bell registered while the relay waits is heard at once
        threading.Thread(target=self._relay, daemon=True, name="doorbell-relay").start()

    def new(self, cvm: str) -> int:
        bell = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._sel.register(bell, selectors.EVENT_READ, cvm)
        return bell

    def _relay(self) -> None:
        while True:
            for key, _ in self._sel.select():
                try:
                    os.eventfd_read(key.fd)
                except BlockingIOError:
                    continue
                self._on_ring(key.data)
