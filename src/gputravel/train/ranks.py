"""One rank of a data-parallel training job over torch.distributed (issue 14).

Each rank is an orchestrator CVM with its own GPU and its own data; the ranks train one model
with DistributedDataParallel, whose gradient all-reduce is the encrypted ring of ddp/ (every
hop sealed with per-pair keys bound to both ranks' attestation)::

    ranks = Ranks(rank, world_size, attest=tee.attest, verify=tee.verify, context=job_id)
    with DataParallel.open(ranks) as dp:   # env:// rendezvous, attested pair keys, the ring
        ddp = dp.wrap(model)                # DDP + the encrypted all-reduce hook
        _, loss = ddp(x, y)
        dp.backward(loss)                   # a broken ring raises its typed error
        states = dp.gather(loader_state)    # every rank's, through the sealed ring

What crosses the wire outside the ring, in the clear: the rendezvous (ranks, addresses), the
key shares (public keys and quotes, which are public) and the refusal verdicts, on the ring's
gloo group, and DDP's own bookkeeping (which parameters each rank used in a step, a bitmap) on
the default group (gloo, or NCCL on CUDA). Parameters are never broadcast (see `wrap`), and
gradients and `gather`'s objects go through the sealed ring only.

The default group's backend follows this rank's device (`backend_for`): gloo on the CPU, NCCL
on a CUDA device, where DDP's bookkeeping then stays on the GPU. The ring always has a gloo
group of its own and reduces CPU tensors: a CUDA bucket is staged through a host copy
(ddp/hook.py), as GPUs in CC mode have no peer-to-peer path and exchange through the CPU
anyway. (The CUDA path has not run in this project: no GPU was at hand.)
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gputravel.ddp import Ring, RingHookState, Variant, encrypted_allreduce_hook, establish_pair_keys
from gputravel.errors import BadInput, ProtocolError
from gputravel.train.model import pick_device

__all__ = ["ENCRYPTED_VARIANTS", "DataParallel", "Ranks", "backend_for", "rank_device"]

log = logging.getLogger(__name__)

#: The ring variants a training job may use: both seal every hop. The ring's `plain` variant
#: is for benchmarks; a job never sends gradients in the clear.
ENCRYPTED_VARIANTS = (Variant.NAIVE.value, Variant.PIPELINED.value)
MAX_GATHER_BYTES = 64 << 20  # one rank's object in `gather`: loader cursors and losses, far less


@dataclass(frozen=True)
class Ranks:
    """This process's place in a data-parallel job and its TEE.

    `attest(report_data) -> evidence` quotes with this rank's TEE; `verify(peer, evidence,
    report_data)` raises when a peer's evidence is refused (ddp/keys.py). `context` names the
    job (and should carry a nonce every rank shares): it is bound into the pair keys, so
    evidence made for one job is refused in any other."""

    rank: int
    world_size: int
    attest: Callable[[bytes], bytes]
    verify: Callable[[int, bytes, bytes], None]
    context: bytes
    variant: str = Variant.PIPELINED.value
    timeout_s: float = 300.0  # rendezvous and any one ring transfer
    # Which holders each rank trains on (by rank), when the job says: a checkpoint records
    # them and a resume with other shares is refused (a chunk would reach two ranks).
    shares: tuple[tuple[str, ...], ...] = ()
    # SHA-384 of the checkpoint this rank resumes, as bound into `context`: the loop loads the
    # bytes it checked against it, so a file swapped after binding is refused, not loaded.
    resume_sha384: bytes = b""

    def __post_init__(self) -> None:
        if type(self.world_size) is not int or self.world_size < 1:
            raise BadInput(f"world_size must be a positive int (got {self.world_size!r})")
        if type(self.rank) is not int or not 0 <= self.rank < self.world_size:
            raise BadInput(f"rank must be an int in 0..{self.world_size - 1} (got {self.rank!r})")
        if not callable(self.attest) or not callable(self.verify):
            raise BadInput("attest and verify must be callables (this rank's TEE and the peers' verifier)")
        if not isinstance(self.context, bytes) or not self.context:
            raise BadInput("context must be non-empty bytes naming the job")
        if self.variant not in ENCRYPTED_VARIANTS:
            raise BadInput(f"variant must be one of {', '.join(ENCRYPTED_VARIANTS)} (got {self.variant!r})")
        if not self.timeout_s > 0:
            raise BadInput("timeout_s must be positive")
        if self.shares:
            names = [n for share in self.shares for n in share]
            if (len(self.shares) != self.world_size or not all(self.shares) or
                    not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names)):
                raise BadInput(f"shares must name each of the {self.world_size} ranks' holders, "
                               "every holder in one share only")


def backend_for(device: str | torch.device) -> str:
    """The default group's backend for a rank on `device`: "nccl" on CUDA, "gloo" otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str | torch.device | None = None) -> torch.device:
    """This rank's device, `device` or else train/model.py's pick_device (as the training loop
    picks it), with a CUDA index made explicit: the GPU the rank's model must be on."""
    dev = torch.device(pick_device() if device is None else device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class DataParallel:
    """This rank's membership in the job: the process group, the attested ring, the DDP hook.

    Make it with `DataParallel.open(ranks)`; `close()` (or leaving a `with` block) ends it."""

    def __init__(self, ranks: Ranks, group: dist.ProcessGroup, ring: Ring, owns_default: bool,
                 device: torch.device = torch.device("cpu")) -> None:
        self.ranks = ranks
        self.device = device
        self._group = group
        self._ring = ring
        self._state = RingHookState(ring)
        self._owns_default = owns_default
        self._closed = False

    def __repr__(self) -> str:
        return f"DataParallel(rank={self.ranks.rank}, world_size={self.ranks.world_size}, ring={self._ring!r})"

    @classmethod
    def open(cls, ranks: Ranks, device: str | torch.device | None = None) -> DataParallel:
        """Join the job and make the attested pair keys, before any gradient moves.

        The rendezvous is torchrun-compatible env://: the caller (torchrun, or a launcher such
        as jobs/local_ranks.py) sets MASTER_ADDR and MASTER_PORT; rank and world size come from
        `ranks`. A default group already initialised by the caller is used as it is (its rank
        and size must match) and left to the caller at close. Collective: every rank calls it.
        `device` is where this rank's model is (default: `rank_device()`, the loop's choice); it
        picks the default group's backend (`backend_for`).
        Raises PeerAttestationError when a rank refuses a peer's evidence."""
        timeout = timedelta(seconds=ranks.timeout_s)
        dev = rank_device(device)
        owns_default = not dist.is_initialized()
        if owns_default:
            for name in ("MASTER_ADDR", "MASTER_PORT"):
                if not os.environ.get(name):
                    raise BadInput(f"{name} is not set: the ranks meet by env:// (set it, or launch with torchrun)")
            if dev.type == "cuda":
                torch.cuda.set_device(dev)  # NCCL's communicator for this rank is on this GPU, no other
            dist.init_process_group(backend_for(dev), init_method="env://", rank=ranks.rank,
                                    world_size=ranks.world_size, timeout=timeout)
        elif (dist.get_rank(), dist.get_world_size()) != (ranks.rank, ranks.world_size):
            raise BadInput(f"the process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
                           f"not rank {ranks.rank} of {ranks.world_size}")
        group = None
        try:
            group = dist.new_group(backend="gloo", timeout=timeout)  # the ring's own, out of DDP's way
            keys = establish_pair_keys(ranks.attest, ranks.verify, group=group, context=ranks.context)
            ring = Ring(ranks.variant, keys=keys, group=group, timeout_s=ranks.timeout_s)
        except BaseException:
            _teardown(group, owns_default)
            raise
        return cls(ranks, group, ring, owns_default, dev)

    def wrap(self, model: torch.nn.Module) -> DistributedDataParallel:
        """`model` in DDP whose gradient all-reduce is the encrypted ring. Keep `model` itself
        for checkpoints and sampling: the wrapper shares its parameters. The model must lie
        wholly on this rank's device (another rank's GPU would be shared with it)."""
        devices = {p.device for p in model.parameters()}
        if devices != {self.device}:
            found = ", ".join(sorted(map(str, devices))) or "no device (it has no parameters)"
            raise BadInput(f"the model is on {found}, not on this rank's device {self.device}")
        # init_sync=False: DDP would otherwise broadcast rank 0's parameters at start, in the
        # clear over the default group. No broadcast is needed: every rank builds the same model from the
        # job's seed, or loads the same checkpoint. Buffers likewise are never synced.
        # find_unused_parameters=True keeps DDP from re-bucketing the gradients after its first
        # step (it re-buckets only when that flag is off). The ring adds each value in an order
        # set by where it lies in its bucket, so a run resumed mid-way (whose DDP is new) must
        # bucket as the uninterrupted run did, or its sums, hence losses, differ in the last bits.
        args: dict = ({"forward_sync_buffers": False} if "forward_sync_buffers" in _DDP_ARGS
                      else {"broadcast_buffers": False})
        if self.device.type == "cuda":  # a single-GPU module: DDP's own form for it
            args["device_ids"] = [self.device.index]
        ddp = DistributedDataParallel(model, init_sync=False, find_unused_parameters=True, **args)
        ddp.register_comm_hook(self._state, encrypted_allreduce_hook)
        return ddp

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()` through the ring; a failed all-reduce raises its typed error
        (IntegrityError, ChannelFaulted, PeerTimeout, ...) rather than DDP's RuntimeError."""
        try:
            loss.backward()
        except RuntimeError:
            if self._state.failure is not None:
                raise self._state.failure from None
            raise

    def gather(self, obj: object) -> list:
        """Every rank's `obj` (JSON types), by rank. Collective: every rank calls it at the same
        point, between steps (the ring serves one all-reduce at a time).

        It travels through the sealed ring, as an all-reduce in which each rank fills its own
        row with its bytes and zeros elsewhere (x + 0 is exact): peers' data is neither sent
        in the clear nor unpickled."""
        mine = json.dumps(obj, separators=(",", ":")).encode()
        if len(mine) > MAX_GATHER_BYTES:
            raise BadInput(f"gather takes at most {MAX_GATHER_BYTES} bytes a rank (got {len(mine)})")
        n, rank = self.ranks.world_size, self.ranks.rank
        sizes = torch.zeros(n, dtype=torch.float64)
        sizes[rank] = len(mine)
        self._ring.all_reduce(sizes)
        raw = sizes.tolist()
        if not all(math.isfinite(v) and v == int(v) and 0 < v <= MAX_GATHER_BYTES for v in raw) or raw[rank] != len(mine):
            raise ProtocolError("gather: a rank announced an impossible size")
        lengths = [int(v) for v in raw]
        rows = torch.zeros((n, max(lengths)), dtype=torch.float32)
        sent = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(torch.float32)
        rows[rank, : len(mine)] = sent
        self._ring.all_reduce(rows.view(-1))
        # Each row is one rank's bytes then zeros; mine must come back as I sent it. A rank out
        # of step that wrote into another's row shows here, not as a wrong cursor later.
        if not torch.equal(rows[rank, : len(mine)], sent) or any(rows[r, m:].any() for r, m in enumerate(lengths)):
            raise ProtocolError("gather: the rows overlapped")
        return [_decoded(rows[r, :m]) for r, m in enumerate(lengths)]

    @property
    def failure(self) -> BaseException | None:
        """The typed error that stopped a step, if one did."""
        return self._state.failure

    def close(self) -> None:
        """Stop the hook's worker and leave the process group; never raises (it runs on the
        way out of a failed step, whose error matters more)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._state.close()
        except Exception as err:  # noqa: BLE001 - closing must not hide the run's own error
            log.debug("closing the ring's hook failed: %s", type(err).__name__)
        _teardown(self._group, self._owns_default)

    def __enter__(self) -> DataParallel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_DDP_ARGS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters)


def _decoded(row: torch.Tensor) -> object:
    data = row.to(torch.uint8)
    if not torch.equal(data.to(torch.float32), row):  # two ranks wrote one cell: a ring out of step
        raise ProtocolError("gather: the rows overlapped")
    try:
        return json.loads(data.numpy().tobytes())
    except ValueError:
        raise ProtocolError("gather: a rank's object is not JSON") from None


def _teardown(group: dist.ProcessGroup | None, owns_default: bool) -> None:
    """Destroy the ring's group and, if this rank made it, the default group; never raises."""
    for pg, ours in ((group, group is not None), (None, owns_default)):
        if not ours:
            continue
        try:
            dist.destroy_process_group(pg)
        except Exception as err:  # noqa: BLE001 - a group a dead peer left behind: nothing to do
            log.debug("destroying a process group failed: %s", type(err).__name__)
