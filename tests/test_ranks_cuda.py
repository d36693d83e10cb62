"""Data-parallel ranks on CUDA (issue 14): NCCL for the default group where the rank's device is
a GPU, gloo on the CPU; a CUDA gradient bucket staged through a host copy for the encrypted
ring (ddp/hook.py), a CPU bucket reduced where it lies.

No GPU was lent to this project: the staging contract is driven here with CPU tensors through
its seam (`stage`, `host_copy`, `unstage`), and the tests that need CUDA skip without it."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ddp_steps import sgd_steps  # tests/ddp_steps.py

from gputravel.ddp import Ring, RingHookState, encrypted_allreduce_hook
from gputravel.ddp import hook
from gputravel.errors import BadInput, ChannelFaulted
from gputravel.train import model as model_module
from gputravel.train.loop import TrainConfig
from gputravel.train.ranks import DataParallel, Ranks, backend_for, rank_device

TINY = TrainConfig(steps=6, batch=2, seq_len=16, buffer_bytes=1024, n_layer=1, n_head=2, n_embd=32,
                   threads=1, sample_tokens=0, warmup_steps=2, checkpoint_every=3)


class _Doubling:
    """A ring of two that 'sums' by doubling in place; records what it was given, and where."""

    world_size = 2

    def __init__(self, fail: bool = False) -> None:
        self.seen: list[tuple[torch.Tensor, torch.Tensor, str]] = []
        self.fail = fail

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.seen.append((tensor, tensor.clone(), threading.current_thread().name))
        if self.fail:
            raise ChannelFaulted("a peer went away")
        return tensor.mul_(2)


# ----------------------------------------------------------------------------- the backend
def test_the_default_groups_backend_follows_the_device() -> None:
    assert backend_for("cpu") == backend_for(torch.device("cpu")) == "gloo"
    assert backend_for("cuda") == backend_for("cuda:1") == backend_for(torch.device("cuda", 0)) == "nccl"
    assert backend_for("meta") == "gloo"


def test_a_rank_picks_the_gpu_of_its_local_rank(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert model_module.pick_device() == "cuda"  # one process, or a CVM with one GPU
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert model_module.pick_device() == "cuda:1"
    assert rank_device() == torch.device("cuda", 1)  # explicit index: nothing asks CUDA which is current
    for bad in ("2", "-1", "one"):
        monkeypatch.setenv("LOCAL_RANK", bad)
        with pytest.raises(BadInput, match="LOCAL_RANK"):
            model_module.pick_device()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert model_module.pick_device() == "cpu" and rank_device() == torch.device("cpu")  # CPU unchanged


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only choice")
def test_without_cuda_a_rank_is_on_the_cpu_under_gloo() -> None:
    assert rank_device() == torch.device("cpu") and backend_for(rank_device()) == "gloo"


# ----------------------------------------------------------------------------- wrap
class _Placed(torch.nn.Module):
    """A module whose parameters report `devices` (a CUDA device needs no GPU to be named)."""

    def __init__(self, *devices: str) -> None:
        super().__init__()
        self._devices = devices

    def parameters(self, recurse: bool = True):  # noqa: ARG002 - the stub's only answer
        return iter([SimpleNamespace(device=torch.device(d)) for d in self._devices])


def _dp(device: str) -> DataParallel:
    ranks = Ranks(rank=0, world_size=2, attest=bytes, verify=lambda *a: None, context=b"job")
    return DataParallel(ranks, None, _Doubling(), False, torch.device(device))


@pytest.mark.parametrize("rank_on, model_on", [("cuda:1", ("cuda:0",)), ("cuda:0", ("cpu",)), ("cpu", ("cuda:0",)),
                                               ("cuda:0", ("cuda:0", "cuda:1")), ("cpu", ())])
def test_a_model_off_the_ranks_device_is_refused(rank_on: str, model_on: tuple[str, ...]) -> None:
    dp = _dp(rank_on)
    try:
        with pytest.raises(BadInput, match="not on this rank's device"):
            dp.wrap(_Placed(*model_on))
    finally:
        dp.close()


# ----------------------------------------------------------------------------- staging
def test_a_cpu_bucket_is_reduced_where_it_lies(monkeypatch) -> None:
    copies = []
    monkeypatch.setattr(hook, "host_copy", lambda t: copies.append(t) or t.clone())
    for overlap in (True, False):
        ring = _Doubling()
        state = RingHookState(ring, overlap=overlap)
        bucket = torch.arange(6, dtype=torch.float32)
        assert hook.stage(bucket) is bucket
        fut = torch.futures.Future()
        state.submit(bucket, fut)
        assert fut.wait() is bucket and torch.equal(bucket, torch.arange(6, dtype=torch.float32) * 2)
        assert ring.seen[0][0] is bucket  # the ring reduced the bucket itself
        state.close()
    assert copies == []


def test_a_host_copy_is_separate_and_the_sum_comes_back() -> None:
    bucket = torch.arange(8, dtype=torch.float32)
    host = hook.host_copy(bucket)
    assert host is not bucket and host.data_ptr() != bucket.data_ptr()
    assert host.device.type == "cpu" and host.is_contiguous() and host.dtype == bucket.dtype
    assert torch.equal(host, bucket)
    host.mul_(3)
    assert torch.equal(bucket, torch.arange(8, dtype=torch.float32))  # untouched until unstaged
    hook.unstage(bucket, host)
    assert torch.equal(bucket, torch.arange(8, dtype=torch.float32) * 3)
    hook.unstage(bucket, bucket)  # nothing staged: nothing to do
    assert torch.equal(bucket, torch.arange(8, dtype=torch.float32) * 3)


def test_a_staged_bucket_is_copied_on_the_callers_thread_and_summed_back(monkeypatch) -> None:
    """As a CUDA bucket goes: staged by the caller, reduced by the worker, written back, then done."""
    staged_on = []

    def staging(bucket: torch.Tensor) -> torch.Tensor:
        staged_on.append(threading.current_thread().name)
        return hook.host_copy(bucket)

    monkeypatch.setattr(hook, "stage", staging)
    ring = _Doubling()
    state = RingHookState(ring)
    bucket = torch.arange(5, dtype=torch.float32)
    bucket_then = bucket.clone()  # before submitting: the worker may sum it back at once
    fut = torch.futures.Future()
    state.submit(bucket, fut)
    assert fut.wait() is bucket and torch.equal(bucket, bucket_then * 2)
    reduced, as_given, on = ring.seen[0]
    assert reduced is not bucket and torch.equal(as_given, bucket_then)  # the whole copy, before the ring ran
    assert staged_on == [threading.current_thread().name] and on.startswith("ddp-ring")
    state.close()


def test_a_failed_ring_leaves_a_staged_bucket_unsummed(monkeypatch) -> None:
    monkeypatch.setattr(hook, "stage", hook.host_copy)
    state = RingHookState(_Doubling(fail=True))
    bucket = torch.ones(4)
    fut = torch.futures.Future()
    state.submit(bucket, fut)
    with pytest.raises(ChannelFaulted):
        fut.wait()
    assert isinstance(state.failure, ChannelFaulted) and torch.equal(bucket, torch.ones(4))
    state.close()


def staged_against_in_place(rank: int, world: int) -> dict:
    """The same DDP training through the plain ring, its buckets reduced in place and then
    through host copies: the parameters after it, and how many copies each way made."""
    counted = []

    def counting(bucket: torch.Tensor) -> torch.Tensor:
        counted.append(bucket.numel())
        return hook.host_copy(bucket)

    real_stage = hook.stage
    out = {}
    for name, stage in (("in_place", real_stage), ("staged", counting)):
        hook.stage = stage
        counted.clear()
        try:
            out[name] = _train(rank).tolist()
        finally:
            hook.stage = real_stage
        out[name + "_copies"] = len(counted)
    return out


def _train(rank: int, steps: int = 3) -> torch.Tensor:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002)  # a few buckets
    group = dist.new_group(backend="gloo")
    state = RingHookState(Ring("plain", group=group, timeout_s=10))
    ddp.register_comm_hook(state, encrypted_allreduce_hook)
    try:
        return sgd_steps(ddp, model, rank, steps)
    finally:
        state.close()
        dist.destroy_process_group(group)


def test_staging_through_host_copies_trains_bit_for_bit_as_in_place(run_ranks) -> None:
    results = run_ranks(staged_against_in_place, 2, timeout=60)
    for r in results:
        assert r["in_place_copies"] == 0 and r["staged_copies"] > 0
        assert r["staged"] == r["in_place"]
    assert results[0]["staged"] == results[1]["staged"]  # the ranks hold one model


# ----------------------------------------------------------------------------- on a GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none in this project so far)")
def test_a_cuda_bucket_is_staged_through_pinned_memory_and_summed_back() -> None:
    ring = _Doubling()
    state = RingHookState(ring)
    bucket = torch.arange(1000, dtype=torch.float32, device="cuda")
    fut = torch.futures.Future(devices=[bucket.device])
    state.submit(bucket, fut)
    assert fut.wait() is bucket
    assert torch.equal(bucket.cpu(), torch.arange(1000, dtype=torch.float32) * 2)
    reduced, as_given, _ = ring.seen[0]
    assert reduced.device.type == "cpu" and reduced.is_pinned()
    assert torch.equal(as_given, torch.arange(1000, dtype=torch.float32))
    state.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices, one per rank (NCCL)")
def test_two_local_ranks_train_on_their_own_gpus(tmp_path, write_rank_shares) -> None:
    import math

    from gputravel.jobs.local_ranks import run_local_ranks

    shares = write_rank_shares(tmp_path)
    report = run_local_ranks(TINY, shares, tmp_path / "run", timeout=300)
    assert len(report["losses"]) == TINY.steps and report["gpus"] == 2
    assert all(math.isfinite(v) for losses in report["rank_losses"] for v in losses)
    assert report["rank_losses"][0] != report["rank_losses"][1]  # each rank its own batches
    assert (tmp_path / "run" / "checkpoint.pt").is_file()


def test_a_failed_staging_copy_stops_the_step_with_its_own_error(monkeypatch) -> None:
    """A bucket that cannot be copied to the host fails its future with that error, kept in
    state.failure for the loop to re-raise, and the ring never runs."""
    boom = RuntimeError("copy failed")

    def failing(bucket: torch.Tensor) -> torch.Tensor:
        raise boom

    monkeypatch.setattr(hook, "stage", failing)
    ring = _Doubling()
    state = RingHookState(ring)
    fut = torch.futures.Future()
    state.submit(torch.ones(3), fut)
    with pytest.raises(RuntimeError, match="copy failed"):
        fut.wait()
    assert state.failure is boom and not ring.seen
    state.close()


def test_a_future_that_cannot_complete_fails_instead_of_hanging(monkeypatch) -> None:
    """Completing a CUDA future can raise (it records events): the worker then fails the
    future with that error, rather than losing it and leaving DDP waiting for ever."""
    state = RingHookState(_Doubling())

    class Stubborn(torch.futures.Future):
        def set_result(self, result):  # torch's set_exception goes through here too
            if isinstance(result, torch.Tensor):
                raise RuntimeError("sticky device error")
            super().set_result(result)

    fut = Stubborn()
    state.submit(torch.ones(2), fut)
    with pytest.raises(RuntimeError, match="sticky device error"):
        fut.wait()
    assert isinstance(state.failure, RuntimeError)
    state.close()


@pytest.mark.parametrize("local", ["\u00b2", "\u0661", "-1", "1.0", " 1", "99999"])
def test_a_local_rank_that_is_not_plain_digits_naming_a_gpu_is_refused(monkeypatch, local: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", local)
    with pytest.raises(BadInput, match="names no GPU"):
        model_module.pick_device()
