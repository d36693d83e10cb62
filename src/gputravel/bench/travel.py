"""`gputravel bench travel`: the paper's Table 1 for this system, read against two limits of this
machine: one core's AES-GCM (``crypto_limit_gbps``) and the two-core copy pipeline (bench/pipeline.py).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

from gputravel.crypto.channel import KeyMaterial, Receiver, Sender
from gputravel.errors import BadInput
from gputravel.protocol.control import STEPS
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.local import Cohort
from gputravel.bench.compare import check_sizes, dataset, stamp
from gputravel.bench.paper import table_1_row
from gputravel.bench.pipeline import pipeline_limit
from gputravel.protocol.layout import Layout
from gputravel.protocol.hardware import EMULATED, hardware_profile

MIB = 1 << 20


def crypto_limit_gbps(total_bytes: int = 256 * MIB, record: int = MIB) -> float:
    """GB/s of one core sealing then opening 1 MiB records with the channel's recipe."""
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


def run(sizes_mib: list[int], repeat: int, *, on_row: Callable[[dict], None] | None = None,
        workdir: str | None = None, hardware: str = EMULATED) -> dict:
    if repeat < 1:
        raise BadInput("--repeat must be at least 1")
    profile = hardware_profile(hardware)  # BadInput for an unknown profile, before anything is measured
    check_sizes(sizes_mib)
    result = {
        "crypto_limit_gbps": crypto_limit_gbps(),
        **pipeline_limit(Layout().record_bytes, Layout().staging_slots),  # the cohorts' layout
        **stamp(),
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


def _measure(tmp: Path, size_mib: int, repeat: int, hardware: str = EMULATED) -> dict:
    data = dataset(tmp, size_mib)
    config = CohortConfig(holders=(HolderSpec("holder-1", data),), buffer_bytes=size_mib * MIB, hardware=hardware)
    with Cohort(config) as cohort:
        cohort.travel("holder-1", 0)  # warm-up: first-touch of staging slots and code paths
        reports = [cohort.travel("holder-1", 0) for _ in range(repeat)]
    steps = {name: statistics.median(r.steps_ms[name] for r in reports) for name in STEPS}
    total = statistics.median(r.total_ms for r in reports)
    fixed = statistics.median(r.total_ms - r.steps_ms["dh_copy"] - r.steps_ms["o_cleanup"] for r in reports)
    payload = reports[0].chunk.nbytes if reports[0].chunk else 0
    return {"size_mib": size_mib, "payload_bytes": payload, "total_ms": total, "steps_ms": steps, "fixed_ms": fixed,
            "copy_gbps": payload / (steps["dh_copy"] / 1e3) / 1e9 if steps["dh_copy"] else 0.0,
            "verified": all(r.chunk is not None for r in reports)}
