"""The ring all-reduce between GPU TEEs (ddp/ring.py) and its DDP hook (ddp/hook.py), run by
real gloo ranks in child processes (the `run_ranks` fixture of conftest.py).

What it shows: the plain ring equals itself bit for bit and gloo's all_reduce to float
tolerance; the sealed variants give the plain ring's bits; DDP trained with the hook matches
DDP without one; a tampered, replayed or dropped record is a typed error on its receiver that
stops the all-reduce (and, through the hook, the step); what a rank sends holds no plaintext;
a record's AAD names each of (all-reduce, hop, segment, record, sender, receiver), both in
record_aad and in what the ring actually seals (a ring of threads, in process), so a record
moved by any one field fails authentication (docs/security.md row 37).
"""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
import torch
import torch.distributed as dist

from ddp_steps import sgd_steps  # tests/ddp_steps.py

from gputravel.crypto.channel import KeyMaterial, Receiver, Sender, derive_epoch_keys
from gputravel.ddp import (PairKeys, Ring, RingHookState, TorchPointToPoint, encrypted_allreduce_hook,
                           establish_pair_keys, pair_label)
from gputravel.ddp.ring import record_aad
from gputravel.errors import BadInput, ChannelFaulted, IntegrityError, PeerTimeout, TransportClosed

SIZES = (1, 2, 5, 100_003, 300_000)  # one element, fewer than ranks, uneven segments, many records
RECORD = 40_000  # bytes: 10 000 float32 per record, so the larger sizes travel as several
# 16 bytes no sum of zeros can hide: rank 0 sends them, every other rank adds zeros.
CANARY = torch.tensor([1234.5678, -8765.4321, 3.14159e-3, 2.71828e7], dtype=torch.float32)


def _keys(group=None):
    # Attestation is test_ddp_keys.py's subject: here the evidence is the report data itself.
    def verify(peer: int, evidence: bytes, report_data: bytes) -> None:
        if evidence != report_data:
            raise ValueError("evidence does not carry the report data")
    return establish_pair_keys(lambda report_data: report_data, verify, group=group, context=b"test ring")


def _input(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * rank + n))


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


class Wire:
    """A rank's side of the wire, as the untrusted host sees and touches it: it records every
    byte sent and, at send number `at`, tampers with, replays or drops a record."""

    def __init__(self, inner: TorchPointToPoint, fault: str | None = None, at: int = -1) -> None:
        self.inner, self.fault, self.at = inner, fault, at
        self.rank, self.world_size = inner.rank, inner.world_size
        self.sent: list[bytes] = []

    def isend(self, buf, dst, lane):
        data = buf.view(torch.uint8).numpy().tobytes()
        index, _ = len(self.sent), self.sent.append(data)
        if index == self.at and self.fault == "drop":
            return _Done()
        if index == self.at and self.fault == "tamper":
            flipped = bytearray(data)
            flipped[len(flipped) // 2] ^= 0x01
            buf = torch.frombuffer(flipped, dtype=torch.uint8)
        if index == self.at and self.fault == "replay":
            buf = torch.frombuffer(bytearray(self.sent[index - 1]), dtype=torch.uint8)  # the record before
        if index == self.at and self.fault == "replay-first":
            buf = torch.frombuffer(bytearray(self.sent[0]), dtype=torch.uint8)  # of the first all-reduce
        return self.inner.isend(buf, dst, lane)

    def irecv(self, buf, src, lane):
        return self.inner.irecv(buf, src, lane)


class _Done:
    def wait(self, timeout=None) -> bool:
        return True


# ----------------------------------------------------------------------------- in one process
class _Alone:
    rank, world_size = 0, 1


def test_a_ring_of_one_returns_the_tensor_unchanged_and_refuses_what_it_cannot_reduce() -> None:
    ring = Ring("pipelined", p2p=_Alone())
    x = torch.arange(10, dtype=torch.float32)
    assert ring.all_reduce(x) is x and torch.equal(x, torch.arange(10, dtype=torch.float32))
    for bad in (torch.arange(10), torch.ones(4, 4).t(), "not a tensor"):
        with pytest.raises(BadInput):
            ring.all_reduce(bad)
    with pytest.raises(BadInput, match="unknown ring variant"):
        Ring("fast", p2p=_Alone())


class _GonePeer:
    """A wire whose peer has left: gloo fails the post itself, before any wait."""
    rank, world_size = 0, 2

    def isend(self, buf, dst, lane):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer")

    irecv = isend


def test_a_post_that_fails_at_once_is_a_typed_error_and_stops_the_ring() -> None:
    ring = Ring("plain", p2p=_GonePeer())
    with pytest.raises(TransportClosed, match="the link to a peer broke"):
        ring.all_reduce(torch.ones(8))
    with pytest.raises(ChannelFaulted):
        ring.all_reduce(torch.ones(8))


def test_a_record_aad_names_its_place() -> None:
    places = [(op, hop, seg, rec, 0, 1) for op in (0, 1) for hop in range(4) for seg in range(3) for rec in range(3)]
    places += [(0, 0, 0, 0, 1, 0), (0, 0, 0, 0, 1, 2)]
    assert len({record_aad(*p) for p in places}) == len(places)


# A record's place: (all-reduce, hop, segment, record, sender, receiver), record_aad's order.
FIELDS = ("all-reduce", "hop", "segment", "record", "sender", "receiver")
PLACE = (7, 3, 2, 5, 1, 2)


def _material(*pairs: tuple[int, int]) -> dict[tuple[int, int], KeyMaterial]:
    # The project's own recipe: one key and IV mask per direction, labelled as ddp/keys.py does.
    labels = {pair_label(i, j): (i, j) for i, j in pairs}
    return {labels[label]: km for label, km in derive_epoch_keys(b"s" * 32, 0, labels).items()}


def _moved(place: tuple[int, ...], field: int) -> tuple[int, ...]:
    return place[:field] + (place[field] + 1,) + place[field + 1:]


def _open_only_at(receiver: Receiver, sealed: bytes, place: tuple[int, ...]) -> bytes:
    """Each single-field move of `place` fails authentication; then `place` itself opens.

    The Receiver advances only on success, so every try meets the same expected IV: what fails
    is the AAD alone, and the record still opens afterwards where it belongs (the control)."""
    for field in range(len(FIELDS)):
        with pytest.raises(IntegrityError):
            receiver.decrypt(sealed, record_aad(*_moved(place, field)))
    sender, receiver_rank = place[4], place[5]
    with pytest.raises(IntegrityError):  # reflected back: sender and receiver swapped
        receiver.decrypt(sealed, record_aad(*place[:4], receiver_rank, sender))
    return receiver.decrypt(sealed, record_aad(*place))


@pytest.mark.parametrize("field", range(len(FIELDS)), ids=FIELDS)
def test_a_record_sealed_for_one_place_fails_where_one_field_differs(field: int) -> None:
    """docs/security.md row 37: the AAD names all six fields. Drop any one from record_aad and
    the moved record below opens, so this test fails for that field."""
    keys = _material((1, 2))[(1, 2)]
    sealed = Sender(keys).encrypt(b"sixteen byte sum", record_aad(*PLACE))
    receiver = Receiver(keys)
    with pytest.raises(IntegrityError):
        receiver.decrypt(sealed, record_aad(*_moved(PLACE, field)))
    assert receiver.decrypt(sealed, record_aad(*PLACE)) == b"sixteen byte sum"  # the control


class _Mailboxes:
    """In-process wire for a ring of threads: every record sent, per (sender, receiver), in order."""

    def __init__(self) -> None:
        self.sent: dict[tuple[int, int], list[bytes]] = {}
        self.arrived = threading.Condition()

    def end(self, rank: int, world_size: int) -> _End:
        return _End(self, rank, world_size)


class _End:
    def __init__(self, boxes: _Mailboxes, rank: int, world_size: int) -> None:
        self.boxes, self.rank, self.world_size = boxes, rank, world_size
        self.posted: dict[int, int] = {}  # receives posted per source: the next record's index

    def isend(self, buf, dst, lane):
        with self.boxes.arrived:
            self.boxes.sent.setdefault((self.rank, dst), []).append(buf.view(torch.uint8).numpy().tobytes())
            self.boxes.arrived.notify_all()
        return _Done()

    def irecv(self, buf, src, lane):
        index = self.posted.get(src, 0)
        self.posted[src] = index + 1
        return _Arrival(self.boxes, (src, self.rank), index, buf)


class _Arrival:
    def __init__(self, boxes: _Mailboxes, link: tuple[int, int], index: int, buf: torch.Tensor) -> None:
        self.boxes, self.link, self.index, self.buf = boxes, link, index, buf

    def wait(self, timeout=None) -> bool:
        box = self.boxes
        with box.arrived:
            if not box.arrived.wait_for(lambda: len(box.sent.get(self.link, ())) > self.index,
                                        timeout.total_seconds() if timeout else 5):
                return False
            data = box.sent[self.link][self.index]
        self.buf.view(torch.uint8)[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return True


def _expected_places(world: int, op: int, sender: int, records: list[int]) -> list[tuple[int, ...]]:
    """What `sender` seals, in order: the textbook ring. Scatter-reduce hop h sends segment
    sender - h, all-gather hop h sends sender + 1 - (h - world + 1); every record of a segment."""
    places = []
    for hop in range(2 * (world - 1)):
        segment = (sender - hop) % world if hop < world - 1 else (sender + 1 - (hop - world + 1)) % world
        places += [(op, hop, segment, k, sender, (sender + 1) % world) for k in range(records[segment])]
    return places


@pytest.mark.parametrize("variant", ["naive", "pipelined"])
def test_the_ring_seals_each_record_for_its_own_place_and_only_there(variant: str) -> None:
    """The ring's own send and land, three ranks on threads, two all-reduces: every record on the
    wire opens under record_aad of exactly its place (all-reduce, hop, segment, record, sender,
    receiver) and fails under each single-field move of it. A call site that stopped naming a
    field (say segment 0 for every record) fails here; the ring's receiving side must build the
    same AAD or the all-reduce itself fails."""
    world, n, record_bytes = 3, 100, 64  # segments of 34, 33, 33 float32: 3 records each
    keys = _material(*[(i, (i + 1) % world) for i in range(world)])
    boxes = _Mailboxes()
    rings = [Ring(variant, keys=PairKeys(r, world, keys, ()), record_bytes=record_bytes,
                  p2p=boxes.end(r, world), timeout_s=5) for r in range(world)]
    inputs = [_input(r, n) for r in range(world)]
    results: dict[int, list] = {}

    def rank(r: int) -> None:
        try:
            results[r] = [rings[r].all_reduce(inputs[r].clone()) for _ in range(2)]
        except BaseException as err:  # noqa: BLE001 (handed back to the test)
            results[r] = [err]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    total = inputs[0] + inputs[1] + inputs[2]  # the ring's order: the receiver adds what arrives
    for r in range(world):
        assert len(results.get(r, ())) == 2 and all(torch.allclose(x, total, atol=1e-5) for x in results[r]), results[r]

    records = [3, 3, 3]  # the naive ring's records are no longer than record_bytes either
    for sender in range(world):
        link = (sender, (sender + 1) % world)
        places = [p for op in (0, 1) for p in _expected_places(world, op, sender, records)]
        assert len(boxes.sent[link]) == len(places)
        receiver = Receiver(keys[link])
        for sealed, place in zip(boxes.sent[link], places, strict=True):
            _open_only_at(receiver, sealed, place)


class _Stalled:
    """A two-rank link whose operations never complete until released: a ring caught mid-hop."""

    rank, world_size = 0, 2

    def __init__(self) -> None:
        self.release = threading.Event()

    def isend(self, buf, dst, lane):
        return self

    def irecv(self, buf, src, lane):
        return self

    def wait(self, timeout=None) -> bool:
        self.release.wait(10)
        return False  # answers instead of raising: the buffer never arrived


def test_a_second_caller_breaks_the_ring_instead_of_reusing_its_ivs() -> None:
    """Two all-reduces at once on one ring would seal under the same counters (nonce reuse)."""
    link = _Stalled()
    ring = Ring("plain", p2p=link, timeout_s=5)
    first: list[BaseException] = []
    worker = threading.Thread(target=lambda: first.extend(_raised(ring, torch.ones(8))))
    worker.start()
    while not ring._busy.locked():
        time.sleep(0.001)
    with pytest.raises(ChannelFaulted, match="one tensor at a time"):
        ring.all_reduce(torch.ones(8))
    link.release.set()
    worker.join(10)
    assert first and isinstance(first[0], PeerTimeout)  # a wait answered False: a timeout, not a sum
    with pytest.raises(ChannelFaulted):
        ring.all_reduce(torch.ones(8))


def _raised(ring: Ring, tensor: torch.Tensor) -> list[BaseException]:
    try:
        ring.all_reduce(tensor)
    except BaseException as err:  # noqa: BLE001 (handed back to the test)
        return [err]
    return []


def test_a_closed_hook_fails_later_buckets() -> None:
    state = RingHookState(Ring("plain", p2p=_Alone()))
    state.close()
    fut = torch.futures.Future()
    state.submit(torch.ones(4), fut)
    with pytest.raises(ChannelFaulted):
        fut.wait()


# ----------------------------------------------------------------------------- ranks
def agree(rank: int, world: int) -> dict:
    """Every variant on every size; DDP with and without the hook; a tamper at the very end."""
    rings = {"plain": Ring("plain", record_bytes=64 * 1024),
             "naive": Ring("naive", keys=_keys()),
             "pipelined": Ring("pipelined", keys=_keys(), record_bytes=RECORD)}
    out: dict = {"sums": {}}
    for n in SIZES:
        x = _input(rank, n)
        plain = rings["plain"].all_reduce(x.clone())
        assert torch.equal(rings["plain"].all_reduce(x.clone()), plain), "the plain ring differs from itself"
        gloo = x.clone()
        dist.all_reduce(gloo)
        assert torch.allclose(plain, gloo, rtol=1e-5, atol=1e-5), "the plain ring disagrees with gloo"
        for variant in ("naive", "pipelined"):
            assert torch.equal(rings[variant].all_reduce(x.clone()), plain), f"{variant} differs from plain"
        out["sums"][n] = _digest(plain)

    out["ddp"] = ddp_matches(rank, world)

    # The last record of the last hop, tampered: only its receiver has anything left to check.
    wire = Wire(TorchPointToPoint(), "tamper" if rank == 0 else None, at=2 * (world - 1) * 3 - 1)  # 3 records a hop
    ring = Ring("pipelined", keys=_keys(), record_bytes=40_000, p2p=wire, timeout_s=5)
    try:
        ring.all_reduce(_input(rank, 30_000 * world))
        out["tamper"] = "completed"
    except IntegrityError as err:
        out["tamper"] = f"IntegrityError: {err}"
    dist.barrier()  # the receiver stays until its own last sends have reached the next rank
    return out


def ddp_matches(rank: int, world: int) -> float:
    """Largest parameter difference between DDP without a hook and DDP with each ring's hook."""
    trained = {name: _train(rank, world, name) for name in (None, "plain", "naive", "pipelined")}
    return max(float((trained[None] - trained[name]).abs().max()) for name in ("plain", "naive", "pipelined"))


def _train(rank: int, world: int, variant: str | None, steps: int = 3, fault: str | None = None,
           states: list | None = None) -> torch.Tensor:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002)  # a few buckets, overlapping backward
    state = None
    if variant is not None:
        group = dist.new_group(backend="gloo")  # the ring's own: never in DDP's way
        wire = Wire(TorchPointToPoint(group), fault, at=0 if rank == 0 else -1)
        state = RingHookState(Ring(variant, keys=None if variant == "plain" else _keys(group),
                                   record_bytes=512, group=group, p2p=wire, timeout_s=2))
        ddp.register_comm_hook(state, encrypted_allreduce_hook)
        if states is not None:
            states.append(state)
    try:
        return sgd_steps(ddp, model, rank, steps)
    finally:
        if state is not None:
            state.close()


@pytest.mark.parametrize("world", [2, 3])
def test_the_rings_agree_with_each_other_with_gloo_and_under_ddp(run_ranks, world: int) -> None:
    results = run_ranks(agree, world, timeout=60)
    assert all(r["sums"] == results[0]["sums"] for r in results)  # every rank holds the same bits
    assert all(r["ddp"] < 1e-6 for r in results), [r["ddp"] for r in results]
    assert results[1]["tamper"].startswith("IntegrityError") and "from rank 0" in results[1]["tamper"]
    assert [r["tamper"] for i, r in enumerate(results) if i != 1] == ["completed"] * (world - 1)


def faults(rank: int, world: int) -> dict:
    """Rank 0's sends to rank 1 tampered with, replayed or dropped; each case on a group of its own,
    so that a send or receive left pending by a broken ring cannot meet the next case's."""
    k = 3  # records per hop: 90 000 float32 = 2 segments of 3 records
    cases = [("naive", "drop", 0), ("naive", "tamper", k + 1), ("naive", "replay", k + 1),
             ("pipelined", "tamper", k + 1), ("pipelined", "replay", k + 1), ("pipelined", "drop", k + 1)]
    out = {}
    for variant, fault, at in cases:
        group = dist.new_group(backend="gloo")
        wire = Wire(TorchPointToPoint(group), fault if rank == 0 else None, at)
        ring = Ring(variant, keys=_keys(group), record_bytes=60_000, group=group, p2p=wire, timeout_s=2)
        x = _input(rank, 90_000)
        try:
            ring.all_reduce(x)
            seen = "completed"
        except (IntegrityError, PeerTimeout, TransportClosed) as err:
            seen = type(err).__name__
            with pytest.raises(ChannelFaulted):
                ring.all_reduce(x)  # the step stays stopped: the ring does not turn again
        out[f"{variant} {fault}"] = seen
    return out


def test_a_tampered_replayed_or_dropped_record_stops_the_all_reduce(run_ranks) -> None:
    sender, receiver = run_ranks(faults, 2, timeout=60)
    assert set(receiver.values()) == {"IntegrityError"}, receiver
    # The sender finishes its part, except where it waits in vain for the receiver, which
    # stopped at the record the dropped one's successor took the place of.
    assert sender == {case: "PeerTimeout" if case == "naive drop" else "completed" for case in receiver}, sender


# Audit finding 4: the host dropped send #7 or #30, or delivered a full-length record in place of
# a hop's short last one, and gloo ended the receiving rank (SIGABRT: "Received data size doesn't
# match expected size") before it said anything. Two all-reduces, as DDP's buckets come, whose
# hops end in a short record: 8 records a hop (sends #0-#15), then 15 (#16-#45), 1024 float32
# each but the last of each hop, 100. #7 and #30 are the short last records of a first hop:
# each dropped, the next hop's full-length first record comes in its place.
HOSTILE_RECORD = 4096
HOSTILE_SIZES = (2 * (7 * 1024 + 100), 2 * (14 * 1024 + 100))
# A small all-reduce (one 500-float32 record a hop: sends #0, #1), then a large one.
SMALL_THEN_LARGE = (2 * 500, HOSTILE_SIZES[1])


def hostile(rank: int, world: int, fault: str, at: int, sizes: tuple[int, ...]) -> str:
    """Rank 0's send number `at` dropped or replaced (replay: the record before, full length),
    in all-reduces of `sizes`; what they raised, on this rank."""
    group = dist.new_group(backend="gloo")
    wire = Wire(TorchPointToPoint(group), fault if rank == 0 else None, at)
    # Where both ranks wait in vain, gloo closes the link of the one that times out first: the
    # receiver must, or under load it saw the sender's closing (TransportClosed), not its timeout.
    timeout_s = 2 if rank == 1 else 6
    ring = Ring("pipelined", keys=_keys(group), record_bytes=HOSTILE_RECORD, group=group, p2p=wire,
                timeout_s=timeout_s)
    try:
        for n in sizes:
            ring.all_reduce(_input(rank, n))
    except (IntegrityError, PeerTimeout, TransportClosed) as err:
        return f"{type(err).__name__}: {err}"
    return "completed"


@pytest.mark.parametrize(("fault", "at", "sizes", "raised", "where"), [
    ("drop", 7, HOSTILE_SIZES, "IntegrityError", "hop 0, segment 0, record 7)"),
    ("drop", 30, HOSTILE_SIZES, "IntegrityError", "hop 0, segment 0, record 14)"),
    ("replay", 7, HOSTILE_SIZES, "IntegrityError", "hop 0, segment 0, record 7)"),
    # The last record of an all-reduce: nothing takes its place, so its receive waits until
    # the timeout. The next all-reduce's records, longer than that receive, travel on the
    # other lane: they do not land in it (and end the process) in the meantime.
    ("drop", 1, SMALL_THEN_LARGE, "PeerTimeout", "receive of hop 1 record 0 did not complete"),
], ids=["drop-send-7", "drop-send-30", "full-length-for-short-7", "drop-the-last-send-1"])
def test_a_dropped_or_longer_record_is_a_typed_error_on_its_receiver_never_an_abort(
        run_ranks, fault: str, at: int, sizes: tuple[int, ...], raised: str, where: str) -> None:
    """docs/security.md row 37. Without every receive posted for its all-reduce's longest
    record, and consecutive all-reduces on alternate lanes (the last case), rank 1 dies here of
    SIGABRT inside gloo, and run_ranks fails the test: "rank 1 (exit code -6) died without a word"."""
    sender, receiver = run_ranks(hostile, 2, fault, at, sizes, timeout=60)
    assert receiver.startswith(raised) and where in receiver, receiver
    if raised == "IntegrityError":
        assert "from rank 0" in receiver and "failed authentication" in receiver
    # The sender waits in vain for records the stopped receiver never sends, or sees it leave.
    assert sender.split(":")[0] in ("PeerTimeout", "TransportClosed"), sender


# The review after finding 4: the host replays, verbatim, a full-length record of an EARLIER,
# successful all-reduce into a later, smaller one (DDP's buckets differ in size), on the lane
# that later all-reduce uses (the third: lanes alternate). Posted for that all-reduce's own
# longest record, the receive was shorter than the replayed message, and gloo ended rank 1
# (SIGABRT: "op.preamble.length <= op.nbytes. 4112 vs 2016").
EARLIER_THEN_SMALL = (HOSTILE_SIZES[0], HOSTILE_SIZES[0], 2 * 500)


def replay_earlier(rank: int, world: int, variant: str) -> str:
    """Rank 0's first send of the last all-reduce replaced by its very first record (all-reduce
    0, hop 0, record 0, full length); what the all-reduces raised, on this rank."""
    group = dist.new_group(backend="gloo")
    wire = Wire(TorchPointToPoint(group), "replay-first" if rank == 0 else None)
    ring = Ring(variant, keys=_keys(group), record_bytes=HOSTILE_RECORD, group=group, p2p=wire, timeout_s=2)
    try:
        for i, n in enumerate(EARLIER_THEN_SMALL):
            if i == len(EARLIER_THEN_SMALL) - 1:
                wire.at = len(wire.sent)
            ring.all_reduce(_input(rank, n))
    except (IntegrityError, PeerTimeout, TransportClosed) as err:
        return f"{type(err).__name__}: {err}"
    return "completed"


@pytest.mark.parametrize("variant", ["naive", "pipelined"])
def test_a_record_replayed_from_an_earlier_larger_all_reduce_is_a_typed_error_never_an_abort(
        run_ranks, variant: str) -> None:
    """docs/security.md row 37. Unless every receive of a sealed ring is posted at one size for
    the ring's whole life, at least its longest possible record (record_bytes and the tag), a
    record of an earlier all-reduce is longer than a later one's receives and rank 1 dies here of
    SIGABRT inside gloo: "rank 1 (exit code -6) died without a word"."""
    sender, receiver = run_ranks(replay_earlier, 2, variant, timeout=60)
    assert receiver.startswith("IntegrityError") and "hop 0, segment 0, record 0)" in receiver, receiver
    assert "from rank 0" in receiver and "failed authentication" in receiver
    assert sender.split(":")[0] in ("PeerTimeout", "TransportClosed"), sender


def canary(rank: int, world: int) -> dict:
    sent = {}
    for variant in ("plain", "naive", "pipelined"):
        x = CANARY.repeat(25_000) if rank == 0 else torch.zeros(100_000)
        wire = Wire(TorchPointToPoint())
        ring = Ring(variant, keys=None if variant == "plain" else _keys(), record_bytes=RECORD, p2p=wire)
        ring.all_reduce(x)
        assert torch.equal(x, CANARY.repeat(25_000))
        everything = b"".join(wire.sent)
        sent[variant] = (len(everything), everything.count(CANARY.numpy().tobytes()))
    return sent


def test_what_a_rank_sends_holds_no_gradient_plaintext(run_ranks) -> None:
    for sent in run_ranks(canary, 2, timeout=60):
        assert sent["plain"][1] > 0  # the canary is there to be found in the clear
        assert sent["naive"][0] > 0 and sent["naive"][1] == 0
        assert sent["pipelined"][0] > 0 and sent["pipelined"][1] == 0


def ddp_fault(rank: int, world: int) -> tuple[str, str]:
    states: list[RingHookState] = []
    try:
        _train(rank, world, "pipelined", steps=1, fault="tamper", states=states)
    except RuntimeError as err:  # DDP re-raises the hook's error from backward, as a RuntimeError
        return str(err), type(states[0].failure).__name__  # the typed error, kept by the hook
    return "trained", ""


def test_a_tampered_bucket_stops_the_ddp_step(run_ranks) -> None:
    (_, sender_failure), (receiver, receiver_failure) = run_ranks(ddp_fault, 2, timeout=60)
    assert "failed authentication" in receiver and receiver_failure == "IntegrityError", receiver
    # The sender waits for a receiver that stopped, or finds that it left.
    assert sender_failure in ("PeerTimeout", "TransportClosed"), sender_failure

