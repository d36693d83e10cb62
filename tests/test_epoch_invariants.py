"""Key epochs under an adversarial host and holders: a stateful property test (issue 12).

A hypothesis state machine drives the real device core and drivers on the in-process
harness. It interleaves

- travels by honest holders (alice, bob) and by mallory, who keeps every context blob she is
  sent and uses them later, with the host's help; the orchestrator's side mirrors
  orchestrator/cvm.py ``_travel`` / ``_recover`` / ``_fresh_epoch`` / ``rekey`` (with
  ``verify`` off, so nothing but the drivers stands between a travel and its report), and a
  *careless* variant that skips the rotation, the fresh-epoch check or the recovery, as a
  runtime with a bug would: the driver's ledger is what must hold then;
- the orchestrator's own copies (the TLS baseline), read-backs, encrypted RPCs, rotations
  and re-keys;
- the host: forged BAR0 registers (get, put, fault, doorbell, RPC), dropped or late
  doorbells, replayed, reordered, tampered or re-submitted records, pushes and semaphores,
  the MUX switched to the wrong CVM (or none), the device run whenever the host likes;
- holders that refuse, vanish, die mid-copy, or return stale, altered, rolled-back,
  rolled-forward, re-keyed or old context blobs; mallory reading, writing, pushing and
  calling RPCs with every blob she kept, and opening her own SPDM session.

The invariants, checked after every step (and, for the host's view, at every doorbell):

(a) no epoch's user keys are exported twice, nor exported after the orchestrator copied
    under them (nor does the orchestrator copy under keys it exported);
(b) nothing secret is readable with anything mallory has: the keys she ever held are never
    keys any other party's data moved under, no plaintext canary ever appears in what the host
    can read (every CVM's sysmem and BAR0, at every doorbell), nor in anything mallory reads
    back from VRAM, and an honest holder's audit on arrival reads a scrubbed buffer;
(c) a travel reported done happened: VRAM holds exactly the holder's chunk (the rest
    scrubbed) and device, driver and ledger agree on a fresh epoch; while the device is on an
    epoch only the orchestrator has, nothing changes the dataset buffer behind its back;
(d) the user channel stays in step: the orchestrator's channel counters equal the device's,
    and unless travel is halted the device is on the orchestrator's key epoch.

Errors the drivers raise (GputravelError) are expected outcomes; any other exception fails.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter, deque

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)
from profiles import examples  # tests/profiles.py: counts for the thorough profile
from msgspec import structs

from gputravel.driver.context import pack_context, unpack_context
from gputravel.driver.epochs import EpochLedger, EpochUse
from gputravel.driver.orchestrator import OrchestratorDriver
from gputravel.errors import (
    ContextBlobError,
    ContextRefused,
    EpochSpent,
    GputravelError,
    HolderLost,
    TravelHalted,
)
from gputravel.protocol.layout import FAULT_REG, GPFIFO_ENTRY, U32, Bar0, PushChannel
from gputravel.crypto.labels import USER_LABELS, is_h2d
from gputravel.protocol.push import SemaphoreRelease
from gputravel.redteam.canary import count
from gputravel.testing import ORCHESTRATOR, TEST_LAYOUT, InProcessGpu

USER, KERNEL = PushChannel.USER, PushChannel.KERNEL
LAYOUT = TEST_LAYOUT
DIGEST = LAYOUT.digest()
RECORD = LAYOUT.record_bytes
BUFFER = 4 * RECORD
T = 3.0  # every device timeout: with the harness's FakeClock, a couple of polls
HOME = ORCHESTRATOR
HONEST = ("alice", "bob")
MALLORY = "mallory"
HOLDERS = (*HONEST, MALLORY)
CVMS = (HOME, *HOLDERS)
MAGIC = b"\xa7\xc3EPOCH-SECRET\x00\xff"  # planted in every secret chunk; random data never holds it
assert len(MAGIC) == 16


def holds_magic(memory) -> bool:
    """``MAGIC in memory``: MAGIC's zero byte makes `in` step a byte at a time through zeroed memory,
    14x slower there (most of this file's time); the red team's count searches its zero-free run."""
    return count(memory, MAGIC) > 0

SIZES = st.sampled_from([16, 1000, RECORD - 1, RECORD, RECORD + 17, 2 * RECORD + 5, 3 * RECORD, BUFFER])

# ---------------------------------------------------------------------------- the host's reach
REGISTERS = {
    "kernel_get": Bar0.get(KERNEL), "kernel_put": Bar0.put(KERNEL), "kernel_fault": Bar0.put(KERNEL) + FAULT_REG,
    "kernel_doorbell": Bar0.doorbell(KERNEL), "user_get": Bar0.get(USER), "user_put": Bar0.put(USER),
    "user_fault": Bar0.put(USER) + FAULT_REG, "user_doorbell": Bar0.doorbell(USER),
    "rpc_get": Bar0.RPC_GET, "rpc_put": Bar0.RPC_PUT,
}
_PUSH = lambda ch: (LAYOUT.pushbuf_offset(ch, 0), LAYOUT.pushbuf_offset(ch, LAYOUT.gpfifo_entries))  # noqa: E731
REGIONS = {  # sysmem regions the host copies, replays and tampers with
    "staging": (LAYOUT.staging_offset, LAYOUT.staging_slot_offset(LAYOUT.staging_slots)),
    "push_user": _PUSH(USER),
    "push_kernel": _PUSH(KERNEL),
    "sem_user": (LAYOUT.semaphore_offset(USER), LAYOUT.semaphore_offset(USER) + 64),
    "sem_kernel": (LAYOUT.semaphore_offset(KERNEL), LAYOUT.semaphore_offset(KERNEL) + 64),
    "rpc_request": (LAYOUT.rpc_request_offset, LAYOUT.rpc_request_offset + 4096),
    "rpc_response": (LAYOUT.rpc_response_offset, LAYOUT.rpc_response_offset + 4096),
}
VALUES = st.sampled_from([0, 1, 7, 15, 16, 17, 0xFFFFFFFF, "+1", "-1", "full"])
TARGETS = st.sampled_from([*CVMS, None])
CAPTURE = st.integers(0, 63)  # which kept snapshot (modulo how many there are)

#: Armed on a doorbell: each fires on the ring it was armed for, whoever rings.
RING_FAULTS = st.one_of(
    st.tuples(st.just("drop"), st.integers(1, 3)),  # this doorbell and the next n-1: dropped
    st.tuples(st.just("late"), st.integers(1, 3)),  # dropped, the device runs at the n-th wait
    st.tuples(st.just("forge"), st.sampled_from(sorted(REGISTERS)), VALUES, st.booleans()),  # (after service?)
    st.tuples(st.just("misroute"), TARGETS, st.booleans()),  # MUX elsewhere (and back after service?)
    st.tuples(st.just("replay"), st.sampled_from(sorted(REGIONS)), CAPTURE),
    st.tuples(st.just("tamper"), st.sampled_from(sorted(REGIONS)), st.integers(0, 1 << 20), st.booleans()),
    st.tuples(st.just("reorder"), st.integers(0, 3), st.integers(0, 3)),  # swap two staging slots
    st.tuples(st.just("resubmit"), st.sampled_from([USER, KERNEL]), CAPTURE),
    st.tuples(st.just("hide"), st.sampled_from([USER, KERNEL])),  # put one back: the last entry waits
)
#: A fault armed as a travel starts (None: none), for one of its doorbells or MUX switches.
IN_TRAVEL = st.none() | st.tuples(st.integers(1, 12), RING_FAULTS | st.tuples(st.just("switch"), TARGETS))
#: Done by the host between steps.
HOST_ACTIONS = st.one_of(
    st.tuples(st.just("forge"), st.sampled_from(sorted(REGISTERS)), VALUES),
    st.tuples(st.just("service")),
    st.tuples(st.just("switch"), TARGETS),
    st.tuples(st.just("resubmit"), st.sampled_from([USER, KERNEL]), CAPTURE),
    st.tuples(st.just("restore"), st.sampled_from(sorted(REGIONS)), CAPTURE),
    st.tuples(st.just("hijack")),  # mallory's CVM opens its own SPDM session
)
#: What a holder does with its travel (all holders may misbehave; only mallory keeps keys).
BEHAVIOURS = ("honest", "honest", "audit", "refuse", "vanish", "die_mid_copy", "stale", "altered", "forward",
              "too_far", "channel_counter", "backwards", "other_keys", "old_blob", "empty",
              "duplicate_labels", "swapped_groups")


# ---------------------------------------------------------------------------- helpers
def secret_chunk(nbytes: int) -> bytes:
    data = bytearray(os.urandom(nbytes))
    for off in range(0, nbytes - len(MAGIC) + 1, 4096):
        data[off : off + len(MAGIC)] = MAGIC
    return bytes(data)


def public_chunk(nbytes: int) -> bytes:
    data = os.urandom(nbytes)
    assert not holds_magic(data)
    return data


def ctx_of(blob: bytes):
    return unpack_context(blob, layout=DIGEST)


def blob_keys(blob: bytes) -> frozenset[bytes]:
    ctx = ctx_of(blob)
    return frozenset(s.key for s in ctx.senders + ctx.receivers)


def held_user_keys(drv) -> frozenset[bytes]:
    return frozenset(ep.export_state().key for table in (drv.keys.tx, drv.keys.rx)
                     for label, ep in table.items() if label in USER_LABELS)


def session_secret(orch: OrchestratorDriver) -> bytes | None:
    return orch._OrchestratorDriver__session_secret  # inspection only


def tamper_blob(blob: bytes, how: str, old: bytes | None) -> bytes:
    """What a misbehaving holder hands back instead of the context it exported."""
    if how == "empty":
        return b""
    if how == "altered":
        mid = len(blob) // 2
        return blob[:mid] + bytes([blob[mid] ^ 0x01]) + blob[mid + 1 :]
    if how == "old_blob":
        return old if old is not None else blob[:-1]
    ctx = ctx_of(blob)

    def edit(**changes):
        first = ctx.senders[0].label

        def one(group):
            return tuple(structs.replace(s, **changes) if s.label == first else s for s in group)

        return pack_context(structs.replace(ctx, senders=one(ctx.senders), receivers=one(ctx.receivers)))

    s0 = ctx.senders[0]
    if how == "forward":  # allowed: forward, and by less than 2**32
        fwd = lambda g: tuple(structs.replace(s, message_counter=s.message_counter + 3) for s in g)  # noqa: E731
        return pack_context(structs.replace(ctx, senders=fwd(ctx.senders), receivers=fwd(ctx.receivers),
                                                semaphore=ctx.semaphore + 1000, rpc_tx_seq=ctx.rpc_tx_seq + 5,
                                                rpc_rx_seq=ctx.rpc_rx_seq + 5))
    if how == "too_far":
        return pack_context(structs.replace(ctx, semaphore=ctx.semaphore + (1 << 32) + 1))
    if how == "channel_counter":
        return edit(channel_counter=s0.channel_counter + 1)
    if how == "backwards":
        return edit(message_counter=s0.message_counter - 1) if s0.message_counter else blob[:-2]
    if how == "other_keys":
        return edit(key=bytes(b ^ 0x5A for b in s0.key))
    if how == "duplicate_labels":
        # The checked copies of the h2d states ride in `receivers` (the check merges the two
        # groups, last one wins); the ones the orchestrator adopts into its senders are moved.
        moved = tuple(structs.replace(s, channel_counter=s.channel_counter + 5) for s in ctx.senders)
        return pack_context(structs.replace(ctx, senders=moved, receivers=ctx.receivers + ctx.senders))
    if how == "swapped_groups":
        return pack_context(structs.replace(ctx, senders=ctx.receivers, receivers=ctx.senders))
    raise AssertionError(how)


@dataclasses.dataclass(frozen=True)
class Careless:
    """How a buggy runtime cuts corners; all False: orchestrator/cvm.py as written."""
    skip_fresh: bool = False  # export without replacing a spent or halted epoch first
    skip_rotation: bool = False  # take the context back, do not rotate
    swallow: bool = False  # on failure: take the context back, nothing else


FAITHFUL = Careless()


class Violation(AssertionError):
    pass


# ---------------------------------------------------------------------------- the machine
class EpochMachine(RuleBasedStateMachine):
    # ------------------------------------------------------------------ set-up
    @initialize()
    def boot(self) -> None:
        self.gpu = gpu = InProcessGpu()
        self.orch, self.drivers = gpu.boot(*HOLDERS)
        self.buf = self.orch.alloc_dataset_buffer(BUFFER)
        self.home_buf = (self.buf.offset, self.buf.nbytes)
        # bookkeeping for the invariants
        self.sent: list[tuple[str, int, int, frozenset[bytes]]] = []  # (to, session, epoch, keys)
        self.sent_keys: set[bytes] = set()  # every key that left in a blob
        self.orch_keys: set[bytes] = set()  # keys the orchestrator moved its own data under
        self.data_keys: set[bytes] = set()  # keys an honest party's data moved under
        self.mallory_keys: set[bytes] = set()
        self.mallory_blobs: list[bytes] = []
        self.returned: dict[str, bytes] = {}  # each holder's last exported blob (for "old_blob")
        self.violations: list[str] = []
        self.claim: bytes | None = None  # the dataset buffer, while only the orchestrator can change it
        self.tainted: tuple | None = None  # (session, epoch) with orchestrator copies maybe still queued
        self.outcomes: Counter = Counter()
        # the host
        self.rings = 0
        self.armed: list[tuple[int, tuple]] = []
        self.switch_faults: deque = deque()
        self.dropping = 0
        self.late: list[int] = []
        self.captures: deque = deque(maxlen=24)
        for link in gpu.links.values():
            link.before_service = self._on_ring
            link.while_waiting = self._on_wait

    # ------------------------------------------------------------------ the host at every doorbell
    def _on_ring(self, link):
        self.rings += 1
        self._scan(link.sysmem, f"{link.cvm}'s sysmem at doorbell {self.rings}")
        self._scan(self.gpu.bar, f"BAR0 at doorbell {self.rings}")
        regions = {name: bytes(link.sysmem[a:b]) for name, (a, b) in REGIONS.items()}
        for ch in (USER, KERNEL):
            start = Bar0.gpfifo_entry(LAYOUT, ch, 0)
            regions[f"gpfifo_{ch.name.lower()}"] = bytes(self.gpu.bar[start : start + 16 * LAYOUT.gpfifo_entries])
        self.captures.append((link.cvm, regions))
        deliver = True
        if self.dropping:  # the rest of a "drop" armed earlier
            self.dropping -= 1
            deliver = False
        due = [f for at, f in self.armed if at == self.rings]
        self.armed = [(at, f) for at, f in self.armed if at > self.rings]
        for fault in due:
            if self._apply(fault, link) is False:
                deliver = False
        return None if deliver else False

    def _on_wait(self, link) -> None:
        if not self.late:
            return
        self.late = [n - 1 for n in self.late]
        if any(n <= 0 for n in self.late):
            self.late = [n for n in self.late if n > 0]
            self.gpu.core.service()

    def _scan(self, memory, where: str) -> None:
        if holds_magic(memory):
            self.violations.append(f"(b) plaintext secret in {where}")

    def _capture(self, index: int):
        return self.captures[index % len(self.captures)] if self.captures else None

    def _forge(self, register: str, value) -> None:
        off = REGISTERS[register]
        now = U32.unpack_from(self.gpu.bar, off)[0]
        if value == "+1":
            value = (now + 1) & 0xFFFFFFFF
        elif value == "-1":
            value = (now - 1) & 0xFFFFFFFF
        elif value == "full":  # for a get: the ring looks full; elsewhere: put + 1
            ch = KERNEL if register.startswith("kernel") else USER
            value = (U32.unpack_from(self.gpu.bar, Bar0.put(ch))[0] + 1) % LAYOUT.gpfifo_entries
        U32.pack_into(self.gpu.bar, off, value)

    def _resubmit(self, channel: PushChannel, pick: int) -> None:
        """Re-queue an old encrypted push (kept from any CVM's memory) at the current put, and ring."""
        capture = self._capture(pick)
        if capture is None or self.gpu.current is None:
            return
        _, regions = capture
        name = channel.name.lower()
        entries = LAYOUT.gpfifo_entries
        old = (pick // 3) % entries
        _, length, _ = GPFIFO_ENTRY.unpack_from(regions[f"gpfifo_{name}"], old * 16)
        length = min(length, 512) or 64
        ct = regions[f"push_{name}"][old * 512 : old * 512 + length]
        put = U32.unpack_from(self.gpu.bar, Bar0.put(channel))[0] % entries
        slot = LAYOUT.pushbuf_offset(channel, put)
        self.gpu.sysmem(self.gpu.current)[slot : slot + len(ct)] = ct
        GPFIFO_ENTRY.pack_into(self.gpu.bar, Bar0.gpfifo_entry(LAYOUT, channel, put), LAYOUT.iova(slot), len(ct), 0)
        U32.pack_into(self.gpu.bar, Bar0.put(channel), (put + 1) % entries)
        self.gpu.core.service()

    def _restore(self, region: str, capture, link=None) -> None:
        if capture is None:
            return
        target = link.sysmem if link is not None else (self.gpu.sysmem(self.gpu.current) if self.gpu.current else None)
        if target is None:
            return
        a, b = REGIONS[region]
        target[a:b] = capture[1][region]

    def _apply(self, fault: tuple, link):
        kind = fault[0]
        gpu = self.gpu
        if kind == "drop":
            self.dropping += fault[1] - 1
            return False
        if kind == "late":
            self.late.append(fault[1])
            return False
        if kind == "forge":
            _, register, value, after = fault
            if after:
                gpu.core.service()
                self._forge(register, value)
                return False
            self._forge(register, value)
            return None
        if kind == "misroute":
            _, target, back = fault
            home = gpu.current
            gpu.switch(target)
            if back:
                gpu.core.service()
                gpu.switch(home)
                return False
            return None
        if kind == "replay":
            self._restore(fault[1], self._capture(fault[2]), link)
            return None
        if kind == "tamper":
            _, region, pos, after = fault
            if after:
                gpu.core.service()
            a, b = REGIONS[region]
            link.sysmem[a + pos % (b - a)] ^= 0x01
            return False if after else None
        if kind == "reorder":
            _, i, j = fault
            si, sj = (slice(LAYOUT.staging_slot_offset(k), LAYOUT.staging_slot_offset(k + 1)) for k in (i, j))
            link.sysmem[si], link.sysmem[sj] = bytes(link.sysmem[sj]), bytes(link.sysmem[si])
            return None
        if kind == "resubmit":
            self._resubmit(fault[1], fault[2])
            return None
        if kind == "hide":
            ch = fault[1]
            put = U32.unpack_from(gpu.bar, Bar0.put(ch))[0]
            U32.pack_into(gpu.bar, Bar0.put(ch), (put - 1) % LAYOUT.gpfifo_entries)
            return None
        raise AssertionError(kind)

    def mux(self, target: str | None) -> None:
        """The MUX as the runtime asks for it: the host may put the GPU somewhere else."""
        if self.switch_faults:
            target = self.switch_faults.popleft()
        self.gpu.switch(target)

    # ------------------------------------------------------------------ bookkeeping for (a) and (b)
    def _check_export(self, blob: bytes) -> None:
        keys = blob_keys(blob)
        if keys & self.sent_keys:
            raise Violation("(a) an epoch's user keys were exported twice")
        if keys & self.orch_keys:
            raise Violation("(a) exported the keys of an epoch the orchestrator copied under")

    def _send(self, name: str, blob: bytes) -> None:
        self._check_export(blob)
        keys = blob_keys(blob)
        self.sent.append((name, self.orch.ledger.session, ctx_of(blob).epoch, keys))
        self.sent_keys |= keys
        if name == MALLORY:
            self.mallory_keys |= keys
            self.mallory_blobs.append(blob)
        else:
            self.data_keys |= keys

    def _orch_moves_data(self, keys: frozenset[bytes]) -> None:
        if keys & self.sent_keys:
            raise Violation("(a) the orchestrator moved data under keys it exported")
        self.orch_keys |= keys
        self.data_keys |= keys

    def _loot(self, data, who: str) -> None:
        if holds_magic(data):
            raise Violation(f"(b) {who} read a secret chunk")

    # ------------------------------------------------------------------ the runtime's orchestrator
    def rekey(self) -> None:
        """orchestrator/cvm.py Orchestrator.rekey."""
        self.claim = None  # the device wipes VRAM
        try:
            self.mux(HOME)
            self.orch.rekey(timeout=T)
            buf = self.orch.alloc_dataset_buffer(BUFFER, timeout=T)
        except GputravelError as exc:
            raise TravelHalted(f"could not re-key ({type(exc).__name__})") from None
        if (buf.offset, buf.nbytes) != self.home_buf:
            raise TravelHalted("the re-keyed GPU placed the dataset buffer elsewhere")

    def recover(self) -> None:
        """orchestrator/cvm.py Orchestrator._recover."""
        orch = self.orch
        try:
            self.mux(HOME)
            if orch.rotating:
                orch.finish_rotation(timeout=T)
            else:
                orch.abandon_travel()
                orch.rotate(timeout=T)
        except GputravelError:
            orch.abandon_travel()
            self.rekey()

    def fresh_epoch(self) -> None:
        """orchestrator/cvm.py Orchestrator._fresh_epoch."""
        if self.orch.ledger.halted is None:
            try:
                self.orch.rotate(timeout=T)
                return
            except GputravelError:
                pass
        self.rekey()

    def travel(self, name: str, chunk: bytes, behaviour: str, careless: Careless) -> str:
        """orchestrator/cvm.py Orchestrator._travel (verify off). Returns the holder's
        answer ("ok" or "refused"); raises what the runtime raises."""
        orch, buf = self.orch, self.buf
        if not careless.skip_fresh and not orch.epoch_fresh:
            self.fresh_epoch()
        orch.query_buffer(buf.offset, timeout=T)  # attester.refresh: an encrypted RPC, GPU home
        try:
            scrub = orch.start_scrub(buf.offset, buf.nbytes, timeout=T)
            blob = orch.export_for_travel()
            self._check_export(blob)
            fresh = orch.finish_scrub(scrub, timeout=T)
            if fresh is not None:
                assert blob_keys(fresh) == blob_keys(blob), "finish_scrub re-exported other keys"
                blob = fresh
            self._send(name, blob)
            self.mux(name)
            answer, back = self.holder_travels(name, blob, chunk, behaviour)
            self.mux(HOME)
            if answer == "lost":
                raise HolderLost(name, "it never answered")
            if not careless.skip_rotation:
                orch.start_rotation(timeout=T)
            try:
                orch.import_returned(back)
            except ContextBlobError as exc:
                raise ContextRefused(name, str(exc)) from None
            if not careless.skip_rotation:
                orch.finish_rotation(timeout=T)
            return answer
        except Violation:
            raise
        except Exception:  # as the runtime: whatever left, recover the GPU, then raise
            if careless.swallow:
                try:
                    self.mux(HOME)
                    orch.abandon_travel()
                except GputravelError:
                    pass
            else:
                self.recover()
            raise

    # ------------------------------------------------------------------ holders
    def holder_travels(self, name: str, blob: bytes, chunk: bytes, behaviour: str):
        """holder/cvm.py serve_travel, with a misbehaviour. Returns (answer, blob back)."""
        drv, buf = self.drivers[name], self.buf
        if drv.has_context:  # a previous travel it vanished from
            drv.export_context()
        try:
            drv.import_context(blob)
        except GputravelError:
            return "refused", b""
        if behaviour == "vanish":
            return "lost", None
        if behaviour == "die_mid_copy":
            try:
                info = drv.query_buffer(buf.offset, timeout=T)
                if len(chunk) > 1:
                    drv.copy_to_vram(memoryview(chunk)[: len(chunk) // 2], buf.offset, buffer_bytes=info.nbytes,
                                     timeout=T)
            except GputravelError:
                pass
            return "lost", None
        ok = True
        try:
            if behaviour == "audit" or name == MALLORY:  # audit_arrival: read the whole buffer
                seen = drv.copy_from_vram(buf.offset, buf.nbytes, timeout=T)
                self._loot(seen, name)
                if name != MALLORY and seen.count(0) != len(seen):
                    raise Violation(f"(b) {name} found an unscrubbed buffer on arrival")
            info = drv.query_buffer(buf.offset, timeout=T)
            if behaviour != "refuse":
                drv.copy_to_vram(memoryview(chunk), buf.offset, buffer_bytes=info.nbytes, timeout=T)
        except GputravelError:
            ok = False
        back = drv.export_context()
        old = self.returned.get(name)
        self.returned[name] = back
        if name == MALLORY:
            self.mallory_blobs.append(back)
        if behaviour == "stale":
            back = blob  # the blob it was sent: counters behind, accepted
        elif behaviour not in ("honest", "audit", "refuse"):
            back = tamper_blob(back, behaviour, old)
        return ("ok" if ok and behaviour != "refuse" else "refused"), back

    def _run_travel(self, name: str, size: int, behaviour: str, careless: Careless) -> None:
        orch, gpu = self.orch, self.gpu
        chunk = public_chunk(size) if name == MALLORY else secret_chunk(size)
        self.claim = None
        was_rotating = orch.rotating
        try:
            answer = self.travel(name, chunk, behaviour, careless)
        except Violation:
            raise
        except GputravelError as exc:
            self.outcomes[f"travel: {type(exc).__name__}"] += 1
            assert not orch.away, "a failed travel left the context away"
            if not careless.swallow and not was_rotating:  # recovered: no rotation pending
                assert not orch.rotating, "a failed travel left a rotation pending"
            return
        self.outcomes[f"travel: {answer}"] += 1
        # (c) a travel reported done happened
        assert not orch.away
        if answer == "ok" and name != MALLORY:
            if gpu.vram_at(self.buf.offset, BUFFER) != chunk + bytes(BUFFER - len(chunk)):
                raise Violation(f"(c) {name}'s travel was reported done but VRAM does not hold its chunk")
        if not careless.skip_rotation:
            if not (orch.epoch_fresh and gpu.core.epoch == orch.key_epoch == orch.ledger.epoch
                    and gpu.core._session_secret == session_secret(orch)):
                raise Violation("(c) a travel was reported done but the device is not on a fresh epoch")

    # ------------------------------------------------------------------ rules: travels
    @rule(name=st.sampled_from(HONEST), size=SIZES, behaviour=st.sampled_from(BEHAVIOURS), fault=IN_TRAVEL)
    def honest_travel(self, name, size, behaviour, fault) -> None:
        self._arm(fault)
        self._run_travel(name, size, behaviour, FAITHFUL)

    @rule(size=SIZES, behaviour=st.sampled_from(BEHAVIOURS), fault=IN_TRAVEL)
    def mallory_travels(self, size, behaviour, fault) -> None:
        self._arm(fault)
        self._run_travel(MALLORY, size, behaviour, FAITHFUL)

    @rule(name=st.sampled_from(HOLDERS), size=SIZES, behaviour=st.sampled_from(("honest", "refuse", "vanish", "stale")),
          careless=st.builds(Careless, st.booleans(), st.booleans(), st.booleans()))
    def careless_travel(self, name, size, behaviour, careless) -> None:
        self._run_travel(name, size, behaviour, careless)

    # ------------------------------------------------------------------ rules: the orchestrator's own work
    @rule(size=SIZES)
    def orchestrator_copies(self, size) -> None:
        """The TLS baseline: the orchestrator writes a secret chunk itself (no rotation first)."""
        orch = self.orch
        chunk = secret_chunk(size)
        keys = held_user_keys(orch)
        before = self.gpu.vram_at(self.buf.offset, BUFFER)
        try:
            orch.copy_to_vram(memoryview(chunk), self.buf.offset, buffer_bytes=self.buf.nbytes, timeout=T)
        except (EpochSpent, TravelHalted) as exc:  # refused by the ledger: nothing moved
            self.outcomes[f"copy: {type(exc).__name__}"] += 1
            assert self.gpu.vram_at(self.buf.offset, BUFFER) == before
            return
        except GputravelError as exc:
            self.outcomes[f"copy: {type(exc).__name__}"] += 1
            self._orch_moves_data(keys)
            self.claim = None
            self.tainted = (orch.ledger.session, orch.ledger.epoch)  # its records may still land
            return
        self.outcomes["copy: ok"] += 1
        self._orch_moves_data(keys)
        if self.gpu.vram_at(self.buf.offset, size) != chunk:
            raise Violation("(c) the orchestrator's copy returned but VRAM does not hold its chunk")
        self.claim = None

    @rule(act=st.sampled_from(["read", "rpc", "rotate", "rotate", "careless_rotate", "rekey"]),
          nbytes=st.sampled_from([16, RECORD + 3, BUFFER]))
    def orchestrator_acts(self, act, nbytes) -> None:
        """The orchestrator's other work, at any time: read the buffer back, an encrypted RPC
        (the runtime's attestation refresh, buffer queries), a rotation as ``_fresh_epoch``
        does it (or a careless one), a re-key."""
        orch = self.orch
        try:
            if act == "read":
                keys = held_user_keys(orch)
                try:
                    data = orch.copy_from_vram(self.buf.offset, nbytes, timeout=T)
                except (EpochSpent, TravelHalted):
                    raise
                except GputravelError:
                    self._orch_moves_data(keys)
                    self.tainted = (orch.ledger.session, orch.ledger.epoch)
                    raise
                self._orch_moves_data(keys)
                if bytes(data) != self.gpu.vram_at(self.buf.offset, nbytes):
                    raise Violation("(c) the orchestrator read back something VRAM does not hold")
            elif act == "rpc":
                orch.query_buffer(self.buf.offset, timeout=T)
            elif act == "rotate":
                self.fresh_epoch()
            elif act == "careless_rotate":
                if orch.rotating:
                    orch.finish_rotation(timeout=T)
                else:
                    orch.rotate(timeout=T)
            else:
                self.claim = None
                orch.abandon_travel()
                self.rekey()
                assert self.gpu.vram.count(0) == len(self.gpu.vram), "a new SPDM session wipes VRAM"
            self.outcomes[f"orchestrator {act}: ok"] += 1
        except GputravelError as exc:
            self.outcomes[f"orchestrator {act}: {type(exc).__name__}"] += 1

    # ------------------------------------------------------------------ rules: the host
    @precondition(lambda self: len(self.armed) + len(self.switch_faults) < 3)
    @rule(at=st.integers(1, 14), fault=RING_FAULTS | st.tuples(st.just("switch"), TARGETS))
    def host_arms_a_fault(self, at, fault) -> None:
        """A fault for a later doorbell (``at`` rings from now), or for the next MUX switch the
        runtime asks for (the host puts the GPU elsewhere, or nowhere, and says it is done)."""
        self._arm((at, fault))

    def _arm(self, armed: tuple | None) -> None:
        if armed is None:
            return
        at, fault = armed
        if fault[0] == "switch":
            self.switch_faults.append(fault[1])
        else:
            self.armed.append((self.rings + at, fault))

    @rule(action=HOST_ACTIONS)
    def host_acts(self, action) -> None:
        kind = action[0]
        if kind == "forge":
            self._forge(action[1], action[2])
        elif kind == "service":
            self.gpu.core.service()
        elif kind == "switch":
            self.gpu.switch(action[1])
        elif kind == "resubmit":
            self._resubmit(action[1], action[2])
        elif kind == "restore":
            self._restore(action[1], self._capture(action[2]))
        elif kind == "hijack":
            self._hijack()

    # ------------------------------------------------------------------ rules: mallory
    @precondition(lambda self: self.mallory_blobs)
    @rule(index=st.integers(0, 1 << 10), action=st.sampled_from(["read", "read", "write", "rpc", "release"]))
    def mallory_uses_a_kept_blob(self, index, action) -> None:
        """With the host's help (the GPU switched to her), mallory uses any blob she kept."""
        gpu, m, buf = self.gpu, self.drivers[MALLORY], self.buf
        blob = self.mallory_blobs[index % len(self.mallory_blobs)]
        previous = gpu.current
        gpu.switch(MALLORY)
        try:
            if m.has_context:
                m.export_context()
            m.import_context(blob)
            if action == "read":
                self._loot(m.copy_from_vram(buf.offset, BUFFER, timeout=T), "mallory, with a kept blob,")
            elif action == "write":
                m.copy_to_vram(memoryview(public_chunk(RECORD + 9)), buf.offset, buffer_bytes=BUFFER, timeout=T)
            elif action == "rpc":
                m.query_buffer(buf.offset, timeout=T)
            else:
                value = m.next_release(USER)
                m.submit(USER, SemaphoreRelease(release=value, interrupt=True), timeout=T)
                m.wait_release(USER, value, timeout=T)
            self.outcomes[f"mallory {action}: worked"] += 1
        except GputravelError as exc:
            self.outcomes[f"mallory {action}: {type(exc).__name__}"] += 1
        finally:
            if m.has_context:
                m.export_context()
            gpu.switch(previous)

    def _hijack(self) -> None:
        """The last CVM to run SPDM owns the GPU (and the device wipes VRAM for it)."""
        gpu = self.gpu
        previous = gpu.current
        gpu.switch(MALLORY)
        self.claim = None
        try:
            hijacker = OrchestratorDriver(gpu.links[MALLORY], clock=gpu.clock)
            hijacker.establish_session(timeout=T)
            self.mallory_keys |= held_user_keys(hijacker)
            self.outcomes["hijack: worked"] += 1
        except GputravelError as exc:
            self.outcomes[f"hijack: {type(exc).__name__}"] += 1
        finally:
            gpu.switch(previous)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def nothing_recorded_at_a_doorbell(self) -> None:
        if self.violations:
            raise Violation(self.violations[0])

    @invariant()
    def the_host_sees_no_plaintext(self) -> None:
        if holds_magic(self.gpu.snoop()):
            raise Violation("(b) a secret chunk is readable in sysmem or BAR0")

    @invariant()
    def mallory_never_had_keys_anyone_else_moved_data_under(self) -> None:
        if self.mallory_keys & self.data_keys:
            raise Violation("(b) mallory holds keys another party's data moved under")

    @invariant()
    def each_export_went_to_one_party(self) -> None:
        seen: set[bytes] = set()
        epochs: set[tuple[int, int]] = set()
        for _, session, epoch, keys in self.sent:
            if keys & seen or (session, epoch) in epochs:
                raise Violation("(a) an epoch's user keys were exported twice")
            seen |= keys
            epochs.add((session, epoch))

    @invariant()
    def the_device_is_on_the_orchestrators_epoch(self) -> None:
        if not hasattr(self, "orch"):
            return
        orch, core = self.orch, self.gpu.core
        ledger = orch.ledger
        if ledger.halted is not None:
            return
        if ledger.epoch != orch.key_epoch:
            raise Violation("(d) the ledger moved without the driver (or the other way round) and is not halted")
        if core._session_secret == session_secret(orch) and not orch.rotating and core.epoch != orch.key_epoch:
            raise Violation(f"(d) travel is not halted but the device is on epoch {core.epoch}, "
                            f"the orchestrator on {orch.key_epoch}")

    @invariant()
    def the_user_channel_counters_are_in_step(self) -> None:
        if not hasattr(self, "orch"):
            return
        orch, core = self.orch, self.gpu.core
        if core._session_secret is None or core._session_secret != session_secret(orch):
            return
        for label in USER_LABELS:
            mine = orch.keys.tx.get(label) if is_h2d(label) else orch.keys.rx.get(label)
            device = core._rx.get(label) if is_h2d(label) else core._tx.get(label)
            if mine is not None and device is not None and mine.channel_counter != device.channel_counter:
                raise Violation(f"(d) the orchestrator's {label} channel counter ({mine.channel_counter}) is not "
                                f"the device's ({device.channel_counter})")

    @invariant()
    def only_the_orchestrator_changes_its_buffer(self) -> None:
        """While the device is on an epoch no holder had (fresh, or used by the orchestrator
        alone) and nothing of the orchestrator's may still land, the dataset buffer changes
        only by the orchestrator's hand: whatever the host and mallory do in between."""
        if not hasattr(self, "orch"):
            return
        orch, ledger = self.orch, self.orch.ledger
        secure = (ledger.halted is None and ledger.use is not EpochUse.EXPORTED and not orch.away
                  and not orch.rotating and self.gpu.core._session_secret == session_secret(orch)
                  and (ledger.session, ledger.epoch) != self.tainted  # its own copies may still land
                  and orch._sem[KERNEL] >= orch._kernel_issued)  # and its own scrubs
        if not secure:
            self.claim = None
            return
        now = self.gpu.vram_at(self.buf.offset, BUFFER)
        if self.claim is None:
            self.claim = now
        elif now != self.claim:
            raise Violation("(c) the dataset buffer changed while only the orchestrator had the device's keys")

    def teardown(self) -> None:
        if hasattr(self, "orch"):
            for link in self.gpu.links.values():
                link.before_service = link.while_waiting = None


PROPERTY = settings(max_examples=examples(60), stateful_step_count=25, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
EpochMachine.TestCase.settings = PROPERTY
TestEpochInvariants = EpochMachine.TestCase


# ---------------------------------------------------------------------------- the machine has teeth
HUNT = settings(PROPERTY, max_examples=examples(300), phases=[Phase.generate], report_multiple_bugs=False)


def _export_without_the_check(self: EpochLedger) -> int:
    self.use = EpochUse.EXPORTED  # what export did before issue 12: no refusal at all
    return self.epoch


def _copy_without_the_check(self: EpochLedger) -> None:
    self.use = EpochUse.ORCHESTRATOR


@pytest.mark.parametrize("disabled", ["export", "use_for_copy"])
def test_the_machine_catches_a_double_export(monkeypatch, disabled: str) -> None:
    """With the ledger's check removed, the machine finds an epoch's keys reaching two
    parties (a careless runtime that skips a rotation is enough)."""
    monkeypatch.setattr(EpochLedger, disabled, _export_without_the_check if disabled == "export"
                        else _copy_without_the_check)
    with pytest.raises(AssertionError, match=r"^\((a|b)\)"):
        run_state_machine_as_test(EpochMachine, settings=HUNT)


@pytest.mark.parametrize("how", ["duplicate_labels", "swapped_groups"])
def test_a_returned_context_cannot_smuggle_channel_state_past_the_checks(how: str) -> None:
    """Found by this machine (review of issue 12): import_returned compared the keys and
    counters of senders and receivers merged by label, and the driver installed them by
    side. A blob carrying the h2d states twice (checked copies among the receivers, moved ones
    among the senders) passed the channel-counter check and put the user channel out of step
    for good (every later travel faulted, until a re-key); one with the sides swapped left the
    driver without its receivers (a KeyError at its next RPC)."""
    gpu = InProcessGpu()
    orch, _ = gpu.boot(MALLORY)
    sent = orch.export_for_travel()
    with pytest.raises(ContextBlobError):
        orch.import_returned(tamper_blob(sent, how, None))
    orch.import_returned(sent)
    orch.rotate()
    for label in USER_LABELS:
        mine = orch.keys.tx[label] if is_h2d(label) else orch.keys.rx[label]
        device = gpu.core._rx[label] if is_h2d(label) else gpu.core._tx[label]
        assert mine.channel_counter == device.channel_counter


def test_the_machine_catches_channel_state_smuggled_in_a_duplicate(monkeypatch) -> None:
    """Without the one-channel-once check on context blobs, the machine finds an invariant
    broken ((d), counters out of step, before the check existed; with unique release values it
    meets (a) first: keys of one side installed as the other's)."""
    from gputravel.driver import context

    monkeypatch.setattr(context, "_check_channels", lambda ctx: None)
    with pytest.raises(AssertionError, match=r"^\([a-d]\)"):
        run_state_machine_as_test(EpochMachine, settings=HUNT)


# ---------------------------------------------------------------------------- gaps found, now fixed
def test_a_certificate_the_host_tampered_with_during_a_rekey_is_a_typed_error() -> None:
    gpu = InProcessGpu()
    orch, _ = gpu.boot()
    ec_public_key = bytes.fromhex("06072a8648ce3d0201")  # the OID id-ecPublicKey, in the leaf's DER
    response = slice(LAYOUT.rpc_response_offset, LAYOUT.rpc_response_offset + 64 * 1024)

    def flip_the_key_algorithm(link) -> bool:
        gpu.core.service()
        at = link.sysmem[response].find(ec_public_key)
        if at >= 0:
            link.sysmem[LAYOUT.rpc_response_offset + at + len(ec_public_key) - 1] ^= 0x01
        return False

    gpu.links[HOME].before_service = flip_the_key_algorithm
    with pytest.raises(GputravelError):
        orch.rekey(timeout=T)


def _late_then_dropped(gpu: InProcessGpu, first, second):
    """The host drops the doorbell of ``first()`` (it times out), delivers it late, then drops
    the doorbell of ``second()``; returns what ``second()`` returned."""
    link = gpu.links[HOME]
    link.before_service = lambda _: False
    with pytest.raises(GputravelError):
        first()
    link.before_service = None
    gpu.core.service()  # the first one's pushes run now, and release their values
    link.before_service = lambda _: False
    try:
        return second()
    finally:
        link.before_service = None


def test_a_copy_returns_only_once_its_own_records_landed() -> None:
    gpu = InProcessGpu()
    orch, _ = gpu.boot()
    buf = orch.alloc_dataset_buffer(BUFFER)
    first, second = secret_chunk(16), secret_chunk(1000)
    copy = lambda data: orch.copy_to_vram(memoryview(data), buf.offset, buffer_bytes=buf.nbytes, timeout=T)  # noqa: E731
    try:
        _late_then_dropped(gpu, lambda: copy(first), lambda: copy(second))
    except GputravelError:
        return  # not confirmed: the fix
    assert gpu.vram_at(buf.offset, len(second)) == second, "the second copy returned, VRAM holds the first"


def test_a_read_returns_the_range_it_asked_for() -> None:
    gpu = InProcessGpu()
    orch, _ = gpu.boot()
    buf = orch.alloc_dataset_buffer(BUFFER)
    a, b = os.urandom(RECORD), os.urandom(RECORD)
    gpu.vram[buf.offset : buf.offset + 2 * RECORD] = a + b  # as if copied in earlier
    try:
        got = _late_then_dropped(gpu, lambda: orch.copy_from_vram(buf.offset, 64, timeout=T),
                                 lambda: orch.copy_from_vram(buf.offset + RECORD, 64, timeout=T))
    except GputravelError:
        return  # not confirmed: the fix
    assert bytes(got) == b[:64], "the read of the second record returned the first record"


@pytest.mark.parametrize("base", [bytes(64), bytes(range(64)), MAGIC[:13] * 5, MAGIC[:14] * 5])
def test_holds_magic_is_the_in_operator(base: bytes) -> None:
    """The invariants' fast search finds MAGIC exactly where `in` does: whole, cut short, at either end."""
    for at in (0, 1, 23, len(base) - len(MAGIC), len(base) - 3):
        for needle in (MAGIC, MAGIC[:-1], MAGIC[1:], MAGIC[:-1] + b"\xfe"):
            data = bytearray(base)
            data[at : at + len(needle)] = needle
            assert holds_magic(data) == (MAGIC in data) == holds_magic(bytes(data)), (at, needle)
