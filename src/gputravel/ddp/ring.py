"""Ring all-reduce between GPU TEEs over torch.distributed point-to-point, every hop sealed.

N - 1 scatter-reduce hops then N - 1 all-gather hops, one segment per rank; each hop leaves the
GPU package, so the sender seals it and the receiver opens it. Variants, for the benchmark:
`plain` (no encryption), `naive` (a hop's records all sealed, sent, received, then opened) and
`pipelined` (record k of the next hop is sealed and sent as soon as record k of this one is
reduced). All add in the same order, so their sums are bit-identical. Without a variant named,
a ring takes `default_variant` for this machine's cores.

Security (docs/security.md row 37): per-direction keys (ddp/keys.py), receiver-tracked IVs and an
AAD naming (all-reduce, hop, segment, record, sender, receiver): a replayed, moved or dropped
record stops the all-reduce with a typed error and breaks the ring. Framing: the wire carries no
length; each rank opens exactly the length it computes. gloo aborts on a message longer than its
receive, so a sealed ring posts every receive at one size for its whole life (`slot_bytes`), and
consecutive all-reduces alternate two gloo tags (`lane`).
"""

from __future__ import annotations

import enum
import os
import struct
import threading
from datetime import timedelta
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from gputravel.crypto.channel import TAG_BYTES
from gputravel.ddp.keys import PairKeys
from gputravel.errors import BadInput, ChannelFaulted, IntegrityError, PeerTimeout, TransportClosed

__all__ = ["DEFAULT_RECORD_BYTES", "DEFAULT_TIMEOUT_S", "LANES", "PointToPoint", "Ring", "TorchPointToPoint", "Variant",
           "default_variant", "record_aad"]

# gloo costs about 0.1 ms a message with more ranks than cores (issue 31: 4 ranks on 2 cores, 3.2M
# float32, the plain ring 26 ms at 1 MiB and 22 at 4 MiB against gloo's 19): few large records.
DEFAULT_RECORD_BYTES = 4 << 20
DEFAULT_TIMEOUT_S = 120.0
LANES = 2  # gloo tags a ring takes turns with, one per all-reduce (see Framing above)
_AAD = struct.Struct("<QIIIII")  # all-reduce number, hop, segment, record, sender, receiver
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Variant(enum.StrEnum):
    PLAIN = "plain"
    NAIVE = "naive"
    PIPELINED = "pipelined"


def default_variant(world_size: int, cores: int | None = None) -> Variant:
    """Pipelined where each rank has a core of its own (`cores`: this process's, by default), naive
    otherwise. Issue 31: with more ranks than cores, gloo's socket copies, sealing and opening all
    compete for the same cores, no core is idle for the overlap, and pipelining only added messages
    (4 ranks on 2 cores, 3.2M float32: naive 53 ms, pipelined 60-65 ms). Either variant
    interoperates with the other: the records on the wire are the same."""
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return Variant.PIPELINED if cores >= world_size else Variant.NAIVE


def record_aad(op: int, hop: int, segment: int, record: int, sender: int, receiver: int) -> bytes:
    """The associated data of one record: where in which all-reduce it belongs."""
    return _AAD.pack(op, hop, segment, record, sender, receiver)


# ----------------------------------------------------------------------------- the wire
class Work(Protocol):
    def wait(self, timeout: timedelta = ...) -> bool: ...


class PointToPoint(Protocol):
    """What the ring needs from the wire (a test wraps it to tamper): ranks are the group's; a
    receive is matched only by a send of its `lane`, in order, and may be longer than the message."""

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
    """In-place sum all-reduce of a contiguous CPU float tensor over a ring of ranks. Collective
    (every rank, same size and dtype, same order); one caller at a time."""

    def __init__(self, variant: Variant | str | None = None, *, keys: PairKeys | None = None,
                 record_bytes: int = DEFAULT_RECORD_BYTES, group: dist.ProcessGroup | None = None,
                 p2p: PointToPoint | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.p2p: PointToPoint = p2p if p2p is not None else TorchPointToPoint(group)
        try:  # None: the default for this machine's cores (default_variant)
            self.variant = default_variant(self.p2p.world_size) if variant is None else Variant(variant)
        except ValueError:
            raise BadInput(f"unknown ring variant {variant!r}: use {', '.join(v.value for v in Variant)}") from None
        if type(record_bytes) is not int or record_bytes < 16:
            raise BadInput("record_bytes must be an int of at least 16")
        if not timeout_s > 0:
            raise BadInput("timeout_s must be positive")
        self.record_bytes = record_bytes
        self.rank, self.world_size = self.p2p.rank, self.p2p.world_size
        self._timeout = timedelta(seconds=timeout_s)
        self._next, self._prev = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        self._sealed = self.variant is not Variant.PLAIN and self.world_size > 1
        # Every sealed receive: the longest record the ring can send (Framing), 8-aligned.
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
        """Sum `tensor` over the ring, in place. On an error it is partly reduced and the ring broken."""
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
            self._broken = type(err).__name__  # the peers' counters are now out of step with ours
            # Pending operations stay referenced: no pending receive's buffer is freed under gloo.
            self._abandoned = (one.sends, one.recvs)
            raise
        return tensor

    def _buffers(self, nbytes: int) -> torch.Tensor:
        if self._slab.numel() < nbytes:
            self._slab = torch.empty(nbytes, dtype=torch.uint8)
        return self._slab

    def _post(self, post: Callable[[torch.Tensor, int, int], Work], buf: torch.Tensor, peer: int, lane: int,
              what: str) -> Work:
        # gloo may fail a post at once, when the peer has already gone: the same typed error as a wait.
        try:
            return post(buf, peer, lane)
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
        # Receives: sealed, the ring's one size (Framing); plain, this all-reduce's record. Sends:
        # this record and its tag, rounded up to 8. Every size keeps views aligned.
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

    # The segment sent at each hop (0..N-2 scatter-reduce, then all-gather); received = next hop's sent.
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
                self.received(hop, k)
                self.reduce(hop, k)
                if hop + 1 < self.hops:
                    self.send(hop + 1, k)  # record k of the next hop is the one that just landed
        for hop, k in list(self.sends):
            self.sent(hop, k)

    def run_in_turn(self) -> None:
        """The naive schedule: each hop's records all sealed, sent, received, then opened and reduced."""
        self.post_receives(0)
        for hop in range(self.hops):
            outgoing = range(len(self.records[self.outgoing(hop)]))
            sealed = [self.seal(hop, k) for k in outgoing]
            for k in outgoing:
                self.post_send(hop, k, sealed[k])
            if hop + 1 < self.hops:
                self.post_receives(hop + 1)
            incoming = range(len(self.records[self.incoming(hop)]))
            for k in incoming:
                self.received(hop, k)
            for k in incoming:
                self.reduce(hop, k)
        for hop, k in list(self.sends):
            self.sent(hop, k)

    def post_send(self, hop: int, k: int, buf: torch.Tensor) -> None:
        ring = self.ring
        self.sends[(hop, k)] = ring._post(ring.p2p.isend, buf, ring._next, self.lane, f"send of hop {hop} record {k}")

    def sent(self, hop: int, k: int) -> None:
        """Wait until send (hop, k), if still pending, is off the wire (its buffer is reused next)."""
        work = self.sends.get((hop, k))
        if work is not None:
            self.ring._wait(work, f"send of hop {hop} record {k}")
            del self.sends[(hop, k)]

    def received(self, hop: int, k: int) -> None:
        self.ring._wait(self.recvs[(hop, k)], f"receive of hop {hop} record {k}")
        del self.recvs[(hop, k)]

    def send(self, hop: int, k: int) -> None:
        if self.ring._sealed:
            self.post_send(hop, k, self.seal(hop, k))
        else:
            start, stop = self.records[self.outgoing(hop)][k]
            self.post_send(hop, k, self.flat[start:stop])

    def seal(self, hop: int, k: int) -> torch.Tensor:
        """Record k of `hop`, sealed into its send buffer (once the send that used it last is done)."""
        ring, segment = self.ring, self.outgoing(hop)
        start, stop = self.records[segment][k]
        self.sent(hop - 2, k)  # the last user of this send buffer
        out = self.send_bufs[hop % 2][k][: (stop - start) * self.item + TAG_BYTES]
        plaintext = self.flat[start:stop].view(torch.uint8).numpy()
        ring._sender.encrypt_into(plaintext, out.numpy(),
                                  record_aad(self.op, hop, segment, k, ring.rank, ring._next))
        return out

    def post_receives(self, hop: int) -> None:
        ring = self.ring
        for k, (start, stop) in enumerate(self.records[self.incoming(hop)]):
            if ring._sealed:
                # The whole slot however short the record: whatever the wire puts here fits (Framing).
                buf = self.recv_bufs[hop % 2][k]
            elif self.scatter(hop):
                buf = self.recv_bufs[hop % 2][k][: (stop - start) * self.item]
            else:
                # Lands in place, over what this rank sent at hop - N + 1: that must be off the wire.
                self.sent(hop - ring.world_size + 1, k)
                buf = self.flat[start:stop]
            self.recvs[(hop, k)] = ring._post(ring.p2p.irecv, buf, ring._prev, self.lane,
                                              f"receive of hop {hop} record {k}")

    def reduce(self, hop: int, k: int) -> None:
        """Record k of `hop`, received: opened (sealed rings) and added or copied into place."""
        ring, segment = self.ring, self.incoming(hop)
        start, stop = self.records[segment][k]
        nbytes = (stop - start) * self.item
        if ring._sealed:
            # At our own length, never the wire's. GCM writes before it verifies: a sum goes through
            # scratch, added only once verified; an all-gather record opens in place, its slot
            # overwritten either way, and on a forgery the Receiver zeroes it and the all-reduce fails.
            out = self.scratch[:nbytes] if self.scatter(hop) else self.flat[start:stop].view(torch.uint8)
            try:
                ring._receiver.decrypt_into(self.recv_bufs[hop % 2][k][: nbytes + TAG_BYTES].numpy(), out.numpy(),
                                            record_aad(self.op, hop, segment, k, ring._prev, ring.rank))
            except IntegrityError:
                raise IntegrityError(f"all-reduce record from rank {ring._prev} (hop {hop}, segment {segment}, "
                                     f"record {k}) failed authentication: tampered, replayed, dropped or "
                                     f"resized") from None
            if not self.scatter(hop):
                return  # opened in place
            got = self.scratch[:nbytes].view(self.flat.dtype)
        elif self.scatter(hop):
            got = self.recv_bufs[hop % 2][k][:nbytes].view(self.flat.dtype)
        else:
            return  # plain all-gather received in place
        if self.scatter(hop):
            self.flat[start:stop].add_(got)
        else:
            self.flat[start:stop].copy_(got)
