"""`gputravel bench codec`: encode and decode time of the travel path's messages, at the sizes a
travel gives them; medians per call over ``repeat`` samples.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import msgspec

from gputravel.bench.compare import stamp
from gputravel.crypto.channel import IV_BYTES, KEY_BYTES, ChannelState
from gputravel.crypto.labels import USER_LABELS, is_h2d
from gputravel.errors import BadInput
from gputravel.driver.context import CONTEXT_VERSION, DriverContext, SealedContext, pack_context
from gputravel.protocol import codec
from gputravel.protocol.push import CopyFromVram, CopyToVram, GrantWindow, Memset, RotateKeys, SemaphoreRelease
from gputravel.protocol.travel import ChunkInfo, ChunkPiece, HolderHello, TravelRequest, TravelResult

KIB = 1 << 10


def _channel(label: str) -> ChannelState:
    return ChannelState(label=label, key=os.urandom(KEY_BYTES), iv_mask=os.urandom(IV_BYTES),
                        channel_counter=3, message_counter=1 << 20)


def driver_context() -> DriverContext:
    """A context blob's body as the orchestrator exports it: the user channels only."""
    senders = tuple(_channel(label) for label in USER_LABELS if is_h2d(label))
    receivers = tuple(_channel(label) for label in USER_LABELS if not is_h2d(label))
    return DriverContext(version=CONTEXT_VERSION, layout="0" * 64, epoch=7, senders=senders,
                         receivers=receivers, semaphore=1 << 30, gpfifo_put=4096, work_token=1 << 31,
                         rpc_tx_seq=1 << 20, rpc_rx_seq=1 << 20)


def messages() -> dict[str, object]:
    blob = pack_context(driver_context())
    steps = {name: 1_000_000 for name in ("dh_import", "dh_copy", "dh_export", "o_switch", "handler")}
    return {
        "CopyToVram": CopyToVram(src_iova=1 << 32, nbytes=1 << 20, dst_offset=1 << 30, release=1 << 20, interrupt=True),
        "CopyFromVram": CopyFromVram(src_offset=1 << 30, nbytes=1 << 20, dst_iova=1 << 32, release=1 << 20,
                                     interrupt=False),
        "Memset": Memset(offset=1 << 30, nbytes=1 << 28, value=0, release=1 << 20, interrupt=True),
        "RotateKeys": RotateKeys(epoch=8, release=1 << 20, interrupt=True),
        "GrantWindow": GrantWindow(offset=1 << 30, nbytes=1 << 28, release=1 << 20, interrupt=True),
        "SemaphoreRelease": SemaphoreRelease(release=1 << 20, interrupt=True),
        "DriverContext": driver_context(),
        "SealedContext": codec.decode(blob, expect=SealedContext),
        "TravelRequest": TravelRequest(travel_id=42, buffer_offset=1 << 30, buffer_bytes=1 << 28,
                                       dataset_offset=1 << 33, context=blob),
        "TravelResult": TravelResult(travel_id=42, context=blob,
                                     chunk=ChunkInfo(dataset_offset=1 << 33, nbytes=1 << 28, digest=os.urandom(32)),
                                     steps_ns=steps, nonzero_on_arrival=0),
        "HolderHello": HolderHello(holder="alice", dataset_bytes=512 << 20, piece_bytes=1 << 20,
                                   manifest=tuple(os.urandom(32) for _ in range(512)), tokenizer="gpt2", schema="",
                                   train_records=0, eval_records=0, probed=True,
                                   log_key=os.urandom(32)),
        "ChunkPiece": ChunkPiece(travel_id=42, offset=1 << 20, data=os.urandom(256 * KIB)),
    }


def _median_us(call: Callable[[], object], number: int, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        for _ in range(number):
            call()
        samples.append((time.perf_counter_ns() - t0) / number / 1e3)
    return statistics.median(samples)


def _number(nbytes: int) -> int:
    # About the same bytes per sample for every message, so big ones do not dominate the run.
    return max(20, min(5000, (4 << 20) // max(nbytes, 1)))


#: The most samples per message: each is about 4 MiB coded, so this is minutes of a run.
MAX_REPEAT = 1000


def run(repeat: int = 15, on_row: Callable[[dict], None] | None = None) -> dict:
    """Median encode and decode time per message (microseconds), and its encoded size."""
    if isinstance(repeat, bool) or not isinstance(repeat, int) or not 1 <= repeat <= MAX_REPEAT:
        raise BadInput(f"--repeat must be between 1 (a median needs a sample) and {MAX_REPEAT}, got {repeat!r}")
    rows = []
    for name, msg in messages().items():
        data = codec.encode(msg)
        cls = type(msg)
        number = _number(len(data))
        assert codec.decode(data, expect=cls) == msg
        encode_us = _median_us(lambda msg=msg: codec.encode(msg), number, repeat)
        decode_us = _median_us(lambda data=data, cls=cls: codec.decode(data, expect=cls), number, repeat)
        row = {"message": name, "bytes": len(data), "encode_us": encode_us, "decode_us": decode_us,
               "round_trip_us": encode_us + decode_us}
        rows.append(row)
        if on_row:
            on_row(row)
    return {
        "codec": f"msgspec {msgspec.__version__}",
        **stamp(),
        "repeat": repeat,
        "rows": rows,
    }
