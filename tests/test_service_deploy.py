"""Issue 16, as docs/deploy.md tells it: five shells, one party each.

`gputravel cohort init`, then `gputravel serve host`, `serve gpu`, two `serve holder` and
`serve orchestrator`, each its own process started in its own way. The orchestrator trains a
few steps and exits 0; one holder is stopped with SIGTERM mid-run, started again, and rejoins
(a late join: it probes on the GPU the orchestrator lends it between travels). Nothing is
left running, and each party's private keys lie only in its own state directory, mode 0600.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import pytest

from gputravel.cohort import isolation
from gputravel.data.shakespeare import shakespeare_holders
from gputravel.orchestrator.audit import verify_log
from gputravel.service.config import load_service
from gputravel.service.init import init_cohort
from gputravel.service.status import cohort_status

pytestmark = pytest.mark.integration

GPUTRAVEL = [sys.executable, "-c", "import sys; from gputravel.cli.app import app; sys.exit(app())"]


class Shell:
    """One terminal: a `gputravel serve` in the foreground, its stderr kept."""

    def __init__(self, d: Path, role: str, config: str, tag: str) -> None:
        self.log = d / f"{tag}.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([*GPUTRAVEL, "serve", role, "--config", str(d / config)],
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)

    def events(self) -> list[dict]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    def said(self, event: str) -> int:
        return sum(1 for e in self.events() if e.get("event") == event)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def _until(cond, timeout: float, what: str, shells: list[Shell]) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        died = [s.log.name for s in shells if s.proc.poll() not in (None, 0)]
        if time.monotonic() > deadline or died:
            tails = "\n".join(f"--- {s.log.name}\n" + s.log.read_text(errors="replace")[-2500:] for s in shells)
            raise AssertionError(f"{'failed: ' + ', '.join(died) if died else 'timed out'} waiting for {what}\n{tails}")
        time.sleep(0.2)


def _status(d: Path) -> dict:
    try:
        return json.loads((d / "state" / "orchestrator" / "status.json").read_text())
    except (OSError, ValueError):
        return {}


@pytest.fixture
def where() -> Path:
    """As root the parties run under their own accounts, which must reach the cohort directory:
    pytest's own temporary directories are root's alone."""
    base = Path(tempfile.mkdtemp(prefix="gputravel-deploy-"))
    os.chmod(base, 0o711)
    yield base
    shutil.rmtree(base, ignore_errors=True)


#: A small job, so that many steps take seconds: a 2-layer, 64-wide GPT-2 on one thread, a
#: checkpoint every 5 steps (the job's defaults, train/job.py, are the demo's larger one).
SMALL_JOB = {"batch": 4, "warmup_steps": 2, "n_layer": 2, "n_head": 2, "n_embd": 64, "threads": 1,
             "checkpoint_every": 5, "sample_tokens": 0}


def _init(where: Path, south: str, steps: int) -> Path:
    """A cohort of two presses of the shipped Shakespeare (north: the tragedies) in `where`."""
    presses = shakespeare_holders()
    d = where / "cohort"
    init_cohort(d, [("north", str(presses["tragedies"])), ("south", str(presses[south]))],
                steps=steps, buffer_bytes=16 << 10, job=SMALL_JOB)
    return d


def _serve(where: Path, party: str, tag: str | None = None) -> Shell:
    """`gputravel serve ROLE --config cohort/PARTY.toml` in a shell of its own."""
    return Shell(where, party.split("-")[0], f"cohort/{party}.toml", tag or party.removeprefix("holder-"))


def test_five_shells_train_and_a_holder_leaves_and_rejoins(processes, where: Path) -> None:
    d = _init(where, "comedies", 1200)
    shells: list[Shell] = []
    try:
        north, south = _serve(where, "holder-north"), _serve(where, "holder-south")
        shells += [_serve(where, "host"), _serve(where, "gpu-0"), north, south]
        _until(lambda: north.said("up") and south.said("up"), 90, "both holders up", shells)
        orch = _serve(where, "orchestrator")
        shells.append(orch)
        _until(lambda: _status(d).get("step", 0) >= 20, 180, "training under way", shells)

        if os.geteuid() == 0:
            assert _vram_to_a_stranger(d) is False  # the GPU's link: only the orchestrator's uid gets VRAM
        assert south.stop() == 0  # SIGTERM: it leaves the cohort, then stops
        assert south.said("left") == 1, south.log.read_text()
        south_again = _serve(where, "holder-south", "south-again")
        shells.append(south_again)
        _until(lambda: south_again.said("joined") == 1, 120, "south to rejoin", shells)
        assert any(e.get("late") for e in south_again.events() if e.get("event") == "up")
        rejoined_at = next(e["ts"] for e in south_again.events() if e.get("event") == "joined")

        assert orch.proc.wait(timeout=300) == 0, orch.log.read_text()[-3000:]
        run_dir = d / "run-dir"
        assert (run_dir / "report.json").exists() and (run_dir / "checkpoint.pt").exists()
        assert _status(d)["phase"] == "done"
        # The signed travel log (published for the holders) shows travels to south after it rejoined.
        log = verify_log(d / "public" / "audit.log", (d / "public" / "orchestrator.pem").read_bytes(), "south")
        assert any(e.time > rejoined_at and e.event == "travel" for e in log.entries), log.entries
        assert log.closed  # the orchestrator signed the closing entry before it published job-done
        # `gputravel status` for a holder: the job as published, and its own travels from the signed log,
        # each chunk's MAC checked against its own data with its travel-log key (south's key survived its restart).
        seen = cohort_status(load_service(d / "holder-north.toml"))
        assert seen["phase"] == "done" and seen["members"] == ["north", "south"] and seen["my_travels"] > 0, seen
        assert seen["log_closed"] is True and seen["my_chunks"].startswith("all "), seen
        assert cohort_status(load_service(d / "holder-south.toml"))["my_chunks"].startswith("all ")
        assert "loss" not in seen  # the model's, not the holders'
    finally:
        codes = [s.stop() for s in reversed(shells)]
    assert all(c == 0 for c in codes), [(s.log.name, c, s.log.read_text()[-1500:])
                                        for s, c in zip(reversed(shells), codes, strict=True) if c != 0]
    _no_process_left(where)
    _keys_only_in_own_state(d)


def _no_process_left(root: Path) -> None:
    """No process still names this cohort on its command line."""
    left = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(root).encode() in cmd:
            left.append(pid)
    assert not left, f"processes left behind: {left}"


def _keys_only_in_own_state(d: Path) -> None:
    owners: dict[str, list[Path]] = {}
    for path in d.rglob("*"):
        if path.is_file() and b"PRIVATE KEY" in path.read_bytes():
            assert path.is_relative_to(d / "state"), f"a private key outside a state directory: {path}"
            assert path.stat().st_mode & 0o077 == 0, f"{path} is readable by others"
            owners.setdefault(path.relative_to(d / "state").parts[0], []).append(path)
    for party in ("orchestrator", "holder-north", "holder-south", "gpu-0"):
        assert owners.get(party), f"{party} made no key of its own"
        if os.geteuid() == 0:  # each party's own account owns the keys it made
            uid = tomllib.loads((d / f"{party}.toml").read_text())["uid"]
            made = owners[party]  # nothing of root's lies in a party's tree (the vendors' is in D/vendor, D/platform)
            assert made and all(k.stat().st_uid == uid for k in made), [(k, k.stat().st_uid, uid) for k in made]
    assert not list((d / "vendor").rglob("*.key")), "the GPU vendor's CA outlived its one use"
    assert not list((d / "platform").glob("*.key")), "the TEE root outlived its one use"
    assert owners.get("orchestrator-tdx"), "the TDX module keeps no quoting key of its own"
    if os.geteuid() == 0:
        tdx_uid = tomllib.loads((d / "orchestrator.toml").read_text())["tdx_uid"]
        assert all(k.stat().st_uid == tdx_uid for k in owners["orchestrator-tdx"])


def test_the_orchestrator_may_start_before_its_holders(processes, where: Path) -> None:
    """Any order: an orchestrator up first waits for the holders' certificates, then for their
    joins; holders that find the GPU's boot lock taken join late and probe on the lent GPU."""
    _init(where, "histories", 40)
    shells: list[Shell] = []
    try:
        shells += [_serve(where, "orchestrator"), _serve(where, "host"), _serve(where, "gpu-0")]
        orch = shells[0]
        _until(lambda: any("certificate" in e.get("waiting_for", "") for e in orch.events()), 60,
               "the orchestrator to wait for the holders", shells)
        shells += [_serve(where, f"holder-{n}") for n in ("north", "south")]
        assert orch.proc.wait(timeout=240) == 0, orch.log.read_text()[-3000:]
        for holder in shells[3:]:
            assert holder.said("joined") == 1
    finally:
        codes = [s.stop() for s in reversed(shells)]
    assert all(c == 0 for c in codes), codes
    _no_process_left(where)


_STRANGER = """
import os, socket, sys
from gputravel.protocol.device import VramGrant, VramRequest
from gputravel.transport.stream import StreamTransport
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
link = StreamTransport(s, "stranger")
try:
    link.send(VramRequest())
    got = link.recv(timeout=5)
    print("GRANTED" if isinstance(got.message, VramGrant) else "OTHER")
except Exception as exc:
    print("REFUSED", type(exc).__name__)
"""


def _vram_to_a_stranger(d: Path) -> bool:
    """Another account (nobody) asks the running GPU for VRAM on its link: True if it got it.
    (The control, the same ask under the orchestrator's uid, is tests/test_service_device.py's.)"""
    drop = isolation.dropper(65534, netns=None, reach=isolation.interpreter_reach())  # as a party is started
    out = subprocess.run([sys.executable, "-c", _STRANGER, str(d / "run" / "gpu-0.sock")], capture_output=True,
                         text=True, timeout=60, preexec_fn=drop)
    assert out.stdout.startswith(("GRANTED", "REFUSED", "OTHER")), out.stderr
    return out.stdout.startswith("GRANTED")


def test_a_restarted_orchestrator_resumes_and_its_holders_come_back(processes, where: Path) -> None:
    """The orchestrator is stopped mid-run and started again: it resumes from the run
    directory's checkpoint; the holders' CVMs end with the old cohort, and their services boot
    new ones that join the new orchestrator. The signed travel log continues across both."""
    d = _init(where, "comedies", 400)  # long enough that the stop at step 30 lands mid-run
    shells: list[Shell] = []
    try:
        shells += [_serve(where, "host"), _serve(where, "gpu-0")]
        holders = [_serve(where, f"holder-{n}") for n in ("north", "south")]
        shells += holders
        _until(lambda: all(h.said("up") for h in holders), 90, "both holders up", shells)
        first = _serve(where, "orchestrator")
        shells.append(first)
        _until(lambda: _status(d).get("step", 0) >= 30, 180, "training under way", shells)
        assert first.stop() == 0
        (stopped,) = [e for e in first.events() if e.get("event") == "stopped"]  # at a step, checkpointed there
        stopped_at = stopped["step"]
        assert _status(d)["phase"] == "stopped" and _status(d)["step"] == stopped_at
        _until(lambda: all(h.said("rejoining") for h in holders), 60, "the holders to boot again", shells)
        again = _serve(where, "orchestrator", "orchestrator-again")
        shells.append(again)
        assert again.proc.wait(timeout=300) == 0, again.log.read_text()[-3000:]
        steps = [e["step"] for e in again.events() if e.get("event") == "step"]
        # Resumed from exactly the step it stopped at (steps are logged every 5th).
        assert steps and stopped_at <= steps[0] < stopped_at + 5, (stopped_at, steps[:3])
        assert _status(d)["phase"] == "done"
        for h in holders:
            assert h.proc.wait(timeout=60) == 0 and h.said("joined") == 2
        # One log across both orchestrators, closed once, by the second, when the job was done.
        assert verify_log(d / "public" / "audit.log", (d / "public" / "orchestrator.pem").read_bytes()).closed
    finally:
        codes = [s.stop() for s in reversed(shells)]
    assert all(c == 0 for c in codes), codes
    _no_process_left(where)
