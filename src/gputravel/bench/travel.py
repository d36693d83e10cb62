"""`gputravel bench travel`: the paper's Table 1 for this system.

One cohort per buffer size (one holder whose dataset is exactly one buffer), a warm-up
travel, then ``repeat`` timed travels; medians per step. Two limits are measured in the same
run, so that copy throughput can be read against what this machine can do:

- ``crypto_limit_gbps``: one core doing both AES-256-GCM passes every byte needs (seal, then
  open), one after the other;
- ``pipeline_limit_gbps``: the copy's real limit. The holder seals and the device opens in two
  processes on two cores at once, so the copy can go no faster than the slower of the two
  passes measured while both run, each pass including what the copy must also move (the
  holder's read of its dataset; the device's read of the record out of the host-writable slot
  into its own memory and its write of the plaintext into VRAM). Definition and method:
  ``bench/pipeline.py``. Each row's ``copy_vs_pipeline_limit`` is the copy's share of it.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from gputravel.crypto.channel import KeyMaterial, Receiver, Sender
from gputravel.errors import BadInput
from gputravel.protocol.control import STEPS
from gputravel.cohort import capacity
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.local import Cohort
from gputravel.bench.paper import table_1_row
from gputravel.bench.pipeline import pipeline_limit
from gputravel.protocol.layout import Layout
from gputravel.protocol.hardware import EMULATED, hardware_profile

MIB = 1 << 20


def crypto_limit_gbps(total_bytes: int = 256 * MIB, record: int = MIB) -> float:
    """Rate at which one core does both AES-256-GCM passes every byte needs.

    Encrypt each 1 MiB record into a preallocated buffer, then decrypt into another, through
    the project's channel recipe: bytes / (encrypt time + decrypt time), in GB/s.
    """
    keys = KeyMaterial("bench", os.urandom(32), os.urandom(12))
    plain = bytearray(os.urandom(record))
    sealed = bytearray(record + 16)
    opened = bytearray(record)
    records = max(total_bytes // record, 1)
    tx = Sender(keys)
    t0 = time.perf_counter()
    for _ in range(records):
        tx.encrypt_into(plain, sealed)
    t_enc = time.perf_counter() - t0
    # Decrypting needs valid ciphertexts in stream order: replay one stream of 16 records
    # through a fresh receiver per batch (set-up outside the timed loop).
    stream = Sender(keys, channel_counter=2)
    blobs = [stream.encrypt(plain) for _ in range(min(records, 16))]
    t_dec, done = 0.0, 0
    while done < records:
        rx = Receiver(keys, channel_counter=2)
        batch = blobs[: records - done]
        t0 = time.perf_counter()
        for blob in batch:
            rx.decrypt_into(blob, opened)
        t_dec += time.perf_counter() - t0
        done += len(batch)
    return records * record / (t_enc + t_dec) / 1e9


def _dataset(directory: Path, size: int) -> str:
    path = directory / f"holder-{size // MIB}mib.bin"
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 16 * MIB)
            f.write(os.urandom(n))
            left -= n
    return str(path)


def run(sizes_mib: list[int], repeat: int, *, on_row: Callable[[dict], None] | None = None,
        workdir: str | None = None, hardware: str = EMULATED) -> dict:
    if not sizes_mib or any(s <= 0 or s > 4096 for s in sizes_mib):
        raise BadInput("sizes must be between 1 and 4096 MiB")
    if repeat < 1:
        raise BadInput("--repeat must be at least 1")
    profile = hardware_profile(hardware)  # BadInput for an unknown profile, before anything is measured
    check_sizes(sizes_mib)
    result = {
        "crypto_limit_gbps": crypto_limit_gbps(),
        **pipeline_limit(Layout().record_bytes, Layout().staging_slots),  # the cohorts' layout
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, {platform.python_implementation()} {platform.python_version()}",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "repeat": repeat,
        "rows": [],
        "hardware": profile.to_json(),
    }
    with tempfile.TemporaryDirectory(prefix="gputravel-bench-", dir=workdir) as tmp:
        for size in sizes_mib:
            row = {**_measure(Path(tmp), size, repeat, hardware), "paper": table_1_row(size)}  # Table 1, as printed
            row["copy_vs_pipeline_limit"] = row["copy_gbps"] / result["pipeline_limit_gbps"]
            result["rows"].append(row)
            if on_row:
                on_row(row)
            os.unlink(Path(tmp) / f"holder-{size}mib.bin")
    return result


def check_sizes(sizes_mib: list[int] | tuple[int, ...]) -> None:
    """BadInput naming --sizes if this machine cannot carry the largest size's cohort: one
    holder with a dataset of that size, and a buffer of that size in the GPU's VRAM."""
    size = max(sizes_mib)
    capacity.check(1, sysmem_bytes=Layout().sysmem_bytes, dataset_bytes=size * MIB,
                   vram_mib=size + capacity.VRAM_MARGIN_MIB, fix=f"use smaller --sizes than {size} MiB")


def _measure(tmp: Path, size_mib: int, repeat: int, hardware: str = EMULATED) -> dict:
    data = _dataset(tmp, size_mib * MIB)
    config = CohortConfig(holders=(HolderSpec("holder-1", data),), buffer_bytes=size_mib * MIB, hardware=hardware)
    with Cohort(config) as cohort:
        cohort.travel("holder-1", 0)  # warm-up: first-touch of staging slots and code paths
        reports = [cohort.travel("holder-1", 0) for _ in range(repeat)]
    steps = {name: statistics.median(r.steps_ms[name] for r in reports) for name in STEPS}
    total = statistics.median(r.total_ms for r in reports)
    fixed = statistics.median(r.total_ms - r.steps_ms["dh_copy"] - r.steps_ms["o_cleanup"] for r in reports)
    payload = reports[0].chunk.nbytes if reports[0].chunk else 0
    return {
        "size_mib": size_mib,
        "payload_bytes": payload,
        "total_ms": total,
        "steps_ms": steps,
        "fixed_ms": fixed,
        "copy_gbps": payload / (steps["dh_copy"] / 1e3) / 1e9 if steps["dh_copy"] else 0.0,
        "verified": all(r.chunk is not None for r in reports),
    }
