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

A failed all-reduce (a tampered, replayed or dropped record, a peer gone) completes the
bucket's future with the typed error, so DDP's backward raises and the step stops. DDP raises
it as a RuntimeError that quotes the error's message; the typed error itself is kept in
`state.failure`, for the training loop to re-raise.
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket and Future[Tensor] as objects, not strings.

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from gputravel.ddp.ring import Ring
from gputravel.errors import ChannelFaulted

__all__ = ["RingHookState", "encrypted_allreduce_hook"]


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
        if not self.overlap:
            self._reduce_into(bucket, fut)
            return
        with self._lock:
            if self._closed:
                fut.set_exception(ChannelFaulted("the hook's ring was closed"))
                return
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddp-ring")
            self._worker.submit(self._reduce_into, bucket, fut)

    def _reduce_into(self, tensor: torch.Tensor, fut: "torch.futures.Future[torch.Tensor]") -> None:
        try:
            self.ring.all_reduce(tensor)
        except Exception as err:  # the step must stop: DDP's backward re-raises it
            if self.failure is None:
                self.failure = err
            fut.set_exception(err)
            return
        fut.set_result(tensor)

    def close(self) -> None:
        """Stop the worker thread (after the buckets already handed to it); later buckets fail.
        Held under the lock throughout, so no second worker can start while the first drains."""
        with self._lock:
            self._closed = True
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None


def encrypted_allreduce_hook(state: RingHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average `bucket` over the ring; the future holds the averaged buffer."""
    tensor = bucket.buffer()
    # Divide first, as DDP's default hook does (keeps fp16 from overflowing in the sum).
    tensor.div_(state.ring.world_size)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    state.submit(tensor, fut)
    return fut


