"""The shipped example runs (a port of a nanoGPT loop to the TravellingLoader)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "port_nanogpt.py"


def test_port_nanogpt_runs_and_reports_losses(processes):
    out = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "2", "--batch", "2", "--seq-len", "16"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("iter ")]
    assert [line.split(":")[0] for line in lines] == ["iter 0", "iter 1"]
    assert all(float(line.rsplit(" ", 1)[1]) > 0 for line in lines)
