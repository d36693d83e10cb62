"""Ring all-reduce between GPU TEEs over torch.distributed point-to-point, every hop sealed.

The ring (as DDP's backends run it): the flat tensor is cut into one segment per rank. In
N - 1 scatter-reduce hops each rank sends one segment to the next rank and adds the segment it
receives from the previous one, so that each rank ends with one fully reduced segment; in
N - 1 all-gather hops the reduced segments go once more around the ring. Each hop leaves the
GPU package, so in a GPU TEE the sender seals it (AES-256-GCM: encrypt and MAC) and the
receiver opens it (decrypt and verify). That is the cost the DDP characterization measures.

Three variants, so that a benchmark shows what each idea buys:

* `plain`: no encryption. The hook's own ring: equal to itself bit for bit, and to gloo's
  all_reduce within float tolerance.
* `naive`: as the characterization describes. A hop's whole segment is sealed, sent, received
  and opened in turn, and only then does the next hop start: nothing overlaps. The segment
  travels as records of at most `record_bytes` (as in `pipelined`; see Framing), all sealed
  before the first is sent, all received before the first is opened.
* `pipelined`: Fastrack's ideas on the ring. Segments travel as records of `record_bytes`.
  As soon as record k of a hop is opened and reduced, record k of the next hop is sealed and
  sent, while records k+1.. of this hop are still on the wire: sealing overlaps sending and
  opening overlaps receiving (gloo's own thread fills the receive buffers meanwhile). Records
  are sealed into and opened from preallocated buffers: no Python byte copies per hop.
  Fastrack also authenticates independent records in parallel. That was measured here and
  left out: cryptography's AES-GCM does release the GIL (two threads seal 2x faster), but two
  independent record streams per link, on two threads, gained nothing measurable on a 2-core
  machine whose cores the ranks and gloo already keep busy (16 MB: 13.3 vs 14.0 ms with 2
  ranks, 36.3 vs 34.7 ms with 4), so each link keeps one stream and one IV sequence.

All three run the same schedule and add the same operands in the same order, so their sums
are bit-identical; only where the bytes sit while they travel differs.

Security. Every direction of every ring link has its own key (ddp/keys.py) and the receiver
tracks the IV (crypto/channel.Receiver), so a replayed, reordered or dropped record fails
authentication. Each record's AAD binds (all-reduce number, hop, segment, record, sender,
receiver), so a record moved to another place fails too. Any failure raises a typed error and
stops the all-reduce before the tensor is handed back: the step fails, it never sums wrong. The
ring is then broken (its counters are out of step with its peers'): later calls raise
ChannelFaulted until new keys make a new ring.

Framing. The wire carries no length: each rank computes every record's place and length from
the tensor's size, and opens exactly that many bytes of what arrives (AES-GCM authenticates the
ciphertext's length, so a record of another length fails its tag; bytes past that length are
never read). What the transport may do with a message of the wrong length is the other half.
gloo accepts a message shorter than the receive posted for it but ends the whole process
(std::terminate, SIGABRT) on a longer one, so a host that delivers a longer record in a
receive's place (the next one after a drop, or a record of an earlier, larger all-reduce
replayed into a later, smaller one, as DDP's buckets of different sizes allow) would kill the
receiving rank before it could say why. So a sealed ring posts every receive, of every
all-reduce and both variants, at one size for its whole life (`slot_bytes`): the longest record
it can ever send, `record_bytes` (rounded up to 8) and the GCM tag. No record is longer than
`record_bytes` of plaintext (the naive variant's segments travel in such records too), so
whatever record the host delivers, of this all-reduce or any earlier one, fits the receive it
lands in, and a failure is the typed error above (a replayed earlier record fails its counter
and its AAD). The buffers are preallocated per record slot and reused across all-reduces.
Consecutive all-reduces still use two gloo tags in turn (`lane`), so that a failed all-reduce's
pending receives do not take the next all-reduce's records (after a failure no rank completes
the next all-reduce, which needs the broken rank's records). A missing record that nothing takes
the place of, such as the last one of an all-reduce, is a PeerTimeout after `timeout_s`. Sends
are not padded: no byte is added to the wire. What the ring cannot reach is gloo's own framing:
a host that rewrites gloo's headers on the TCP stream to announce a message longer than any
receive still ends the process inside gloo. The plain ring, which checks nothing, keeps
exact-length receives (its all-gather lands in place).
"""

from __future__ import annotations

import enum
import struct
import threading
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from gputravel.crypto.channel import TAG_BYTES
from gputravel.ddp.keys import PairKeys
from gputravel.errors import BadInput, ChannelFaulted, IntegrityError, PeerTimeout, TransportClosed

__all__ = [
    "DEFAULT_RECORD_BYTES",
    "DEFAULT_TIMEOUT_S",
    "LANES",
    "PointToPoint",
    "Ring",
    "TorchPointToPoint",
    "Variant",
    "record_aad",
]

DEFAULT_RECORD_BYTES = 1 << 20
DEFAULT_TIMEOUT_S = 120.0
LANES = 2  # gloo tags a ring takes turns with, one per all-reduce (see Framing above)
_AAD = struct.Struct("<QIIIII")  # all-reduce number, hop, segment, record, sender, receiver
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Variant(enum.StrEnum):
    PLAIN = "plain"
    NAIVE = "naive"
    PIPELINED = "pipelined"


def record_aad(op: int, hop: int, segment: int, record: int, sender: int, receiver: int) -> bytes:
    """The associated data of one record: where in which all-reduce it belongs."""
    return _AAD.pack(op, hop, segment, record, sender, receiver)


# ----------------------------------------------------------------------------- the wire
class Work(Protocol):
    def wait(self, timeout: timedelta = ...) -> bool: ...


class PointToPoint(Protocol):
    """What the ring needs from the wire: ranks are the group's. A test wraps it to tamper.

    `lane` (0 .. LANES - 1) keeps the messages of one all-reduce apart from the next one's:
    a receive of one lane is matched only by a send of the same lane, in order. A receive's
    buffer may be longer than the message it gets (a sealed ring posts each at `slot_bytes`)."""

    rank: int
    world_size: int

    def isend(self, buf: torch.Tensor, dst: int, lane: int) -> Work: ...

    def irecv(self, buf: torch.Tensor, src: int, lane: int) -> Work: ...


class TorchPointToPoint:
    """torch.distributed isend/irecv within `group` (gloo on CPU), lane l on gloo tag
    `tag * LANES + l`: two rings on one group need different `tag`s."""

    def __init__(self, group: dist.ProcessGroup | None = None, tag: int = 0) -> None:
        self.group, self.tag = group, tag
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        # isend/irecv take global ranks; the ring thinks in the group's.
        self._global = [r if group is None else dist.get_global_rank(group, r) for r in range(self.world_size)]

    def isend(self, buf: torch.Tensor, dst: int, lane: int) -> Work:
        return dist.isend(buf, self._global[dst], group=self.group, tag=self.tag * LANES + lane)

    def irecv(self, buf: torch.Tensor, src: int, lane: int) -> Work:
        return dist.irecv(buf, self._global[src], group=self.group, tag=self.tag * LANES + lane)


# ----------------------------------------------------------------------------- the ring
class Ring:
    """In-place sum all-reduce of a contiguous CPU float tensor over a ring of ranks.

    Collective: every rank calls `all_reduce` with a tensor of the same size and dtype, in
    the same order. Not thread-safe: one caller at a time (the DDP hook runs it on one thread).
    """

    def __init__(self, variant: Variant | str = Variant.PIPELINED, *, keys: PairKeys | None = None,
                 record_bytes: int = DEFAULT_RECORD_BYTES, group: dist.ProcessGroup | None = None,
                 p2p: PointToPoint | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        try:
            self.variant = Variant(variant)
        except ValueError:
            raise BadInput(f"unknown ring variant {variant!r}: use {', '.join(v.value for v in Variant)}") from None
        if type(record_bytes) is not int or record_bytes < 16:
            raise BadInput("record_bytes must be an int of at least 16")
        if not timeout_s > 0:
            raise BadInput("timeout_s must be positive")
        self.record_bytes = record_bytes
        self.p2p: PointToPoint = p2p if p2p is not None else TorchPointToPoint(group)
        self.rank, self.world_size = self.p2p.rank, self.p2p.world_size
        self._timeout = timedelta(seconds=timeout_s)
        self._next, self._prev = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        self._sealed = self.variant is not Variant.PLAIN and self.world_size > 1
        # Every receive of a sealed ring, and every buffer of a record slot: the longest record
        # the ring can ever send, whatever the tensor (Framing). A multiple of 8: views stay aligned.
        self.slot_bytes = -(-record_bytes // 8) * 8 + TAG_BYTES if self._sealed else 0
        if self._sealed:
            if keys is None or keys.rank != self.rank or keys.world_size != self.world_size:
                raise BadInput("an encrypted ring needs this rank's PairKeys for the same group")
            self._sender = keys.sender(self._next)
            self._receiver = keys.receiver(self._prev)
        self._op = 0  # all-reduces done: the first field of every record's AAD
        self._slab = torch.empty(0, dtype=torch.uint8)  # send, receive and scratch buffers
        self._broken: str | None = None
        self._busy = threading.Lock()  # one all-reduce at a time: two would seal under the same IVs
        self._abandoned: tuple[dict, dict] = ({}, {})  # a failed all-reduce's pending operations

    def __repr__(self) -> str:
        return (f"Ring(variant={self.variant.value!r}, rank={self.rank}, world_size={self.world_size}, "
                f"record_bytes={self.record_bytes}, broken={self._broken is not None})")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ring, in place; returns it.

        On an error the tensor's contents are undefined (partly reduced) and the ring is broken.
        """
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or tensor.dtype not in _DTYPES \
                or not tensor.is_contiguous():
            raise BadInput("the ring reduces a contiguous CPU floating-point tensor")
        if self.world_size == 1 or tensor.numel() == 0:
            return tensor
        if not self._busy.acquire(blocking=False):
            self._broken = "a concurrent all_reduce"
            raise ChannelFaulted("the ring reduces one tensor at a time: a second caller broke it")
        try:
            return self._all_reduce(tensor)
        finally:
            self._busy.release()

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._broken is not None:
            raise ChannelFaulted(f"the ring stopped after {self._broken}; establish new keys and a new ring")
        op, self._op = self._op, self._op + 1
        one = _Pass(self, tensor.view(-1), op)
        try:
            one.run()
        except BaseException as err:
            # The peers' counters and pending operations are now out of step with ours.
            self._broken = type(err).__name__
            # What is already on the wire stays there: records sent before the failure still
            # reach the ranks that need them, and no pending receive's buffer is freed under gloo.
            self._abandoned = (one.sends, one.recvs)
            raise
        return tensor

    # Used by _Pass.
    def _buffers(self, nbytes: int) -> torch.Tensor:
        if self._slab.numel() < nbytes:
            self._slab = torch.empty(nbytes, dtype=torch.uint8)
        return self._slab

    def _post(self, send: bool, buf: torch.Tensor, lane: int, what: str) -> Work:
        # gloo may fail a post at once, when the peer has already gone: the same typed error as a wait.
        try:
            if send:
                return self.p2p.isend(buf, self._next, lane)
            return self.p2p.irecv(buf, self._prev, lane)
        except RuntimeError as err:
            raise self._typed(err, what) from None

    def _wait(self, work: Work, what: str) -> None:
        try:
            done = work.wait(self._timeout)
        except RuntimeError as err:  # gloo reports a timeout and a dead peer alike
            raise self._typed(err, what) from None
        if done is False:  # a transport that answers instead of raising: the buffer is not there
            raise PeerTimeout(f"ring: {what} did not complete in {self._timeout.total_seconds():g} s")

    def _typed(self, err: RuntimeError, what: str) -> PeerTimeout | TransportClosed:
        if any(word in str(err).lower() for word in ("timed out", "timeout")):
            return PeerTimeout(f"ring: {what} did not complete in {self._timeout.total_seconds():g} s")
        return TransportClosed(f"ring: {what} failed: the link to a peer broke")


class _Pass:
    """One all-reduce: the segment and record layout, the buffers, and the hop schedule."""

    def __init__(self, ring: Ring, flat: torch.Tensor, op: int) -> None:
        self.ring, self.flat, self.op = ring, flat, op
        self.lane = op % LANES
        n, self.item = ring.world_size, flat.element_size()
        self.hops = 2 * (n - 1)
        base, extra = divmod(flat.numel(), n)
        starts = [i * base + min(i, extra) for i in range(n + 1)]
        longest = base + (1 if extra else 0)
        per_record = max(1, min(ring.record_bytes // self.item, longest))  # never past record_bytes
        # records[segment] = [(start, stop), ...] in elements of `flat`
        self.records = [[(s, min(s + per_record, starts[c + 1])) for s in range(starts[c], starts[c + 1], per_record)]
                        for c in range(n)]
        slots = max(len(r) for r in self.records)
        # Receives: sealed, the ring's one size for its whole life, however short this tensor's
        # records (Framing); plain, this all-reduce's record. Sends: this all-reduce's record and
        # its tag, rounded up to 8. Every size a multiple of 8 (sealed) or of the item (plain),
        # so views stay aligned.
        self.slot_bytes = ring.slot_bytes if ring._sealed else per_record * self.item
        send_bytes = -(-per_record * self.item // 8) * 8 + TAG_BYTES
        send_area = 2 * slots * send_bytes if ring._sealed else 0
        slab = ring._buffers(send_area + 2 * slots * self.slot_bytes + per_record * self.item)
        self.send_bufs = [[slab[(p * slots + k) * send_bytes:][:send_bytes] for k in range(slots)]
                          for p in range(2)] if ring._sealed else []
        recv = slab[send_area:]
        self.recv_bufs = [[recv[(p * slots + k) * self.slot_bytes:][: self.slot_bytes] for k in range(slots)]
                          for p in range(2)]
        self.scratch = recv[2 * slots * self.slot_bytes:][: per_record * self.item]
        self.sends: dict[tuple[int, int], Work] = {}
        self.recvs: dict[tuple[int, int], Work] = {}

    # Which segment a rank sends and receives at each hop (hops 0..N-2 scatter-reduce, the rest
    # all-gather). The segment received at hop h is the one sent at hop h + 1.
    def outgoing(self, hop: int) -> int:
        n, r = self.ring.world_size, self.ring.rank
        return (r - hop) % n if hop < n - 1 else (r + 1 - (hop - n + 1)) % n

    def incoming(self, hop: int) -> int:
        return self.outgoing(hop + 1)

    def scatter(self, hop: int) -> bool:
        return hop < self.ring.world_size - 1

    def run(self) -> None:
        if self.ring.variant is Variant.NAIVE:
            self.run_in_turn()
            return
        self.post_receives(0)
        for k in range(len(self.records[self.outgoing(0)])):
            self.send(0, k)
        for hop in range(self.hops):
            if hop + 1 < self.hops:
                self.post_receives(hop + 1)
            for k in range(len(self.records[self.incoming(hop)])):
                self.land(hop, k)
                if hop + 1 < self.hops:
                    self.send(hop + 1, k)  # record k of the next hop is the one that just landed
        for (hop, k), work in self.sends.items():
            self.ring._wait(work, f"send of hop {hop} record {k}")

    def run_in_turn(self) -> None:
        """The naive schedule: a hop's records all sealed, then all sent; all received, then all
        opened and reduced; then the next hop."""
        ring = self.ring
        self.post_receives(0)
        for hop in range(self.hops):
            outgoing = range(len(self.records[self.outgoing(hop)]))
            sealed = [self.seal(hop, k) for k in outgoing]
            for k in outgoing:
                self.sends[(hop, k)] = ring._post(True, sealed[k], self.lane, f"send of hop {hop} record {k}")
            if hop + 1 < self.hops:
                self.post_receives(hop + 1)
            incoming = range(len(self.records[self.incoming(hop)]))
            for k in incoming:
                ring._wait(self.recvs.pop((hop, k)), f"receive of hop {hop} record {k}")
            for k in incoming:
                self.reduce(hop, k)
        for (hop, k), work in self.sends.items():
            ring._wait(work, f"send of hop {hop} record {k}")

    def send(self, hop: int, k: int) -> None:
        ring = self.ring
        if not ring._sealed:
            start, stop = self.records[self.outgoing(hop)][k]
            self.sends[(hop, k)] = ring._post(True, self.flat[start:stop], self.lane, f"send of hop {hop} record {k}")
            return
        self.sends[(hop, k)] = ring._post(True, self.seal(hop, k), self.lane, f"send of hop {hop} record {k}")

    def seal(self, hop: int, k: int) -> torch.Tensor:
        """Record k of `hop`, sealed into its send buffer (once the send that used it last is done)."""
        ring, segment = self.ring, self.outgoing(hop)
        start, stop = self.records[segment][k]
        earlier = self.sends.pop((hop - 2, k), None)  # the last user of this send buffer
        if earlier is not None:
            ring._wait(earlier, f"send of hop {hop - 2} record {k}")
        out = self.send_bufs[hop % 2][k][: (stop - start) * self.item + TAG_BYTES]
        plaintext = self.flat[start:stop].view(torch.uint8).numpy()
        ring._sender.encrypt_into(plaintext, out.numpy(),
                                  record_aad(self.op, hop, segment, k, ring.rank, ring._next))
        return out

    def post_receives(self, hop: int) -> None:
        ring = self.ring
        for k, (start, stop) in enumerate(self.records[self.incoming(hop)]):
            if ring._sealed:
                # The whole slot, the ring's one receive size, however short this record: whatever
                # the wire puts here in its place fits, and `reduce` opens only this record's own
                # length (Framing, above).
                buf = self.recv_bufs[hop % 2][k]
            elif self.scatter(hop):
                buf = self.recv_bufs[hop % 2][k][: (stop - start) * self.item]
            else:
                # Plain all-gather lands in place, over the segment this rank sent at scatter-reduce
                # hop (hop - N + 1): that send must be off the wire first.
                earlier = self.sends.pop((hop - ring.world_size + 1, k), None)
                if earlier is not None:
                    ring._wait(earlier, f"send of hop {hop - ring.world_size + 1} record {k}")
                buf = self.flat[start:stop]
            self.recvs[(hop, k)] = ring._post(False, buf, self.lane, f"receive of hop {hop} record {k}")

    def land(self, hop: int, k: int) -> None:
        self.ring._wait(self.recvs.pop((hop, k)), f"receive of hop {hop} record {k}")
        self.reduce(hop, k)

    def reduce(self, hop: int, k: int) -> None:
        """Record k of `hop`, received: opened (sealed rings) and added or copied into place."""
        ring, segment = self.ring, self.incoming(hop)
        start, stop = self.records[segment][k]
        nbytes = (stop - start) * self.item
        if ring._sealed:
            # Opened into scratch, never into the gradient: GCM writes before it verifies. The
            # length is this rank's own, never the wire's: a record of another length fails here.
            try:
                ring._receiver.decrypt_into(self.recv_bufs[hop % 2][k][: nbytes + TAG_BYTES].numpy(),
                                            self.scratch[:nbytes].numpy(),
                                            record_aad(self.op, hop, segment, k, ring._prev, ring.rank))
            except IntegrityError:
                raise IntegrityError(f"all-reduce record from rank {ring._prev} (hop {hop}, segment {segment}, "
                                     f"record {k}) failed authentication: tampered, replayed, dropped or "
                                     f"resized") from None
            got = self.scratch[:nbytes].view(self.flat.dtype)
        elif self.scatter(hop):
            got = self.recv_bufs[hop % 2][k][:nbytes].view(self.flat.dtype)
        else:
            return  # plain all-gather received in place
        if self.scatter(hop):
            self.flat[start:stop].add_(got)
        else:
            self.flat[start:stop].copy_(got)
