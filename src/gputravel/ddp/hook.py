"""The encrypted ring as a DDP communication hook::

    group = dist.new_group(backend="gloo")  # the ring's own, out of DDP's way
    keys = establish_pair_keys(attest, verify, group=group, context=b"job 42/ranks 0-3/" + shared_nonce)
    model.register_comm_hook(RingHookState(Ring("pipelined", keys=keys, group=group)), encrypted_allreduce_hook)

It averages, as DDP's default hook does; with `compress` ("fp16" or "bf16", off by default: it
changes the numerics) it seals and sends the averaged bucket in that type, as PyTorch's
fp16_compress_hook does, halving the bytes sealed and on the wire; the sum is then in that type
too, in the ring's fixed order, so two runs with the same option give the same bits.
With `overlap` the ring runs on one worker thread while
backward computes the next buckets. A failed all-reduce fails the bucket's future with its typed
error (kept in `state.failure`), so the step stops. A CUDA bucket is staged through pinned host
memory, as CC-mode GPUs exchange through the CPU (a path not run here: no GPU was at hand).
"""

# No `from __future__ import annotations`: register_comm_hook compares the hook's annotations as objects.

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from gputravel.ddp.ring import Ring
from gputravel.errors import BadInput, ChannelFaulted

__all__ = ["COMPRESS", "RingHookState", "compress_dtype", "encrypted_allreduce_hook", "host_copy", "stage", "unstage"]

#: The types a bucket may be compressed to before sealing (`compress`); None: as it is.
COMPRESS = {"fp16": torch.float16, "bf16": torch.bfloat16}


def compress_dtype(compress: str | None) -> torch.dtype | None:
    """The type `compress` names (None for none); BadInput for another name."""
    if compress is None:
        return None
    if compress not in COMPRESS:
        raise BadInput(f"compress must be one of {', '.join(COMPRESS)} or none (got {compress!r})")
    return COMPRESS[compress]


class RingHookState:
    """What the hook needs: the ring (its variant, keys and record size) and its worker."""

    def __init__(self, ring: Ring, *, overlap: bool = True, compress: str | None = None) -> None:
        self.ring, self.overlap, self.compress = ring, overlap, compress
        self._dtype = compress_dtype(compress)
        self.failure: BaseException | None = None  # the first error that stopped a step
        self._worker: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"RingHookState(ring={self.ring!r}, overlap={self.overlap}, compress={self.compress!r})"

    def submit(self, bucket: torch.Tensor, fut: "torch.futures.Future[torch.Tensor]") -> None:
        # Staged on the caller's thread, complete on return: the worker never reads a buffer mid-copy.
        try:
            # Compressed where the bucket is (a GPU copies half the bytes out); a new tensor, never the bucket.
            host = stage(bucket if self._dtype is None or bucket.dtype == self._dtype else bucket.to(self._dtype))
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
            # Inside the try: completing a CUDA future can raise, and DDP would wait for ever.
            fut.set_result(bucket)
        except Exception as err:  # the step must stop: DDP's backward re-raises it
            self._fail(fut, err)

    def _fail(self, fut: "torch.futures.Future[torch.Tensor]", err: Exception) -> None:
        if self.failure is None:
            self.failure = err
        fut.set_exception(err)

    def close(self) -> None:
        """Stop the worker after the buckets it has; later buckets fail. Under the lock throughout,
        so no second worker starts while the first drains."""
        with self._lock:
            self._closed = True
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None


def stage(bucket: torch.Tensor) -> torch.Tensor:
    """The CPU tensor the ring reduces for `bucket`: itself on the CPU, else a `host_copy`."""
    return bucket if bucket.device.type == "cpu" else host_copy(bucket)


def host_copy(bucket: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of `bucket`, complete on return (pinned for CUDA: one DMA copy)."""
    host = torch.empty(bucket.shape, dtype=bucket.dtype, device="cpu", pin_memory=bucket.is_cuda)
    host.copy_(bucket)  # blocking (non_blocking=False): the device->host copy has landed on return
    return host


def unstage(bucket: torch.Tensor, host: torch.Tensor) -> None:
    """Put the ring's sum back into `bucket`, complete on return (DDP reads it once the future is set)."""
    if host is bucket:
        return
    bucket.copy_(host)  # and back to the bucket's type, where the ring reduced a compressed copy
    if bucket.is_cuda:
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
