"""A real Flower deployment on the shaped links, tiny: two holders, two rounds, a one-layer
GPT-2. It checks the FedAvg row (rounds, bytes counted on both directions of both links,
Flower's version) and that nothing is left behind, after a run and after a SIGTERM mid-run.
No timing assertions: numbers live in benchmarks (`gputravel bench train --methods ...,fl`)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gputravel.bench.train import TrainBenchConfig, bench_train_config, run
from gputravel.fl.config import FedAvgConfig
from gputravel.net import netns_available
from gputravel.net.iproute import run_iproute

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300),  # Flower starts a process per holder per round
              pytest.mark.skipif(not netns_available()[0], reason=f"no shaped links here: {netns_available()[1]}")]

TINY = dict(n_layer=1, n_embd=32, n_head=2, batch=4, seq_len=32, warmup_steps=2, threads=1)


def tiny_config(tmp_path: Path, **fl) -> TrainBenchConfig:
    train = bench_train_config(steps=8, buffer_bytes=64 << 10).replace(**TINY)
    return TrainBenchConfig((100.0,), train=train, holders=2, link="netns", methods=("fl",),
                            fl=FedAvgConfig(rounds=2, **fl), eval_batches=1, workdir=str(tmp_path))


def flower_processes(root: Path) -> list[int]:
    """Processes started for a deployment under ``root``: each has its FLWR_HOME there."""
    mark = b"FLWR_HOME=" + str(root).encode()
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and mark in (d / "environ").read_bytes():
                found.append(int(d.name))
        except OSError:
            continue
    return found


def namespaces_of(pid: int) -> list[str]:
    names = run_iproute(["ip", "netns", "list"]).stdout.split()
    return [n for n in names if n.startswith(f"gt-{pid:x}-")]


def test_a_tiny_flower_deployment_trains_over_the_links_and_leaves_nothing(processes, tmp_path: Path) -> None:
    result = run(tiny_config(tmp_path))
    (row,) = result["rows"]
    assert row["method"] == "fl" and row["bandwidth_mbit"] == 100.0
    assert row["rounds"] == 2 and row["framework"].startswith("flwr 1.42")
    assert row["bytes_over_link"] > 0
    for name, moved in row["bytes_by_holder"].items():  # both ways, on every holder's link
        assert moved["up"] > 0 and moved["down"] > 0, name
    assert row["holder_compute_s"] > 0 and row["tx_s"] > 0 and math.isfinite(row["final_loss"])
    assert result["fl_plan"] == {"rounds": 2, "local_steps": 2, "clients_per_round": 2, "holders": ["holder-1", "holder-2"],
                                 "fraction": 1.0, "total_steps": 8}
    assert [sorted(r["replied"]) for r in row["fl"]["round_log"]] == [["holder-1", "holder-2"]] * 2
    assert flower_processes(tmp_path) == [] and namespaces_of(os.getpid()) == []
    assert list(tmp_path.iterdir()) == []  # the benchmark's directory is gone too


SCRIPT = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_fl_deploy import tiny_config
from gputravel.bench.train import run
run(tiny_config(Path({tmp!r})))
"""


def test_sigterm_mid_round_takes_every_flower_process_and_namespace_down(processes, tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", SCRIPT.format(tests=str(Path(__file__).parent), tmp=str(tmp_path))],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not any(tmp_path.rglob("progress/holder-*-round-1")):  # a holder is training
            assert child.poll() is None, child.stdout.read().decode()
            assert time.monotonic() < deadline, "the deployment never reached its first round"
            time.sleep(0.2)
        assert flower_processes(tmp_path)
        child.send_signal(signal.SIGTERM)
        out = child.communicate(timeout=60)[0].decode()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert "stopped by SIGTERM" in out  # taken down by its own handler, not killed outright
    assert flower_processes(tmp_path) == [] and namespaces_of(child.pid) == []
