"""Red-team row of issue 14: the host reads and tampers with the all-reduce between GPU TEEs.

Three ranks and the host run as processes of one torch.distributed world, and every record of
the ring all-reduce crosses the host's process (ddp_wire.py). Rank 0's gradient is a canary:
random float32 values with a marker quartet every 256 values; the other ranks' gradients are
zeros, so every partial sum on the wire is the canary itself, divided by the world size as the
hook divides it, and the search below can see any plaintext byte the wire could carry. The
cases, each a DDP step with the encrypted hook on a ring of its own (fresh keys, a fresh gloo
group through the host):

- ``encrypted`` and ``encrypted-naive``: the pipelined and the naive ring, honest host;
- ``plain-control``: the same step on the unsealed ring, so that the search is seen to work;
- ``flip``, ``replay``, ``cut``, ``drop``: the host flips a bit of, replays the record before in
  place of, delivers the first half of, or drops one record rank 0 sends rank 1 in the last hop;
- ``replay-longer``: the host delivers the record before, full length, in place of the hop's
  short last record (each hop's segment is 2.75 records long). gloo ends a process that gets a
  message longer than the receive posted for it, so this is the case that killed the receiving
  rank (SIGABRT, nothing reported) before the ring posted every receive at one size, that of
  the longest record it can send.

Everything the host carried is searched for the gradient in five encodings (float32 of the
gradient, of its 1/W share, of the updated weights; float16 and bfloat16 of the share), as
8-byte runs at any offset; a count is the bytes of the capture those runs cover. The row is
defeated when the sealed cases' captures hold 0 such bytes while the plain one holds many,
and each fault stopped rank 1's step with an IntegrityError before its optimizer moved a
weight, while the other ranks' steps completed with the right sum.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gputravel.attest import Authority
from gputravel.attest.roots import TEE_QUOTING_ROOT_CN
from gputravel.crypto.certs import key_pem
from gputravel.ddp.launch import free_port, run_processes
from gputravel.errors import BadInput, RemoteError
from gputravel.redteam.arena import Arena, Verdict
from gputravel.redteam.canary import Found
from gputravel.redteam.ddp_wire import Case, Plan, host_main, rank_main

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
    """The row's cases. ``sealed=False`` runs every ring plain: the row with its defence off,
    for the tests that show the row then fails."""
    ring = (lambda v: v) if sealed else (lambda v: "plain")
    return (Case("encrypted", ring("pipelined")), Case("encrypted-naive", ring("naive")), Case(CONTROL, "plain"),
            Case("flip", ring("pipelined"), "flip"), Case("replay", ring("pipelined"), "replay"),
            Case("replay-longer", ring("pipelined"), "replay", record=RECORDS_PER_HOP - 1),
            Case("cut", ring("pipelined"), "cut"), Case("drop", ring("pipelined"), "drop"))


@dataclass(frozen=True)
class Observed:
    """What the row saw: per case, the host's account, every rank's, and the search's."""

    cases: tuple[Case, ...]
    host: dict[str, dict]
    ranks: dict[str, dict[int, dict]]
    found: dict[str, int]  # bytes of the canary gradient in what the host carried
    scanned: dict[str, int]
    world: int


# ----------------------------------------------------------------------------- the canary
def canary_gradient(n: int) -> torch.Tensor:
    """Random float32 values with a random marker quartet every PERIOD values; fresh per run."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
    gradient = torch.randn(n, generator=gen)
    gradient.view(-1, PERIOD)[:, :4] = torch.randn(4, generator=gen) * 1000
    return gradient


def gradient_needles(gradient: torch.Tensor, world: int) -> np.ndarray:
    """Every WINDOW-byte run, at an element boundary, of the gradient in each encoding a leak
    could take, as sorted little-endian uint64."""
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


# ----------------------------------------------------------------------------- running it
def carry(out_dir: Path, *, sealed: bool = True, world: int = WORLD, only: tuple[str, ...] = ()) -> Observed:
    """Start the ranks and the host, run every case (or those named in `only`), search what
    the host carried."""
    chosen = tuple(c for c in cases(sealed) if not only or c.name in only)
    if world < 2 or not chosen:
        raise BadInput("the all-reduce row needs at least two ranks and a case")
    out_dir.mkdir(parents=True, exist_ok=True)
    per_record = RECORD_BYTES // 4
    gradient = canary_gradient(world * (RECORDS_PER_HOP * per_record - SHORT))
    root = Authority.self_signed(TEE_QUOTING_ROOT_CN)  # the emulated CPU-TEE quoting root of this run
    hops = 2 * (world - 1)
    plan = Plan(world=world, port=free_port(), cases=chosen, gradient=gradient.numpy().tobytes(),
                record_bytes=RECORD_BYTES, last_hop=(hops - 1) * RECORDS_PER_HOP,
                context=f"gputravel redteam {ROW}/{os.urandom(16).hex()}/".encode(),
                root=(root.cert_der, key_pem(root.key)), out_dir=str(out_dir), timeout_s=TIMEOUT_S)
    got = _launch(plan)
    needles = gradient_needles(gradient, world)
    found, scanned = {}, {}
    for case in chosen:
        data = (out_dir / f"host-{case.name}.bin").read_bytes()
        found[case.name], scanned[case.name] = found_in(data, needles), len(data)
    host = {c.name: got[(world, c.name)] for c in chosen}
    ranks = {c.name: {r: got[(r, c.name)] for r in range(world)} for c in chosen}
    return Observed(chosen, host, ranks, found, scanned, world)


class RowNotRun(RemoteError):
    """A rank or the host failed outside the attack (or timed out): the row was not carried out."""


def _launch(plan: Plan) -> dict[tuple[int, str], dict]:
    """Run the processes to the end (ddp/launch.py ends every one, whatever happens)."""
    targets = [(_rank, (r, plan)) for r in range(plan.world)] + [(_host, (plan,))]
    names = [f"rank {r}" for r in range(plan.world)] + ["the host"]
    try:
        answers = run_processes(targets, LAUNCH_TIMEOUT_S, names=names, method="forkserver",
                                preload=["torch", "torch.distributed", "gputravel.redteam.ddp_wire"], grace=5.0)
    except RemoteError as err:  # a process failed, died or hung: the row was not carried out
        raise RowNotRun(str(err)) from err
    return {(who, case): value for sent in answers for _, who, case, value in sent}


def _rank(rank: int, plan: Plan) -> list[tuple]:
    return _answers(rank_main, rank, plan)


def _host(plan: Plan) -> list[tuple]:
    return _answers(host_main, plan)


class _Left(Exception):
    """Raised where a ddp_wire process would end itself (_leave), to hand its answers back."""


class _Answers:
    """Stands in for the queue ddp_wire's processes put their per-case answers in; the
    launcher sends them back as the process's one result, then ends the process."""

    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def put(self, item: tuple) -> None:
        self.sent.append(item)

    def close(self) -> None:
        pass

    def join_thread(self) -> None:
        raise _Left  # _leave's os._exit is not reached: the launcher's own exit takes over


def _answers(main, *args) -> list[tuple]:
    out = _Answers()
    try:
        main(*args, out)
    except _Left:
        pass
    failed = [value["failed"] for *_, value in out.sent if "failed" in value]
    if failed:  # raised, so that the launcher names this process and stops the row at once
        raise RowNotRun(failed[0])
    return out.sent


# ----------------------------------------------------------------------------- judging it
def judge(seen: Observed) -> Verdict:
    """Stopped when every sealed capture holds 0 gradient bytes (and the control many), and
    every fault stopped its receiver's step with an IntegrityError, the others' steps right."""
    good, evidence = True, []
    others = [r for r in range(seen.world) if r != RECEIVER]
    for case in seen.cases:
        host, ranks, found = seen.host[case.name], seen.ranks[case.name], seen.found[case.name]
        carried = f"the host carried {host['records']} records ({host['bytes']} bytes) of the {case.variant} ring"
        good = good and not host["failures"]
        evidence += [f"{case.name}: host: {line}" for line in (*host["said"], *host["failures"])]
        if case.name == CONTROL:
            right = all(r["outcome"] == "completed" and r["sum_right"] for r in ranks.values())
            good = good and right and found > 0
            evidence.append(f"control: {carried}; the same search finds {found} bytes of the canary gradient "
                            f"in it; {_ranks_line(ranks, range(seen.world))}")
            continue
        evidence.append(f"{case.name}: {carried}: {found} bytes of the canary gradient found")
        good = good and host["bytes"] > 0 and found == 0
        if not case.fault:
            good = good and all(r["outcome"] == "completed" and r["sum_right"] for r in ranks.values())
            evidence.append(f"{case.name}: {_ranks_line(ranks, range(seen.world))}")
            continue
        hit = ranks[RECEIVER]
        good = (good and bool(host["said"]) and hit["outcome"] == "stopped" and hit["error"] == "IntegrityError"
                and hit["untouched"] and all(ranks[r]["outcome"] == "completed" and ranks[r]["sum_right"]
                                             for r in others))
        evidence.append(f"{case.name}: {_ranks_line(ranks, [RECEIVER])}; {_ranks_line(ranks, others)}")
    sealed = [c.name for c in seen.cases if c.name != CONTROL]
    plaintext = Found(sample_bytes=sum(seen.found[n] for n in sealed))
    evidence.append(f"searched {sum(seen.scanned[n] for n in sealed)} bytes the host carried in every case but the "
                    f"control for 8-byte runs of the canary gradient in 5 encodings (float32 of the gradient, of its 1/"
                    f"{seen.world} share and of the updated weights; float16 and bfloat16 of the share)")
    return Verdict(good, STOPPED_BY, tuple(evidence), plaintext)


def _ranks_line(ranks: dict[int, dict], which) -> str:
    parts = []
    for r in which:
        out = ranks[r]
        if out["outcome"] == "stopped":
            moved = "its parameters never moved" if out["untouched"] else "its parameters MOVED"
            parts.append(f"rank {r}'s step stopped: {out['error']}: {out['message']}; {moved}")
        else:
            parts.append(f"rank {r}'s step completed with {'the right' if out['sum_right'] else 'a WRONG'} sum")
    return "; ".join(parts)


STOPPED_BY = ("AES-256-GCM on every hop of the ring, per-direction keys from an ECDHE bound to each rank's quote "
              "(ddp/keys.py): what the host carried held no byte of the canary gradient in any encoding searched "
              "(control: the same search finds it in the plain ring's traffic); the receiver tracks the IVs and each "
              "record's AAD names its all-reduce, hop, segment and record, so the flipped, the replayed, the cut and "
              "the dropped record, and a full-length record in place of a hop's short last one, each failed "
              "authentication on rank 1 (IntegrityError; every receive is posted at the longest record the ring can send, "
              "so no record the host delivers in another's place makes gloo end the process), which stopped its DDP "
              "step before the optimizer moved a weight; the other ranks' steps completed with the right sum")


def host_carries_allreduce(a: Arena) -> Verdict:
    """The row, in the live red-team run: what the host carried goes to its loot."""
    return judge(carry(a.cohort.loot_dir / ROW))
