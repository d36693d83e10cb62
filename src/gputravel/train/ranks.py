"""One rank of a data-parallel training job over torch.distributed (issue 14): DDP whose gradient
all-reduce is the encrypted ring of ddp/, every hop sealed with keys bound to both ranks' attestation.

In the clear: the rendezvous, the key shares (public keys and quotes) and refusal verdicts on
the ring's gloo group, and DDP's bookkeeping (which parameters a step used) on the default group
(gloo, or NCCL on CUDA). Parameters are never broadcast (`wrap`); gradients and `gather`'s objects
cross only the sealed ring, a CUDA bucket staged through a host copy (GPUs in CC mode have no P2P).
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gputravel.ddp import Ring, RingHookState, Variant, encrypted_allreduce_hook, establish_pair_keys
from gputravel.ddp.hook import compress_dtype
from gputravel.errors import BadInput, ProtocolError
from gputravel.train.model import pick_device

__all__ = ["ENCRYPTED_VARIANTS", "DataParallel", "Ranks", "backend_for", "rank_device"]

log = logging.getLogger(__name__)

#: Both seal every hop: the ring's `plain` variant is for benchmarks, never a job's gradients.
ENCRYPTED_VARIANTS = (Variant.NAIVE.value, Variant.PIPELINED.value)
MAX_GATHER_BYTES = 64 << 20  # one rank's object in `gather`: loader cursors and losses, far less


@dataclass(frozen=True)
class Ranks:
    """This process's place in a data-parallel job and its TEE (`attest`, `verify`: ddp/keys.py).
    `context` names the job (with a nonce every rank shares) and is bound into the pair keys, so
    evidence made for one job is refused in any other."""

    rank: int
    world_size: int
    attest: Callable[[bytes], bytes]
    verify: Callable[[int, bytes, bytes], None]
    context: bytes
    variant: str | None = None  # None: ddp.default_variant, by this machine's cores
    compress: str | None = None  # the hook's gradient compression before sealing ("fp16", "bf16"): off
    timeout_s: float = 300.0  # rendezvous and any one ring transfer
    # Each rank's holders: a resume with other shares is refused (a chunk would reach two ranks).
    shares: tuple[tuple[str, ...], ...] = ()
    # The checkpoint this rank resumes, as bound into `context`: a file swapped after binding is refused.
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
        if self.variant is not None and self.variant not in ENCRYPTED_VARIANTS:
            raise BadInput(f"variant must be one of {', '.join(ENCRYPTED_VARIANTS)} (got {self.variant!r})")
        if not self.timeout_s > 0:
            raise BadInput("timeout_s must be positive")
        compress_dtype(self.compress)  # BadInput for a type the hook does not compress to
        if self.shares:
            names = [n for share in self.shares for n in share]
            if (len(self.shares) != self.world_size or not all(self.shares) or
                    not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names)):
                raise BadInput(f"shares must name each of the {self.world_size} ranks' holders, "
                               "every holder in one share only")

    def for_job(self, ddp_compress: str) -> Ranks:
        """These ranks compressing as the job says (its `ddp_compress`, "none": off), so a job's
        setting is never accepted and ignored; BadInput where these ranks were told another."""
        compress = None if ddp_compress == "none" else ddp_compress
        if self.compress not in (None, compress):
            raise BadInput(f"the job's ddp_compress is {ddp_compress!r}, these ranks compress to {self.compress!r}")
        return replace(self, compress=compress)


def backend_for(device: str | torch.device) -> str:
    """The default group's backend for a rank on `device`: "nccl" on CUDA, "gloo" otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str | torch.device | None = None) -> torch.device:
    """`device`, or the loop's pick_device, with a CUDA index made explicit."""
    dev = torch.device(pick_device() if device is None else device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class DataParallel:
    """This rank's membership in the job: the process group, the attested ring, the DDP hook."""

    def __init__(self, ranks: Ranks, group: dist.ProcessGroup, ring: Ring, owns_default: bool,
                 device: torch.device = torch.device("cpu")) -> None:
        self.ranks = ranks
        self.device = device
        self._group = group
        self._ring = ring
        self._state = RingHookState(ring, compress=ranks.compress)
        self._owns_default = owns_default
        self._closed = False

    def __repr__(self) -> str:
        return f"DataParallel(rank={self.ranks.rank}, world_size={self.ranks.world_size}, ring={self._ring!r})"

    @classmethod
    def open(cls, ranks: Ranks, device: str | torch.device | None = None) -> DataParallel:
        """Join the job (env://, or the caller's default group) and make the attested pair keys,
        before any gradient moves; PeerAttestationError when a rank refuses a peer. Collective."""
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
        """`model` in DDP over the encrypted ring; it must lie wholly on this rank's device."""
        devices = {p.device for p in model.parameters()}
        if devices != {self.device}:
            found = ", ".join(sorted(map(str, devices))) or "no device (it has no parameters)"
            raise BadInput(f"the model is on {found}, not on this rank's device {self.device}")
        # init_sync=False: no broadcast of rank 0's parameters in the clear (every rank builds the
        # same model from the seed or checkpoint); buffers are never synced either.
        # find_unused_parameters=True: DDP never re-buckets, so a resumed run sums in the same
        # order as an uninterrupted one, and its losses stay bit-identical.
        args: dict = ({"forward_sync_buffers": False} if "forward_sync_buffers" in _DDP_ARGS
                      else {"broadcast_buffers": False})
        if self.device.type == "cuda":  # a single-GPU module: DDP's own form for it
            args["device_ids"] = [self.device.index]
        ddp = DistributedDataParallel(model, init_sync=False, find_unused_parameters=True, **args)
        ddp.register_comm_hook(self._state, encrypted_allreduce_hook)
        return ddp

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`; a failed all-reduce raises its typed error, not DDP's RuntimeError."""
        try:
            loss.backward()
        except RuntimeError:
            if self._state.failure is not None:
                raise self._state.failure from None
            raise

    def gather(self, obj: object) -> list:
        """Every rank's `obj` (JSON types), by rank; collective, between steps. An all-reduce through
        the sealed ring, each rank filling its own row (x + 0 is exact): never in the clear, never unpickled."""
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

    def anyone(self, flag: bool) -> bool:
        """Whether any rank's flag is set; collective, between steps, through the sealed ring."""
        votes = torch.zeros(self.ranks.world_size, dtype=torch.float64)
        votes[self.ranks.rank] = float(flag)
        self._ring.all_reduce(votes)
        if any(v not in (0.0, 1.0) for v in votes.tolist()) or votes[self.ranks.rank] != float(flag):
            raise ProtocolError("a rank's vote to stop is neither yes nor no")
        return bool(votes.any())

    def close(self) -> None:
        """Stop the hook and leave the group; never raises (a failed step's error matters more)."""
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
