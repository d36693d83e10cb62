"""The processes of the all-reduce row (ddp_rows.py): data-parallel ranks whose ring traffic
the host carries, and the host that carries it.

In the threat model every byte between two GPU TEEs crosses the host. Here the ranks and the
host are processes of one torch.distributed world (gloo): ranks 0..W-1 and the host, rank W.
Each rank trains one DDP step with the encrypted hook (ddp/hook.py), whose ring (ddp/ring.py)
is given a link through the host (:class:`HostCarried`, the ring's ``p2p`` seam): every
record it sends goes to the host's process as gloo point-to-point messages, and the host
forwards it to the rank it names, or does not. The host records every record it carried and,
in the fault cases, flips a bit of one record, replaces it with the one before (a replay),
delivers it cut short, or drops it. Nothing else of the honest ranks changes: their keys come
from an ECDHE bound to emulated TDX quotes (ddp/keys.py), their step is the production hook's.

Each delivery is one gloo message into a receive the ring posted at its one receive size, that
of the longest record it can send (record_bytes and the tag). A host that delivered a message
longer than that would make gloo end the rank (SIGABRT): an attack on gloo's framing, which the
ring cannot reach (ddp/ring.py, "Framing"), and no case here makes it.

DDP's own parameter broadcast and the key exchange run over gloo between the ranks, not
through the host's process: they carry the initial weights (zeros) and public key shares,
never a gradient.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from cryptography.hazmat.primitives import serialization
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gputravel.attest import Authority
from gputravel.attest.quote import EmulatedRankTee
from gputravel.ddp import Ring, RingHookState, encrypted_allreduce_hook, establish_pair_keys
from gputravel.ddp.ring import LANES

HEAD, BODY, DELIVER = 1, 2, 3  # gloo tags: a record's header and body to the host; the host's delivery
# (DELIVER + the ring's lane: the host delivers a record on the lane its sender named)
END = -1  # a header's destination when a rank is done with a case
MEASURED = b"\x5b" * 48  # the rank CVMs' measurement, as their verifiers accept it (emulated)
MAX_RECORD = 1 << 24  # the host refuses to allocate more for one record than this


@dataclass(frozen=True)
class Case:
    name: str
    variant: str  # the ring's: plain, naive or pipelined
    fault: str = ""  # "", "flip", "replay", "cut" or "drop": what the host does to one record from rank 0 to rank 1
    record: int = 1  # which record of the last hop (of those rank 0 sends rank 1) the host does it to


@dataclass(frozen=True)
class Plan:
    """Everything the processes need, picklable: the parent makes it once."""

    world: int  # ranks; the host is rank `world`
    port: int
    cases: tuple[Case, ...]
    gradient: bytes  # rank 0's gradient (float32), the canary; the other ranks' are zeros
    record_bytes: int
    last_hop: int  # index, among the records rank 0 sends rank 1 in a case, of the last hop's first
    context: bytes  # names this run; every case adds its own name (a key serves one ring)
    root: tuple[bytes, bytes]  # the emulated CPU-TEE quoting root: certificate, private key (PEM)
    out_dir: str  # where the host writes what it carried, one file per case
    timeout_s: float


# ----------------------------------------------------------------------------- the ranks
class HostCarried:
    """A rank's ring link when the host carries the bytes: a record for rank `dst` goes to the
    host as a header (destination, length, lane) and the record itself; whatever the host
    delivers arrives from the host, into a receive as long as the ring posted it (the longest
    record the ring can send). A ring's receiver hears one peer, so `src` names no channel
    here: where a record came from is for its authentication to say, not for the wire."""

    def __init__(self, carrier: dist.ProcessGroup, rank: int, world_size: int, host: int) -> None:
        self.carrier, self.rank, self.world_size, self.host = carrier, rank, world_size, host

    def isend(self, buf: torch.Tensor, dst: int, lane: int) -> _Both:
        body = buf.view(torch.uint8)
        head = torch.tensor([dst, body.numel(), lane], dtype=torch.int64)
        return _Both(head, dist.isend(head, self.host, group=self.carrier, tag=HEAD),
                     dist.isend(body, self.host, group=self.carrier, tag=BODY))

    def irecv(self, buf: torch.Tensor, src: int, lane: int) -> dist.Work:
        return dist.irecv(buf.view(torch.uint8), self.host, group=self.carrier, tag=DELIVER + lane)

    def done(self) -> None:
        """Tell the host this rank sends nothing more in this case (after what it already sent)."""
        dist.send(torch.tensor([END, 0, 0], dtype=torch.int64), self.host, group=self.carrier, tag=HEAD)


class _Both:
    def __init__(self, head: torch.Tensor, *works: dist.Work) -> None:
        self.head, self.works = head, works  # the header must outlive its send

    def wait(self, timeout: timedelta | None = None) -> bool:
        return all(w.wait(timeout) if timeout is not None else w.wait() for w in self.works)


class _Gradient(nn.Module):
    """A model whose gradient is its input: (w * x).sum() has d/dw = x."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def rank_main(rank: int, plan: Plan, results) -> None:
    """One rank: a DDP step with the encrypted hook per case, its ring carried by the host."""
    _join(rank, plan)
    try:
        ranks = dist.new_group(list(range(plan.world)))  # DDP's and the key exchange's; the host is not in it
        root_cert, root_key = plan.root
        tee = EmulatedRankTee(Authority(root_cert, serialization.load_pem_private_key(root_key, password=None)),
                              root_cert, MEASURED)
        for case in plan.cases:
            carrier = dist.new_group(list(range(plan.world + 1)), timeout=timedelta(seconds=plan.timeout_s))
            results.put(("rank", rank, case.name, _step(rank, plan, case, ranks, carrier, tee)))
    except BaseException as err:  # reported to the parent, which reports the row not carried out
        results.put(("rank", rank, "", {"failed": f"{type(err).__name__}: {err}"}))
    _leave(results)


def _step(rank: int, plan: Plan, case: Case, ranks: dist.ProcessGroup, carrier: dist.ProcessGroup,
          tee: EmulatedRankTee) -> dict:
    keys = None
    if case.variant != "plain":
        keys = establish_pair_keys(tee.attest, tee.verify, group=ranks, context=plan.context + case.name.encode())
    link = HostCarried(carrier, rank, plan.world, host=plan.world)
    ring = Ring(case.variant, keys=keys, record_bytes=plan.record_bytes, p2p=link, timeout_s=plan.timeout_s)
    gradient = torch.frombuffer(bytearray(plan.gradient), dtype=torch.float32)
    model = _Gradient(gradient.numel())
    ddp = DistributedDataParallel(model, process_group=ranks)
    state = RingHookState(ring)
    ddp.register_comm_hook(state, encrypted_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    x = gradient if rank == 0 else torch.zeros_like(gradient)
    out = {"outcome": "completed", "error": "", "message": ""}
    try:
        opt.zero_grad()
        ddp(x).backward()
        opt.step()
    except RuntimeError:  # DDP re-raises the hook's error; the typed one is kept by the hook
        failure = state.failure
        if failure is None:
            raise
        out = {"outcome": "stopped", "error": type(failure).__name__, "message": str(failure)}
    finally:
        state.close()
        link.done()
    w = model.w.detach()
    # The step SGD takes with the right average: 0 - 1.0 * (gradient / W), the same operations.
    right = torch.zeros_like(gradient).add_(gradient / plan.world, alpha=-1.0)
    return {**out, "sum_right": bool(torch.equal(w, right)), "untouched": bool(torch.equal(w, torch.zeros_like(w)))}


# ----------------------------------------------------------------------------- the host
def host_main(plan: Plan, results) -> None:
    """The host: carries every record of every case, records it, and tampers as the case says."""
    _join(plan.world, plan)
    try:
        dist.new_group(list(range(plan.world)))  # every process takes part in making every group
        for case in plan.cases:
            carrier = dist.new_group(list(range(plan.world + 1)), timeout=timedelta(seconds=plan.timeout_s))
            results.put(("host", plan.world, case.name, _carry(plan, case, carrier)))
    except BaseException as err:
        results.put(("host", plan.world, "", {"failed": f"{type(err).__name__}: {err}"}))
    _leave(results)


def _carry(plan: Plan, case: Case, carrier: dist.ProcessGroup) -> dict:
    carried: list[bytes] = []
    said: list[str] = []
    deliveries: list[dist.Work] = []
    lock = threading.Lock()

    def serve(src: int) -> None:
        sent = 0  # records from `src` to rank 1, for the fault's index
        last = b""
        while True:
            head = torch.empty(3, dtype=torch.int64)
            dist.recv(head, src, group=carrier, tag=HEAD)
            dst, n, lane = (int(v) for v in head)
            if dst == END:
                return
            if not (0 <= dst < plan.world and 0 < n <= MAX_RECORD and 0 <= lane < LANES):
                raise ValueError(f"rank {src} sent a header the host cannot carry: {dst}, {n}, {lane}")
            body = torch.empty(n, dtype=torch.uint8)
            dist.recv(body, src, group=carrier, tag=BODY)
            record = body.numpy().tobytes()
            out: bytes | None = record
            if case.fault and (src, dst) == (0, 1):
                if sent == plan.last_hop + case.record:
                    out, note = _tamper(case.fault, record, last)
                    with lock:
                        said.append(f"{note} record {sent} of those rank 0 sent rank 1 ({n} bytes)")
                sent, last = sent + 1, record
            with lock:
                carried.append(record)
                if out is not None:
                    deliveries.append(dist.isend(torch.frombuffer(bytearray(out), dtype=torch.uint8), dst,
                                                 group=carrier, tag=DELIVER + lane))

    failures: list[str] = []

    def guarded(src: int) -> None:
        try:
            serve(src)
        except Exception as err:  # noqa: BLE001 (reported with the case)
            failures.append(f"rank {src}'s records: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=guarded, args=(src,), daemon=True) for src in range(plan.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for work in deliveries:
        work.wait(timedelta(seconds=plan.timeout_s))
    capture = b"".join(carried)
    Path(plan.out_dir, f"host-{case.name}.bin").write_bytes(capture)
    return {"records": len(carried), "bytes": len(capture), "said": said, "failures": failures}


def _tamper(fault: str, record: bytes, before: bytes) -> tuple[bytes | None, str]:
    if fault == "flip":
        flipped = bytearray(record)
        flipped[len(flipped) // 2] ^= 0x01
        return bytes(flipped), f"flipped bit 0 of byte {len(record) // 2} of"
    if fault == "replay":
        return before, f"delivered the record before again ({len(before)} bytes), in place of"
    if fault == "cut":
        return record[: len(record) // 2], f"delivered the first {len(record) // 2} bytes of"
    return None, "dropped"


# ----------------------------------------------------------------------------- both
def _join(rank: int, plan: Plan) -> None:
    torch.set_num_threads(1)  # the processes share this machine's cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(plan.port))
    dist.init_process_group("gloo", rank=rank, world_size=plan.world + 1,
                            timeout=timedelta(seconds=plan.timeout_s))


def _leave(results) -> None:
    # A broken ring leaves receives posted that will never complete; tearing the group down
    # under them can wait for them. The parent has what it needs: hand it over and go.
    results.close()
    results.join_thread()
    os._exit(0)
