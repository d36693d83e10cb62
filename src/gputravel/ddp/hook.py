"""The encrypted ring as a DDP communication hook.

    group = dist.new_group(backend="gloo")  # the ring's own, out of DDP's way
    keys = establish_pair_keys(attest, verify, group=group, context=b"job 42/ranks 0-3/" + shared_nonce)
    state = RingHookState(Ring("pipelined", keys=keys, group=group))
    model.register_comm_hook(state, encrypted_allreduce_hook)

Like DDP's default hook, it averages: each bucket is divided by the world size and summed
over the ring. DDP calls the hook from the backward pass as each gradient bucket fills. With
`overlap` (the default) the ring runs on one worker thread of its own and the hook returns at
once, so buckets are sealed and sent while the backward pass computes the next ones (DDP's
bucket overlap; the crypto and gloo release the GIL). Buckets reach the hook in the same order
on every rank, and the single worker keeps that order on the wire.

A failed all-reduce (a tampered, replayed, dropped, cut or longer record, a peer gone) completes the
bucket's future with the typed error, so DDP's backward raises and the step stops. DDP raises
it as a RuntimeError that quotes the error's message; the typed error itself is kept in
`state.failure`, for the training loop to re-raise.

A bucket on a CUDA device is staged through the host (`stage`, `unstage`), as GPUs in
confidential-computing mode have no peer-to-peer path and exchange through the CPU anyway: the
hook copies it into a CPU buffer (pinned) on the calling thread, the ring seals and reduces
that copy, and the worker copies the sum back into the bucket and waits for that copy before
it completes the future. A CPU bucket is reduced where it lies, with no copy. (The CUDA path
has not run in this project: no GPU was at hand.)
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket and Future[Tensor] as objects, not strings.

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from gputravel.ddp.ring import Ring
from gputravel.errors import ChannelFaulted

__all__ = ["RingHookState", "encrypted_allreduce_hook", "host_copy", "stage", "unstage"]


class RingHookState:
    """What the hook needs: the ring (its variant, keys and record size) and its worker."""

    def __init__(self, ring: Ring, *, overlap: bool = True) -> None:
        self.ring = ring
        self.overlap = overlap
        self.failure: BaseException | None = None  # the first error that stopped a step
        self._worker: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"RingHookState(ring={self.ring!r}, overlap={self.overlap})"

    def submit(self, bucket: torch.Tensor, fut: "torch.futures.Future[torch.Tensor]") -> None:
        # Staged here, on the caller's (autograd) thread, and complete on return: the worker
        # never reads a device buffer still being copied. A failed copy stops the step with
        # its error, as a failed ring does.
        try:
            host = stage(bucket)
        except Exception as err:
            self._fail(fut, err)
            return
        if not self.overlap:
            self._reduce_into(bucket, host, fut)
            return
        with self._lock:
            if self._closed:
                fut.set_exception(ChannelFaulted("the hook's ring was closed"))
                return
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddp-ring")
            self._worker.submit(self._reduce_into, bucket, host, fut)

    def _reduce_into(self, bucket: torch.Tensor, host: torch.Tensor,
                     fut: "torch.futures.Future[torch.Tensor]") -> None:
        try:
            self.ring.all_reduce(host)
            unstage(bucket, host)
            # Inside the try: completing a CUDA future records events, which can raise, and
            # an error lost in the worker would leave DDP waiting on this future for ever.
            fut.set_result(bucket)
        except Exception as err:  # the step must stop: DDP's backward re-raises it
            self._fail(fut, err)

    def _fail(self, fut: "torch.futures.Future[torch.Tensor]", err: Exception) -> None:
        if self.failure is None:
            self.failure = err
        fut.set_exception(err)

    def close(self) -> None:
        """Stop the worker thread (after the buckets already handed to it); later buckets fail.
        Held under the lock throughout, so no second worker can start while the first drains."""
        with self._lock:
            self._closed = True
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None


def stage(bucket: torch.Tensor) -> torch.Tensor:
    """The CPU tensor the ring reduces for `bucket`: `bucket` itself when it is on the CPU (no
    copy), else a host copy of it (`host_copy`)."""
    return bucket if bucket.device.type == "cpu" else host_copy(bucket)


def host_copy(bucket: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of `bucket`, complete when this returns. Pinned for a CUDA bucket:
    the copy engine then moves it directly (in CC mode still through the driver's encrypted
    bounce buffers)."""
    host = torch.empty(bucket.shape, dtype=bucket.dtype, device="cpu", pin_memory=bucket.is_cuda)
    host.copy_(bucket)  # blocking (non_blocking=False): the device->host copy has landed on return
    return host


def unstage(bucket: torch.Tensor, host: torch.Tensor) -> None:
    """Put the ring's sum `host` back into `bucket`, complete when this returns (the future is
    set next, and DDP reads the bucket then). Nothing to do where `stage` made no copy."""
    if host is bucket:
        return
    bucket.copy_(host)
    if bucket.is_cuda:  # copy_ already waits for a host->device copy; waiting again is cheap and explicit
        torch.cuda.current_stream(bucket.device).synchronize()


def encrypted_allreduce_hook(state: RingHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average `bucket` over the ring; the future holds the averaged buffer."""
    tensor = bucket.buffer()
    # Divide first, as DDP's default hook does (keeps fp16 from overflowing in the sum).
    tensor.div_(state.ring.world_size)
    # A CUDA bucket's future names its device, so DDP's wait also orders its own stream after it.
    fut: torch.futures.Future[torch.Tensor] = (torch.futures.Future(devices=[tensor.device]) if tensor.is_cuda
                                              else torch.futures.Future())
    state.submit(tensor, fut)
    return fut


