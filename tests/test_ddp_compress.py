"""Gradient compression before sealing (issue 31), off by default: the hook's `compress` sends
each bucket as fp16 or bf16. G2 within the option: the sealed rings, naive and pipelined, train
to the very bits of the unsealed ring with the same option; the option does change the numerics.
And the ring's default variant, chosen from the cores a machine has."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddp_steps import sgd_steps  # tests/ddp_steps.py

from gputravel.ddp import Ring, RingHookState, Variant, default_variant, encrypted_allreduce_hook, establish_pair_keys
from gputravel.ddp.hook import compress_dtype
from gputravel.errors import BadInput
from gputravel.train.ranks import Ranks


def _keys(group):
    return establish_pair_keys(lambda data: data, lambda *a: None, group=group, context=b"test compress")


def _train(rank: int, variant: str, compress: str | None) -> torch.Tensor:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002)  # a few buckets
    group = dist.new_group(backend="gloo")
    ring = Ring(variant, keys=None if variant == "plain" else _keys(group), record_bytes=512, group=group)
    state = RingHookState(ring, compress=compress)
    ddp.register_comm_hook(state, encrypted_allreduce_hook)
    try:
        return sgd_steps(ddp, model, rank, 3)
    finally:
        state.close()


def compressed(rank: int, world: int) -> dict:
    out = {}
    for compress in ("fp16", "bf16", None):
        trained = {v: _train(rank, v, compress) for v in ("plain", "naive", "pipelined")}
        out[compress] = {"sealed_equal_plain": all(torch.equal(trained["plain"], trained[v])
                                                   for v in ("naive", "pipelined")),
                         "params": trained["plain"].tolist()}
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_compressed_sealed_rings_train_to_the_bits_of_the_unsealed_ring_with_the_same_option(run_ranks,
                                                                                            world: int) -> None:
    results = run_ranks(compressed, world, timeout=60)
    for r in results:
        for compress in ("fp16", "bf16", None):
            assert r[compress]["sealed_equal_plain"], compress
            assert r[compress]["params"] == results[0][compress]["params"]  # every rank alike
    full = torch.tensor(results[0][None]["params"])
    for compress, tol in (("fp16", 1e-2), ("bf16", 5e-2)):
        params = torch.tensor(results[0][compress]["params"])
        assert not torch.equal(params, full)  # the option is on: it changes the numerics...
        assert torch.allclose(params, full, atol=tol)  # ...within the type's precision


def test_compress_names_a_type_or_none() -> None:
    assert compress_dtype(None) is None and compress_dtype("fp16") is torch.float16
    assert compress_dtype("bf16") is torch.bfloat16
    with pytest.raises(BadInput, match="compress must be one of"):
        compress_dtype("int8")
    with pytest.raises(BadInput, match="compress must be one of"):
        Ranks(rank=0, world_size=2, attest=bytes, verify=lambda *a: None, context=b"job", compress="fp8")
    assert Ranks(rank=0, world_size=2, attest=bytes, verify=lambda *a: None, context=b"job").compress is None


def test_the_default_variant_is_pipelined_only_with_a_core_per_rank() -> None:
    assert default_variant(4, cores=2) is Variant.NAIVE
    assert default_variant(2, cores=2) is Variant.PIPELINED
    assert default_variant(4, cores=16) is Variant.PIPELINED
    assert default_variant(2) in (Variant.NAIVE, Variant.PIPELINED)  # this machine's own cores
