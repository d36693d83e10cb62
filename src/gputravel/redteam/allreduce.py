"""Red-team row of issue 14: the host carries, reads and tampers with the ring all-reduce between GPU TEEs.

Ranks and the host are processes of one gloo world; each rank's encrypted DDP hook sends every record
through the host's process (:class:`HostCarried`). Rank 0's gradient is a canary (the others' are zeros,
so every partial sum on the wire is the canary): the row is defeated when the sealed cases' captures
hold none of it (the plain control's do) and each fault stops rank 1's step with an IntegrityError
before its optimizer moves a weight, the other ranks' steps completing with the right sum.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from cryptography.hazmat.primitives import serialization
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gputravel.attest import Authority
from gputravel.attest.quote import EmulatedRankTee
from gputravel.attest.roots import TEE_QUOTING_ROOT_CN
from gputravel.crypto.certs import key_pem
from gputravel.ddp import Ring, RingHookState, encrypted_allreduce_hook, establish_pair_keys
from gputravel.ddp.launch import free_port, run_processes
from gputravel.ddp.ring import LANES
from gputravel.errors import BadInput, RemoteError
from gputravel.redteam.arena import Arena, Verdict, row
from gputravel.redteam.canary import Found
from gputravel.redteam.evidence import Carried, Failed, RankStep, Record, SearchedRing, Tampered

HEAD, BODY, DELIVER = 1, 2, 3  # gloo tags: a record's header and body to the host; the host's delivery (+ lane)
END = -1  # a header's destination when a rank is done with a case
MEASURED = b"\x5b" * 48  # the rank CVMs' measurement, as their verifiers accept it (emulated)
MAX_RECORD = 1 << 24  # the host refuses to allocate more for one record than this


@dataclass(frozen=True)
class Case:
    name: str
    variant: str  # the ring's: plain, naive or pipelined
    fault: str = ""  # "", "flip", "replay", "cut" or "drop": what the host does to one record from rank 0 to rank 1
    record: int = 1  # which record of the last hop; replay-longer's is the hop's short last (it once meant SIGABRT)


@dataclass(frozen=True)
class Plan:
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


ROW = "host-carries-allreduce"
WORLD = 3
RECORD_BYTES = 4096  # 1024 float32 a record
RECORDS_PER_HOP = 3  # of the pipelined ring: the last hop has a record before and after the one touched
SHORT = 256  # float32 the last record of each hop lacks: 1024, 1024 and 768 float32 a hop
PERIOD = 256  # float32 values between the canary's markers
WINDOW = 8  # bytes: two float32, four float16; a random match is about 2**-64 a place
TIMEOUT_S = 20.0  # any gloo operation, and the ring's waits: nobody waits in vain in these cases
LAUNCH_TIMEOUT_S = 120.0
CONTROL = "plain-control"
RECEIVER = 1  # the rank the host tampers towards


def cases(sealed: bool = True) -> tuple[Case, ...]:
    """The row's cases; ``sealed=False``, every ring plain: the defence off, for the tests that show the row fails."""
    ring = (lambda v: v) if sealed else (lambda v: "plain")
    return (Case("encrypted", ring("pipelined")), Case("encrypted-naive", ring("naive")), Case(CONTROL, "plain"),
            Case("flip", ring("pipelined"), "flip"), Case("replay", ring("pipelined"), "replay"),
            Case("replay-longer", ring("pipelined"), "replay", record=RECORDS_PER_HOP - 1),
            Case("cut", ring("pipelined"), "cut"), Case("drop", ring("pipelined"), "drop"))


@dataclass(frozen=True)
class Observed:
    cases: tuple[Case, ...]
    carried: dict[str, Carried]  # with the bytes of the canary gradient found in it
    tampered: dict[str, tuple[Tampered, ...]]
    failures: dict[str, tuple[str, ...]]  # the host's, outside the attack
    ranks: dict[str, dict[int, RankStep]]
    world: int


def canary_gradient(n: int) -> torch.Tensor:
    """Random float32 values with a random marker quartet every PERIOD values."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
    gradient = torch.randn(n, generator=gen)
    gradient.view(-1, PERIOD)[:, :4] = torch.randn(4, generator=gen) * 1000
    return gradient


def gradient_needles(gradient: torch.Tensor, world: int) -> np.ndarray:
    """Every WINDOW-byte run, at an element boundary, of the gradient in each encoding a leak could take."""
    share = gradient / world  # as the hook divides it before the ring sums
    encodings = (gradient, share, torch.zeros_like(share).add_(share, alpha=-1.0), share.half(),
                 share.bfloat16().view(torch.int16))
    runs = []
    for t in encodings:
        raw = np.frombuffer(t.numpy().tobytes(), np.uint8)
        windows = np.lib.stride_tricks.sliding_window_view(raw, WINDOW)[:: t.element_size()]
        runs.append(np.ascontiguousarray(windows).view("<u8").ravel())
    needles = np.unique(np.concatenate(runs))
    return needles[needles != 0]


def found_in(data: bytes, needles: np.ndarray) -> int:
    """Bytes of `data` covered by a WINDOW-byte run of the gradient, at any offset."""
    raw = np.frombuffer(data, np.uint8)
    if raw.size < WINDOW:
        return 0
    values = np.ascontiguousarray(np.lib.stride_tricks.sliding_window_view(raw, WINDOW)).view("<u8").ravel()
    hits = np.flatnonzero(np.isin(values, needles))
    covered = np.zeros(raw.size, dtype=bool)
    covered[(hits[:, None] + np.arange(WINDOW)).ravel()] = True
    return int(covered.sum())


def carry(out_dir: Path, *, sealed: bool = True, world: int = WORLD, only: tuple[str, ...] = ()) -> Observed:
    """Run every case (or those in `only`) through the ranks and the host; search what the host carried."""
    chosen = tuple(c for c in cases(sealed) if not only or c.name in only)
    if world < 2 or not chosen:
        raise BadInput("the all-reduce row needs at least two ranks and a case")
    out_dir.mkdir(parents=True, exist_ok=True)
    gradient = canary_gradient(world * (RECORDS_PER_HOP * RECORD_BYTES // 4 - SHORT))
    root = Authority.self_signed(TEE_QUOTING_ROOT_CN)  # the emulated CPU-TEE quoting root of this run
    plan = Plan(world=world, port=free_port(), cases=chosen, gradient=gradient.numpy().tobytes(),
                record_bytes=RECORD_BYTES, last_hop=(2 * (world - 1) - 1) * RECORDS_PER_HOP,  # of 2(W - 1) hops
                context=f"gputravel redteam {ROW}/{os.urandom(16).hex()}/".encode(),
                root=(root.cert_der, key_pem(root.key)), out_dir=str(out_dir), timeout_s=TIMEOUT_S)
    got = _launch(plan)
    needles = gradient_needles(gradient, world)
    carried, tampered, failures, ranks = {}, {}, {}, {}
    for c in chosen:
        host = got[(world, c.name)]
        found = found_in((out_dir / f"host-{c.name}.bin").read_bytes(), needles)
        carried[c.name] = Carried(case=c.name, variant=c.variant, records=host["records"], nbytes=host["bytes"],
                                  found=found)
        tampered[c.name] = tuple(host["tampered"])
        failures[c.name] = tuple(host["failures"])
        ranks[c.name] = {r: RankStep(case=c.name, rank=r, **got[(r, c.name)]) for r in range(world)}
    return Observed(chosen, carried, tampered, failures, ranks, world)


class RowNotRun(RemoteError):
    """A rank or the host failed outside the attack (or timed out): the row was not carried out."""


def _launch(plan: Plan) -> dict[tuple[int, str], dict]:
    targets = [(rank_main, (r, plan)) for r in range(plan.world)] + [(host_main, (plan,))]
    names = [f"rank {r}" for r in range(plan.world)] + ["the host"]
    try:
        answers = run_processes(targets, LAUNCH_TIMEOUT_S, names=names, method="forkserver",
                                preload=["torch", "torch.distributed", "gputravel.redteam.allreduce"], grace=5.0)
    except RemoteError as err:  # a process failed, died or hung
        raise RowNotRun(str(err)) from err
    return {(who, case): value for sent in answers for who, case, value in sent}


def judge(seen: Observed) -> Verdict:
    good, evidence = True, list[Record]()
    for case in seen.cases:
        carried, ranks, tampered = seen.carried[case.name], seen.ranks[case.name], seen.tampered[case.name]
        failures = seen.failures[case.name]
        evidence += [carried, *tampered, *(Failed(what=f"{case.name}: host: {f}") for f in failures),
                     *ranks.values()]
        # the control: the search is seen to work, the plain ring carries the gradient; else none of it
        ok = carried.found > 0 if case.name == CONTROL else carried.nbytes > 0 and carried.found == 0
        hit = ranks[RECEIVER]
        if case.fault:  # the receiver's step stopped, by authentication, before its optimizer moved a weight
            ok = ok and bool(tampered) and not hit.completed and hit.error == "IntegrityError" and hit.untouched
        right = all(s.completed and s.sum_right for r, s in ranks.items() if not case.fault or r != RECEIVER)
        good = good and not failures and ok and right
    sealed = [c.name for c in seen.cases if c.name != CONTROL]
    plaintext = Found(sample_bytes=sum(seen.carried[n].found for n in sealed))
    evidence.append(SearchedRing(nbytes=sum(seen.carried[n].nbytes for n in sealed), world=seen.world))
    return Verdict(good, STOPPED_BY, tuple(evidence), plaintext)


STOPPED_BY = ("AES-256-GCM on every hop of the ring, per-direction keys from an ECDHE bound to each rank's quote "
              "(ddp/keys.py): what the host carried held no byte of the canary gradient in any encoding searched "
              "(control: the same search finds it in the plain ring's traffic); the receiver tracks the IVs and each "
              "record's AAD names its all-reduce, hop, segment and record, so the flipped, the replayed, the cut and "
              "the dropped record, and a full-length record in place of a hop's short last one, each failed "
              "authentication on rank 1 (IntegrityError; every receive is posted at the longest record the ring can "
              "send, so no record the host delivers in another's place makes gloo end the process), which stopped its "
              "DDP step before the optimizer moved a weight; the other ranks' steps completed with the right sum")


@row(ROW, "host", stopped_by=STOPPED_BY, tried="carried every record of a DDP step's encrypted ring all-reduce between "
     "3 data-parallel ranks (rank 0's gradient a canary), recorded it all and searched it for the gradient; then "
     "flipped a bit of, replayed the record before in place of, and dropped one record rank 0 sent rank 1 in the "
     "last hop")
def host_carries_allreduce(a: Arena) -> bool:
    verdict = judge(carry(a.cohort.loot_dir / ROW))
    a.keep(*verdict.evidence)
    a.plaintext = verdict.plaintext
    return verdict.stopped


# ----------------------------------------------------------------------------- the processes
class HostCarried:
    """A rank's ring link through the host: a header (destination, length, lane), then the record. `src`
    names no channel: where a record came from is for its authentication to say, not for the wire."""

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
        """Nothing more from this rank in this case."""
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


def rank_main(rank: int, plan: Plan) -> list[tuple[int, str, dict]]:
    """One rank: a DDP step with the encrypted hook per case, its ring carried by the host."""
    _join(rank, plan)
    # DDP's broadcast and the key exchange bypass the host: they carry zero weights and public shares, never a gradient
    ranks = dist.new_group(list(range(plan.world)))
    root_cert, root_key = plan.root
    tee = EmulatedRankTee(Authority(root_cert, serialization.load_pem_private_key(root_key, password=None)),
                          root_cert, MEASURED)
    # the launcher ends the process: a broken ring leaves receives that never complete
    return [(rank, c.name, _step(rank, plan, c, ranks, _carrier(plan), tee)) for c in plan.cases]


def _step(rank: int, plan: Plan, case: Case, ranks: dist.ProcessGroup, carrier: dist.ProcessGroup,
          tee: EmulatedRankTee) -> dict:
    keys = None if case.variant == "plain" else establish_pair_keys(tee.attest, tee.verify, group=ranks,
                                                                   context=plan.context + case.name.encode())
    link = HostCarried(carrier, rank, plan.world, host=plan.world)
    ring = Ring(case.variant, keys=keys, record_bytes=plan.record_bytes, p2p=link, timeout_s=plan.timeout_s)
    gradient = torch.frombuffer(bytearray(plan.gradient), dtype=torch.float32)
    model = _Gradient(gradient.numel())
    ddp = DistributedDataParallel(model, process_group=ranks)
    state = RingHookState(ring)
    ddp.register_comm_hook(state, encrypted_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    x = gradient if rank == 0 else torch.zeros_like(gradient)
    out = {"completed": True, "error": "", "message": ""}
    try:
        opt.zero_grad()
        ddp(x).backward()
        opt.step()
    except RuntimeError:  # DDP re-raises the hook's error; the typed one is kept by the hook
        failure = state.failure
        if failure is None:
            raise
        out = {"completed": False, "error": type(failure).__name__, "message": str(failure)}
    finally:
        state.close()
        link.done()
    w = model.w.detach()
    # The step SGD takes with the right average: 0 - 1.0 * (gradient / W), the same operations.
    right = torch.zeros_like(gradient).add_(gradient / plan.world, alpha=-1.0)
    return {**out, "sum_right": bool(torch.equal(w, right)), "untouched": bool(torch.equal(w, torch.zeros_like(w)))}


def host_main(plan: Plan) -> list[tuple[int, str, dict]]:
    """The host: carries every record of every case, records it, and tampers as the case says."""
    _join(plan.world, plan)
    dist.new_group(list(range(plan.world)))  # every process takes part in making every group
    return [(plan.world, c.name, _carry(plan, c, _carrier(plan))) for c in plan.cases]


def _carrier(plan: Plan) -> dist.ProcessGroup:
    """A case's group of the ranks and the host, made by every process in the same order."""
    return dist.new_group(list(range(plan.world + 1)), timeout=timedelta(seconds=plan.timeout_s))


def _carry(plan: Plan, case: Case, carrier: dist.ProcessGroup) -> dict:
    carried: list[bytes] = []
    tampered: list[Tampered] = []
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
                    out = _tamper(case.fault, record, last)
                    with lock:
                        tampered.append(Tampered(case=case.name, fault=case.fault, record=sent, nbytes=n,
                                                 delivered=-1 if out is None else len(out)))
                sent, last = sent + 1, record
            with lock:
                carried.append(record)
                if out is not None:
                    deliveries.append(dist.isend(torch.frombuffer(bytearray(out), dtype=torch.uint8), dst,
                                                 group=carrier, tag=DELIVER + lane))

    def guarded(src: int) -> str:
        try:
            serve(src)
        except Exception as err:  # noqa: BLE001 (reported with the case)
            return f"rank {src}'s records: {type(err).__name__}: {err}"
        return ""

    with ThreadPoolExecutor(plan.world) as pool:
        failures = [f for f in pool.map(guarded, range(plan.world)) if f]
    for work in deliveries:
        work.wait(timedelta(seconds=plan.timeout_s))
    capture = b"".join(carried)
    Path(plan.out_dir, f"host-{case.name}.bin").write_bytes(capture)
    return {"records": len(carried), "bytes": len(capture), "tampered": tampered, "failures": failures}


def _tamper(fault: str, record: bytes, before: bytes) -> bytes | None:
    """What the host delivers in place of ``record`` (None: nothing)."""
    mid = len(record) // 2
    flipped = record[:mid] + bytes([record[mid] ^ 0x01]) + record[mid + 1 :]  # bit 0 of the middle byte
    return {"flip": flipped, "replay": before, "cut": record[:mid]}.get(fault)


def _join(rank: int, plan: Plan) -> None:
    torch.set_num_threads(1)  # the processes share this machine's cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(plan.port))
    dist.init_process_group("gloo", rank=rank, world_size=plan.world + 1,
                            timeout=timedelta(seconds=plan.timeout_s))
