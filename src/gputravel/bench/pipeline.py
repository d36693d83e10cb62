"""The two-core pipeline limit of the copy: ``pipeline_limit_gbps`` in `gputravel bench travel`.

The copy (docs/architecture.md, "The pipelined copy") is a pipeline of two passes on two cores:
the holder *seals* record k (AES-256-GCM, straight from its dataset mapping into a staging slot
of its shared memory) while the device *opens* an earlier record (reads it out of the slot into
its own memory, checks the tag and decrypts it into a private scratch buffer, then writes the
plaintext into VRAM). A pipeline runs no faster than its slower pass, and the two passes share
the machine while they run (memory bandwidth, caches, the hypervisor), so the limit is

    pipeline_limit_gbps = min(seal rate, open rate), both measured while both run.

Each rate includes what the copy path must move besides the crypto, exactly as the copy moves
it: the sealer reads a source as large as the copy and writes the slot; the opener reads the
record out of the slot into its own memory, a piece at a time, and opens those copies (the
device's one read of host-writable bytes: ``device.memory.open_record``, the very function the
device runs), then copies the plaintext into a populated VRAM-sized buffer. What the limit leaves out is the copy's protocol: the pushes, the
semaphores, the doorbell and the interrupts, the waits for a free slot. That is what the copy
is judged on when it is read against this limit.

How: two processes (``python -m gputravel.bench.pipeline sealer|opener``) map one memfd that
holds a ring of staging slots in the copy's record size and slot count, and pass
``total_bytes`` of records through it, as the copy does: the sealer seals record k into slot
k % S once the opener is done with record k - S, the opener opens record k once it is sealed.
Two counters in the memfd are the whole protocol (each side polls the other's, yielding the
CPU, as the driver and the device poll), so the passes run concurrently and are coupled as
in the copy: the faster one waits, and neither runs flat out against the other's memory
traffic more than the copy lets it. Each process times its pass's work (its waits left out):
``seal_gbps`` and ``open_gbps``, and the limit is the slower. ``lockstep_gbps`` is what the
pair moved end to end: the copy with a protocol that costs nothing but the hand-offs.
``rounds`` runs; the limit reported is the median round's.

The limit assumes each pass keeps to its own core, as the copy does. ``balanced_gbps``
(``2 / (1/seal + 1/open)``: both passes' work spread evenly over the two cores) is the
ceiling for a copy that ran part of the device's pass on the holder's idle core; a second
device thread that did so measured slower on this 2-vCPU machine, so the copy does not.
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
    """Measure the limit ``rounds`` times; the median round's figures, and every round's."""
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
            procs = [children.start(role, [sys.executable, "-m", "gputravel.bench.pipeline", role, str(fd),
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


# ----------------------------------------------------------------------------- the two processes
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
    sealer = role == "sealer"
    step = _sealer(keys, memoryview(big), ring, record) if sealer else _opener(keys, memoryview(big), ring, record)
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


def _sealer(keys: KeyMaterial, dataset: memoryview, ring: list[memoryview], record: int):
    sender, slots = Sender(keys), len(ring)

    def step(k: int) -> None:
        sender.encrypt_into(dataset[k * record : (k + 1) * record], ring[k % slots])
    return step


def _opener(keys: KeyMaterial, vram: memoryview, ring: list[memoryview], record: int):
    receiver, slots = Receiver(keys), len(ring)
    piece, scratch = bytearray(min(PIECE_BYTES, record)), bytearray(record)

    def step(k: int) -> None:
        vram[k * record : (k + 1) * record] = open_record(receiver, ring[k % slots], piece, scratch)
    return step


if __name__ == "__main__":
    _role, _fd, _record, _slots, _total = sys.argv[1:6]
    if _role not in _ROLES:
        raise SystemExit(f"usage: python -m gputravel.bench.pipeline {'|'.join(_ROLES)} FD RECORD SLOTS TOTAL")
    _child(_role, int(_fd), int(_record), int(_slots), int(_total))
