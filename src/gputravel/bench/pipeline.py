"""The two-core pipeline limit of the copy: ``pipeline_limit_gbps`` in `gputravel bench travel`.

The holder seals and the device opens (``device.memory.open_record``, the device's own code) in
two processes on two cores, coupled through a ring of staging slots in one memfd as the copy is,
so the copy can go no faster than the slower pass measured while both run. The protocol (pushes,
semaphores, doorbell) is left out: that is what the copy is judged on. docs/benchmarks.md has the method.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time

from gputravel.processes import Children
from gputravel.crypto.channel import IV_BYTES, KEY_BYTES, TAG_BYTES, KeyMaterial, Receiver, Sender
from gputravel.device.memory import PIECE_BYTES, open_record
from gputravel.errors import BadInput, GputravelError

MIB = 1 << 20
# The memfd: u64 records sealed, u64 records opened, then the bench key and IV mask (a key made
# for this run only); the ring of slots from _HEADER on.
_KEY_AT = 64
_HEADER = 4096
_ROLES = ("sealer", "opener")


def pipeline_limit(record_bytes: int, slots: int, total_bytes: int = 256 * MIB, rounds: int = 3,
                   timeout: float = 120.0) -> dict:
    """The median round's figures of ``rounds``, and every round's."""
    if record_bytes <= 0 or slots < 2 or total_bytes < record_bytes * slots or rounds < 1:
        raise BadInput("the pipeline limit needs a record size, at least 2 slots, a total of at least "
                       "one ring of records, and at least one round")
    runs = [_round(record_bytes, slots, total_bytes, timeout) for _ in range(rounds)]
    median = sorted(runs, key=lambda r: r["limit_gbps"])[(len(runs) - 1) // 2]
    return {"pipeline_limit_gbps": median["limit_gbps"],
            "pipeline": {**{k: v for k, v in median.items() if k != "limit_gbps"},
                         "record_bytes": record_bytes, "slots": slots, "total_bytes": total_bytes,
                         "rounds": runs, "spread_gbps": [min(r["limit_gbps"] for r in runs),
                                                         max(r["limit_gbps"] for r in runs)]}}


def _round(record_bytes: int, slots: int, total_bytes: int, timeout: float) -> dict:
    fd = os.memfd_create("gputravel-bench-pipeline", os.MFD_CLOEXEC)
    try:
        with Children(0.0) as children:  # done or failed: a helper still running is no use
            os.ftruncate(fd, _HEADER + slots * (record_bytes + TAG_BYTES))
            os.pwrite(fd, os.urandom(KEY_BYTES + IV_BYTES), _KEY_AT)
            procs = [children.start(role, [sys.executable, "-P", "-m", "gputravel.bench.pipeline", role, str(fd),
                                           str(record_bytes), str(slots), str(total_bytes)],
                                    pass_fds=(fd,), stdin=subprocess.PIPE, stdout=subprocess.PIPE) for role in _ROLES]
            for proc in procs:  # both set up (buffers populated) before either starts
                if proc.stdout.readline().strip() != b"ready":
                    raise GputravelError("a pipeline-limit process failed to start")
            for proc in procs:
                proc.stdin.write(b"go\n")
                proc.stdin.flush()
            out = {}
            for role, proc in zip(_ROLES, procs, strict=True):
                text, _ = proc.communicate(timeout=timeout)
                if proc.returncode != 0:
                    raise GputravelError(f"the pipeline-limit {role} failed (exit {proc.returncode})")
                out[role] = json.loads(text)
    finally:
        os.close(fd)
    seal, opened = out["sealer"]["gbps"], out["opener"]["gbps"]
    return {"limit_gbps": min(seal, opened), "seal_gbps": seal, "open_gbps": opened,
            "lockstep_gbps": out["opener"]["end_to_end_gbps"],
            # both passes' work spread evenly over the two cores: the ceiling of any split
            "balanced_gbps": 2 / (1 / seal + 1 / opened)}


def _child(role: str, fd: int, record: int, slots: int, total: int) -> None:
    shm = mmap.mmap(fd, _HEADER + slots * (record + TAG_BYTES), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    counters = memoryview(shm)[:16].cast("Q")  # [records sealed, records opened]
    secret = shm[_KEY_AT : _KEY_AT + KEY_BYTES + IV_BYTES]
    keys = KeyMaterial("bench-pipeline", secret[:KEY_BYTES], secret[KEY_BYTES:])
    ring = [memoryview(shm)[_HEADER + j * (record + TAG_BYTES) :][: record + TAG_BYTES] for j in range(slots)]
    big = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_POPULATE)  # the dataset, or VRAM
    block = os.urandom(MIB)
    for off in range(0, total, MIB):  # touched and written, as a dataset and a used VRAM are
        big[off : off + MIB] = block[: min(MIB, total - off)]
    sealer, data = role == "sealer", memoryview(big)
    if sealer:
        sender = Sender(keys)

        def step(k: int) -> None:
            sender.encrypt_into(data[k * record : (k + 1) * record], ring[k % slots])
    else:
        receiver, piece, scratch = Receiver(keys), bytearray(min(PIECE_BYTES, record)), bytearray(record)

        def step(k: int) -> None:
            data[k * record : (k + 1) * record] = open_record(receiver, ring[k % slots], piece, scratch)
    records = total // record
    # The sealer may seal record k once record k - slots is opened; the opener opens k once sealed.
    ready = (lambda k: k - counters[1] < slots) if sealer else (lambda k: counters[0] > k)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.readline()
    busy, t0 = 0.0, time.perf_counter()
    for k in range(records):
        while not ready(k):
            os.sched_yield()
        started = time.perf_counter()
        step(k)
        busy += time.perf_counter() - started
        counters[0 if sealer else 1] = k + 1
    moved = records * record
    json.dump({"gbps": moved / busy / 1e9, "end_to_end_gbps": moved / (time.perf_counter() - t0) / 1e9}, sys.stdout)


if __name__ == "__main__":
    _role, _fd, _record, _slots, _total = sys.argv[1:6]
    if _role not in _ROLES:
        raise SystemExit(f"usage: python -m gputravel.bench.pipeline {'|'.join(_ROLES)} FD RECORD SLOTS TOTAL")
    _child(_role, int(_fd), int(_record), int(_slots), int(_total))
