"""An all-gather record opened in place (issue 31): a forged one leaves no unverified byte in the
tensor, the records before it stand as summed, and the all-reduce fails with a typed error."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from test_ddp_ring import Wire, _input, _keys  # tests/test_ddp_ring.py

from gputravel.ddp import Ring, TorchPointToPoint
from gputravel.errors import IntegrityError

# 2 ranks of 60 000 float32: segments of 30 000, records of 10 000 (40 000 bytes), 3 a hop.
N, RECORD = 60_000, 40_000


def forged_last(rank: int, world: int, variant: str) -> dict:
    x = _input(rank, N)
    total = x.clone()
    dist.all_reduce(total)  # gloo's sum, to compare the records that did arrive
    # Rank 0's last send, record 2 of the all-gather hop: rank 1 opens it into x[50 000:60 000].
    wire = Wire(TorchPointToPoint(), "tamper" if rank == 0 else None, at=5)
    ring = Ring(variant, keys=_keys(), record_bytes=RECORD, p2p=wire, timeout_s=5)
    try:
        ring.all_reduce(x)
        seen = "completed"
    except IntegrityError as err:
        seen = f"IntegrityError: {err}"
    dist.barrier()
    return {"seen": seen, "forged_zero": bool((x[50_000:] == 0).all()),
            "opened_kept": bool(torch.allclose(x[30_000:50_000], total[30_000:50_000], atol=1e-5))}


@pytest.mark.parametrize("variant", ["naive", "pipelined"])
def test_a_forged_all_gather_record_opened_in_place_leaves_zeros_and_a_typed_error(run_ranks, variant: str) -> None:
    sender, receiver = run_ranks(forged_last, 2, variant, timeout=60)
    assert sender["seen"] == "completed"
    assert receiver["seen"].startswith("IntegrityError") and "hop 1, segment 1, record 2)" in receiver["seen"]
    assert receiver["forged_zero"] and receiver["opened_kept"], receiver
