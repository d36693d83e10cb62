"""`gputravel bench ddp`: what sealing every hop of the ring all-reduce costs (issue 14).

G ranks train the same GPT-2 data-parallel three ways (METHODS: gloo unsealed, the ring sealed
hop by hop, the ring pipelined); ``g2_identical`` checks the hook's ring against itself and
gloo. On CPU the "GPUs" are processes sharing this machine's cores: the ratios carry over, not
the milliseconds. The methods' samples take turns, so a busy moment falls on each alike. Each
row also has the limit this run measured for its all-reduce (issue 31): gloo's plain all-reduce
plus the AES-GCM the ring cannot avoid, spread over the cores the ranks share
(`allreduce_limit_ms`); and, to say where a sealed ring loses against it, the ring unsealed and
the CPU every rank spent. docs/benchmarks.md gives the method.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from cryptography.hazmat.primitives import serialization
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from gputravel.attest import Authority
from gputravel.attest.quote import EmulatedRankTee
from gputravel.attest.roots import TEE_QUOTING_ROOT_CN
from gputravel.bench.compare import stamp
from gputravel.bench.travel import crypto_limit_gbps
from gputravel.crypto.certs import key_pem
from gputravel.ddp import (DEFAULT_RECORD_BYTES, Ring, RingHookState, default_variant, encrypted_allreduce_hook,
                           establish_pair_keys)
from gputravel.ddp.hook import compress_dtype, stage, unstage
from gputravel.ddp.launch import free_port, run_processes
from gputravel.errors import BadInput
from gputravel.train.model import GPT, GPTConfig
from gputravel.train.ranks import backend_for

#: The models of the sweep (GPT-2 shapes, sized for a CPU): about 0.3M and 3.3M parameters.
MODELS = {
    "small": GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=2, n_embd=64),
    "base": GPTConfig(block_size=64, vocab_size=256, n_layer=4, n_head=4, n_embd=256),
}
METHODS = ("plain", "encrypted_naive", "encrypted")
RING_UNSEALED = "ring_unsealed"  # an all-reduce (not a training method): the ring with no sealing
BATCH = 4
MEASURED = b"\x5a" * 48  # the rank CVMs' measurement, as the verifier accepts it (emulated)
G2_STEPS = 3  # training steps of each of the two runs compared
G2_TOLERANCE = 1e-5  # rtol and atol of the ring against gloo (the sum's order differs)
DEVICES = ("cpu", "cuda")
AES_BYTES = 32 << 20  # sealed then opened per measure of the AES rate
AES_ROUNDS = 5  # measures per cell; the median is the cell's rate


Samples = dict[str, list[float]]


def interleaved_ms(runs: dict[str, Callable[[], object]], warmup: int, iters: int, done: Callable[[], None],
                   sync: Callable[[], None], before: Callable[[], None] = lambda: None) -> tuple[Samples, Samples]:
    """`iters` samples of each run, wall and this process's CPU (all its threads) in ms, the runs
    taking turns in an order that rotates every round, so each sees the machine as the others did
    (issue 31: timed one after the other, gloo's plain all-reduce took 15.5 ms in one run and 29.9
    in the next on the same quiet VM). `before` runs untimed ahead of each sample; `sync` starts
    every rank's sample together; `done` waits for work queued on a GPU."""
    names = list(runs)
    for name in names:
        for _ in range(warmup):
            before()
            runs[name]()
    done()
    wall: Samples = {name: [] for name in names}
    cpu: Samples = {name: [] for name in names}
    for i in range(iters * len(names)):
        name = names[(i + i // len(names)) % len(names)]  # round r starts one run later than round r - 1
        before()
        done()
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        runs[name]()
        done()
        wall[name].append((time.perf_counter() - t0) * 1e3)
        cpu[name].append((time.process_time() - c0) * 1e3)
    return wall, cpu


def _summed_over_ranks(figures: dict[str, float], group: dist.ProcessGroup | None) -> dict[str, float]:
    """Each figure summed over the ranks (a CPU tensor: `group` is gloo on either device)."""
    total = torch.tensor(list(figures.values()), dtype=torch.float64)
    dist.all_reduce(total, group=group)
    return dict(zip(figures, total.tolist(), strict=True))


def spread(samples: list[float]) -> tuple[float, float]:
    """The 10th and 90th percentiles of `samples` (their only value, for one)."""
    if len(samples) < 2:
        return samples[0], samples[0]
    deciles = statistics.quantiles(samples, n=10, method="inclusive")
    return deciles[0], deciles[-1]


# PyTorch's own hooks for plain DDP with --compress: the same casts, gloo's all-reduce.
_PLAIN_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


def _ring_exchange(ring: Ring, tensor: torch.Tensor, dtype: torch.dtype | None) -> None:
    """The ring's all-reduce as the hook runs it: compressed, a CUDA tensor through a (timed) host copy."""
    host = stage(tensor if dtype is None else tensor.to(dtype))
    ring.all_reduce(host)
    unstage(tensor, host)


def _plain_exchange(tensor: torch.Tensor, dtype: torch.dtype | None) -> None:
    if dtype is None:
        dist.all_reduce(tensor)
        return
    small = tensor.to(dtype)
    dist.all_reduce(small)
    tensor.copy_(small)


def _iteration(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    return loss


def _cell(rank: int, world: int, model_name: str, iters: int, root: tuple[bytes, bytes], context: bytes,
          compress: str | None, device: torch.device, group: dist.ProcessGroup | None) -> dict:
    """One rank's share of one (G, model) cell, the rings on `group` (None: the default group)."""
    cfg = MODELS[model_name]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own batch, as DDP's shards
    x = torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size), generator=gen).to(device)
    y = torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size), generator=gen).to(device)
    done = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    root_cert, root_key = root
    authority = Authority(root_cert, serialization.load_pem_private_key(root_key, password=None))
    tee = EmulatedRankTee(authority, root_cert, MEASURED)
    params = sum(p.numel() for p in GPT(cfg).parameters())
    pristine = torch.randn(params, generator=gen).to(device)
    flat = pristine.clone()
    dtype = compress_dtype(compress)
    steps, exchanges, states = {}, {}, []
    for method in METHODS:
        torch.manual_seed(0)  # the same initial weights for every method (DDP also broadcasts rank 0's)
        ddp = DDP(GPT(cfg).to(device))
        if method == "plain":
            if compress is not None:
                ddp.register_comm_hook(group, _PLAIN_HOOKS[compress])
            exchanges[method] = lambda: _plain_exchange(flat, dtype)
        else:
            # Each ring gets keys of its own: a direction's key serves one channel, once.
            keys = (establish_pair_keys(tee.attest, tee.verify, group=group, context=context + method.encode())
                    if world > 1 else None)
            ring = Ring("naive" if method == "encrypted_naive" else "pipelined", keys=keys, group=group)
            state = RingHookState(ring, overlap=method == "encrypted", compress=compress)
            ddp.register_comm_hook(state, encrypted_allreduce_hook)
            states.append(state)
            exchanges[method] = lambda r=ring: _ring_exchange(r, flat, dtype)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        steps[method] = lambda ddp=ddp, opt=opt: _iteration(ddp, opt, x, y)
    # The rings' own transport, unsealed: what sealing adds is the sealed rings less this.
    unsealed = Ring("plain", group=group)
    exchanges[RING_UNSEALED] = lambda: _ring_exchange(unsealed, flat, dtype)
    sync = dist.barrier  # every rank starts a sample together
    try:
        iter_ms, _ = interleaved_ms(steps, 3, iters, done, sync)
        # Every sample sums the same gradient: a sum of sums would overflow to inf within a run.
        allreduce_ms, cpu_ms = interleaved_ms(exchanges, 2, iters, done, sync, before=lambda: flat.copy_(pristine))
    finally:
        for state in states:
            state.close()
    return {"gpus": world, "model": model_name, "params": params,
            "iter_ms": {k: statistics.median(v) for k, v in iter_ms.items()},
            "allreduce_ms": {k: statistics.median(v) for k, v in allreduce_ms.items()},
            "allreduce_spread_ms": {k: spread(v) for k, v in allreduce_ms.items()},
            "allreduce_cpu_ms": _summed_over_ranks({k: statistics.mean(v) for k, v in cpu_ms.items()}, group),
            "compress": compress,
            "default_variant": default_variant(world).value,
            "g2": _g2(rank, cfg, x, y, params, group)}


def _g2(rank: int, cfg: GPTConfig, x: torch.Tensor, y: torch.Tensor, params: int,
        group: dist.ProcessGroup | None) -> dict:
    """The hook's plain ring against itself and gloo; the verdicts are MIN-reduced, so rank 0's holds for all."""
    data = torch.randn(params, generator=torch.Generator().manual_seed(4242 + rank))
    ring = Ring("plain", group=group)
    first, again = ring.all_reduce(data.clone()), ring.all_reduce(data.clone())
    rank0 = first.clone()
    dist.broadcast(rank0, 0, group=group)
    gloo = data.clone()
    dist.all_reduce(gloo, group=group)
    losses = [_hook_losses(cfg, x, y, group) for _ in range(2)]
    checks = {"ring_repeats_bitwise": torch.equal(first, again), "ring_same_on_every_rank": torch.equal(first, rank0),
              "hook_losses_repeat_bitwise": losses[0] == losses[1],
              "ring_agrees_with_gloo": torch.allclose(first, gloo, rtol=G2_TOLERANCE, atol=G2_TOLERANCE)}
    flags = torch.tensor([int(v) for v in checks.values()], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    diff = torch.tensor([float((first - gloo).abs().max())], dtype=torch.float64)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
    out = {name: bool(v) for name, v in zip(checks, flags.tolist(), strict=True)}
    return {**out, "max_abs_diff_vs_gloo": float(diff), "identical": all(out.values())}


def _hook_losses(cfg: GPTConfig, x: torch.Tensor, y: torch.Tensor, group: dist.ProcessGroup | None) -> list[float]:
    """Losses of G2_STEPS steps of DDP through the hook's plain ring, from seed 0."""
    torch.manual_seed(0)
    ddp = DDP(GPT(cfg).to(x.device))
    state = RingHookState(Ring("plain", group=group))
    ddp.register_comm_hook(state, encrypted_allreduce_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    try:
        return [_iteration(ddp, opt, x, y).item() for _ in range(G2_STEPS)]
    finally:
        state.close()


def _rank_main(rank: int, world: int, port: int, args: tuple, device_type: str = "cpu") -> dict:
    """One rank's process: gloo on CPU, or NCCL on cuda:`rank` with the rings on a gloo group of their own."""
    torch.set_num_threads(1)  # the ranks share this machine's cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator for this rank is on this GPU
    dist.init_process_group(backend_for(device), rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        group = None if backend_for(device) == "gloo" else dist.new_group(backend="gloo")
        return _cell(rank, world, *args, device, group)
    finally:
        dist.destroy_process_group()


def _job_context(world: int, model_name: str) -> bytes:
    # Names this cell and is fresh per run: quotes made for one cell are refused in any other.
    return f"gputravel bench ddp/{world}/{model_name}/{os.urandom(16).hex()}/".encode()


def aes_gbps_per_core(record_bytes: int = DEFAULT_RECORD_BYTES, rounds: int = AES_ROUNDS) -> float:
    """GB/s one core seals and then opens at the ring's record size (the channel's recipe): the
    median of `rounds` measures, each a byte sealed once and opened once."""
    return statistics.median(crypto_limit_gbps(AES_BYTES, record_bytes) for _ in range(rounds))


def cores_shared() -> int:
    """The cores the rank processes may run on (they inherit this process's affinity)."""
    return len(os.sched_getaffinity(0))


def allreduce_limit_ms(plain_ms: float, params: int, world: int, gbps: float, cores: int, item: int = 4) -> float:
    """The fastest a sealed ring could be here, unoverlapped: plain + each rank's AES. Every rank
    seals and opens 2(N-1)/N of the gradient's bytes on one thread; N ranks spread over the cores."""
    if world < 2:
        return plain_ms
    per_rank = 2 * (world - 1) / world * params * item
    return plain_ms + world * per_rank / (gbps * 1e9) / min(world, cores) * 1e3


def _limits(row: dict, gbps: float, cores: int) -> dict:
    ar, dtype = row["allreduce_ms"], compress_dtype(row["compress"])
    item = 4 if dtype is None else dtype.itemsize  # the gradient is float32, or compressed
    limit = allreduce_limit_ms(ar["plain"], row["params"], row["gpus"], gbps, cores, item)
    return {"aes_gbps_per_core": gbps, "allreduce_limit_ms": limit,
            "allreduce_vs_limit": {k: ar[k] / limit for k in METHODS if k != "plain"}}


def run_cell(world: int, model_name: str, iters: int, root: tuple[bytes, bytes], timeout: float = 600.0,
             device: str = "cpu", compress: str | None = None) -> dict:
    """Rank 0's row of one cell, with its limit; a rank that fails, dies or hangs stops the benchmark."""
    gbps = aes_gbps_per_core()  # just before the cell: the load it runs under, as near as we can
    port = free_port()
    context = _job_context(world, model_name)  # one for the whole cell: every rank must share it
    args = (model_name, iters, root, context, compress)
    rows = run_processes([(_rank_main, (r, world, port, args, device)) for r in range(world)], timeout,
                         names=[f"rank {r} of {world} ({model_name})" for r in range(world)])
    return {**rows[0], **_limits(rows[0], gbps, cores_shared())}


def run(gpus: tuple[int, ...], models: tuple[str, ...], iters: int = 5,
        on_row: Callable[[dict], None] | None = None, device: str = "cpu", compress: str | None = None) -> dict:
    """One row per (GPU count, model); device "cuda" puts each rank on a GPU of its own; `compress`
    ("fp16", "bf16") sends every method's gradients in that type (PyTorch's hooks for plain DDP)."""
    compress_dtype(compress)  # BadInput before anything runs
    if not gpus or any(g < 1 or g > 8 for g in gpus):
        raise BadInput("--gpus must be GPU counts from 1 to 8, e.g. 1,2,4")
    unknown = [m for m in models if m not in MODELS]
    if not models or unknown:
        raise BadInput(f"--models must name models of {', '.join(MODELS)}; unknown: {', '.join(unknown)}")
    if iters < 1:
        raise BadInput("--iters must be at least 1")
    if device not in DEVICES:
        raise BadInput(f"device must be one of {', '.join(DEVICES)} (got {device!r})")
    if device == "cuda" and max(gpus) > torch.cuda.device_count():
        raise BadInput(f"{max(gpus)} ranks need as many GPUs; this machine has {torch.cuda.device_count()}")
    quoting_root = Authority.self_signed(TEE_QUOTING_ROOT_CN)  # the emulated CPU-TEE root, for this run
    root = (quoting_root.cert_der, key_pem(quoting_root.key))
    rows, g2 = [], []
    for model_name in models:
        for world in gpus:
            row = run_cell(world, model_name, iters, root, device=device, compress=compress)
            g2.append({"gpus": world, "model": model_name, **row.pop("g2")})
            rows.append(row)
            if on_row:
                on_row(row)
    # "interleaved": the methods' samples took turns (interleaved_ms); a JSON without it timed them in turn.
    return {**stamp(), "iters": iters, "interleaved": True, "device": device, "compress": compress,
            "cores": cores_shared(),
            "aes_gbps_per_core": statistics.median(r["aes_gbps_per_core"] for r in rows), "rows": rows,
            "g2_identical": all(c["identical"] for c in g2), "g2": g2}
