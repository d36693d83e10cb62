"""The demo's cohort started the way a consortium deploys one (issue 16): `cohort init` into a
directory of its own, then each party's own service (`gputravel serve ROLE --config FILE`) as
a child process of this launcher, which owns them from start to end and leaves none behind.

    with ServiceLaunch(holders, job, run_dir) as cohort:
        report = cohort.train(on_step)

What the demo keeps, and how:
- **The run directory.** The orchestrator's service writes its own (`[job] run_dir`, its
  account's). It is filled from the user's run directory first (a checkpoint to resume, the
  metrics so far) and copied back at the end, whatever the end: a crashed run leaves its
  checkpoint where `--resume` looks for it. The signed travel log and the certificate that
  verifies it are copied beside it.
- **The live view.** Every step's row of the service's `metrics.csv` becomes a StepEvent.
- **Data.** Each holder's service reads its data by path, under its own account: data other
  accounts cannot reach is copied into the cohort directory first, into a directory that is
  that holder's account's alone (0700).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gputravel.cohort import isolation
from gputravel.errors import PeerTimeout, RemoteError
from gputravel.service.init import init_cohort

__all__ = ["ServiceLaunch", "StepRow"]

SERVE = ("-c", "import sys; from gputravel.cli.app import app; sys.exit(app())", "serve")
BOOT_TIMEOUT_S = 120.0  # every service up, the orchestrator's holders joined
STOP_GRACE_S = 20.0  # a stopping service finishes its step or its goodbye within this
POLL_S = 0.05
MAX_METRICS_BYTES = 64 << 20  # a metrics.csv of far more steps than any run: the rest is not read
# A step's row in metrics.csv (train/loop.StepEvent): the type of each column.
STEP_COLUMNS: Mapping[str, type] = {"step": int, "loss": float, "tokens_per_s": float, "holder": str, "travels": int,
                                    "stall_share": float, "elapsed_s": float}

StepRow = dict  # one metrics.csv row, typed by STEP_COLUMNS


@dataclass
class _Service:
    party: str
    proc: subprocess.Popen
    log: Path


class ServiceLaunch:
    """One local cohort of services, one GPU. Use as a context manager."""

    def __init__(self, holders: Sequence[tuple[str, str]], job: Mapping[str, object], run_dir: Path, *,
                 audit_log: Path, certificate: Path, hardware: str = "emulated", resume: bool = False,
                 workdir: str | None = None) -> None:
        self.holders, self.job, self.run_dir, self.resume = list(holders), dict(job), Path(run_dir), resume
        self.audit_log, self.certificate, self.hardware, self.workdir = audit_log, certificate, hardware, workdir
        self.dir: Path | None = None
        self.services: list[_Service] = []

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> ServiceLaunch:
        with contextlib.ExitStack() as undo:  # a start that fails stops what it started
            undo.callback(self.close)
            self.start()
            undo.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def cohort(self) -> Path:
        assert self.dir is not None
        return self.dir / "cohort"

    @property
    def service_run_dir(self) -> Path:
        return Path(self._config("orchestrator")["job"]["run_dir"])

    def start(self) -> None:
        """Init, stage the data and the run directory in, start host, GPU and holders (each
        probes the GPU in turn: paper 4.1, the boot lock keeps the order), then the orchestrator."""
        self.dir = Path(tempfile.mkdtemp(prefix="gputravel-services-", dir=self.workdir))
        if isolation.decide(None)[0]:
            os.chmod(self.dir, 0o711)  # each party's account reaches its own files by path
        holders = [(name, self._reachable(name, path)) for name, path in self.holders]
        init_cohort(self.cohort, holders, job=self.job, hardware=self.hardware)
        self._hand_copies()
        self._stage_in()
        self._serve("host")
        self._serve("gpu-0")
        for name, _ in holders:
            self._serve(f"holder-{name}")
            self._await(f"holder-{name}", "up")  # one at a time: each probes the GPU at boot
        self._serve("orchestrator")

    def close(self) -> None:
        """Stop every service (the orchestrator first: it checkpoints where it is), copy the
        run directory back, delete the cohort directory. Never raises."""
        for service in reversed(self.services):
            _stop(service.proc)
        try:
            if self.dir is not None and (self.cohort / "orchestrator.toml").exists():
                self._stage_out()
        finally:
            if self.dir is not None:
                shutil.rmtree(self.dir, ignore_errors=True)
            self.dir, self.services = None, []

    # ------------------------------------------------------------------ the job
    def train(self, on_step: Callable[[StepRow], None] | None = None, timeout: float = 24 * 3600.0) -> dict:
        """Wait for the orchestrator's service to train and exit; each step as it is logged goes
        to `on_step`. Its report, or the reason it stopped (its log's last lines)."""
        orchestrator, seen = self._service("orchestrator"), -1
        deadline = time.monotonic() + timeout
        while orchestrator.proc.poll() is None:
            seen = self._relay(seen, on_step)
            self._check_alive()
            if time.monotonic() > deadline:
                raise PeerTimeout(f"the orchestrator's service did not finish in {timeout:.0f} s")
            time.sleep(POLL_S)
        self._relay(seen, on_step)
        report = self.service_run_dir / "report.json"
        if orchestrator.proc.returncode != 0 or not report.is_file():
            raise RemoteError(f"the orchestrator's service stopped (exit {orchestrator.proc.returncode})"
                              f"{_tail(orchestrator.log)}")
        return json.loads(report.read_text())

    def isolation(self) -> dict:
        """What kept the parties apart, as the report gives it: each party's account."""
        uids = {p: self._config(p).get("uid", -1) for p in self._parties()}
        on = all(u >= 0 for u in uids.values())
        return {"on": on, "reason": "" if on else "not root: every party runs as the launcher's user",
                "parties": {p: {"uid": u, "dumpable": False} for p, u in uids.items()}}

    # ------------------------------------------------------------------ services
    def _serve(self, party: str) -> None:
        assert self.dir is not None
        log = self.dir / "logs" / f"{party}.log"
        log.parent.mkdir(exist_ok=True)
        role = party.split("-")[0]
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, *SERVE, role, "--config", str(self.cohort / f"{party}.toml")],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        self.services.append(_Service(party, proc, log))

    def _service(self, party: str) -> _Service:
        return next(s for s in self.services if s.party == party)

    def _await(self, party: str, event: str) -> None:
        service, deadline = self._service(party), time.monotonic() + BOOT_TIMEOUT_S
        while f'"event": "{event}"' not in service.log.read_text(errors="replace"):
            self._check_alive()
            if time.monotonic() > deadline:
                raise PeerTimeout(f"{party}'s service was not {event} in {BOOT_TIMEOUT_S:.0f} s{_tail(service.log)}")
            time.sleep(POLL_S)

    def _check_alive(self) -> None:
        """A service that fails before the orchestrator's ends is a failure of the run: name it.
        (A holder's ends by itself, exit 0, once the orchestrator published the job done.)"""
        for s in self.services:
            if s.party != "orchestrator" and s.proc.poll() not in (None, 0):
                raise RemoteError(f"{s.party}'s service stopped (exit {s.proc.returncode}){_tail(s.log)}")

    def _relay(self, seen: int, on_step: Callable[[StepRow], None] | None) -> int:
        """Every metrics.csv row after step `seen`, in order; the last step relayed."""
        try:
            text = _read_regular(self.service_run_dir / "metrics.csv", MAX_METRICS_BYTES).decode(errors="replace")
        except OSError:
            return seen
        complete = text[: text.rfind("\n") + 1]  # a row being written is read next time
        for row in csv.DictReader(io.StringIO(complete)):
            try:
                typed = {k: cast(row[k]) for k, cast in STEP_COLUMNS.items()}
            except (KeyError, TypeError, ValueError):
                continue
            if typed["step"] > seen:
                seen = typed["step"]
                if on_step is not None:
                    on_step(typed)
        return seen

    # ------------------------------------------------------------------ files
    def _config(self, party: str) -> dict:
        return tomllib.loads((self.cohort / f"{party}.toml").read_text())

    def _parties(self) -> list[str]:
        return sorted(p.stem for p in self.cohort.glob("*.toml"))

    def _reachable(self, name: str, path: str) -> str:
        """`path`, or a copy other accounts can read when they cannot (a checkout in a closed
        home, say): a holder's service reads its data by path, under its own account."""
        src = Path(path).resolve()
        if not isolation.decide(None)[0] or (isolation.unreachable(src) is None and
                                              isolation.readable_by_others(src) is None):
            return str(src)
        assert self.dir is not None
        dest = self.dir / "data" / name / src.name
        dest.parent.mkdir(parents=True)
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, dest)
        for p in [dest.parent, dest, *(dest.rglob("*") if dest.is_dir() else ())]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        return str(dest)

    def _hand_copies(self) -> None:
        """A copied dataset is its holder's alone: its account's, closed to every other party."""
        data = self.dir / "data" if self.dir is not None else None
        if data is None or not data.is_dir():
            return
        os.chmod(data, 0o711)  # searchable, not listable
        for copy in data.iterdir():
            uid = self._config(f"holder-{copy.name}").get("uid", -1)
            if uid >= 0:
                isolation.give(copy, uid, 0o700)

    def _stage_in(self) -> None:
        """The user's run directory into the service's, before it starts: its metrics, and its
        checkpoint when resuming (the service resumes whenever it finds one). Never an old
        report, which could be taken for this run's."""
        inside = self.service_run_dir
        inside.mkdir(parents=True, exist_ok=True)
        skip = {"report.json"} | (set() if self.resume else {"checkpoint.pt"})
        if self.run_dir.is_dir():
            for f in self.run_dir.iterdir():
                if f.is_file() and not f.is_symlink() and f.name not in skip:
                    shutil.copyfile(f, inside / f.name)

    def _stage_out(self) -> None:
        """The service's run directory back to the user's, with the signed travel log and the
        certificate of the orchestrator that signed it."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        inside = self.service_run_dir
        state = Path(self._config("orchestrator")["state_dir"])
        copies = [(f, self.run_dir / f.name) for f in (inside.iterdir() if inside.is_dir() else ())]
        copies += [(state / "audit.log", self.audit_log), (self.cohort / "public" / "orchestrator.pem", self.certificate)]
        for src, dest in copies:
            try:
                _copy_regular(src, dest)
            except OSError:
                continue  # not there, or not a plain file (a link, a FIFO): not ours to copy


def _open_regular(path: Path) -> int:
    """A descriptor of `path` if it is a plain file, without following a link or blocking on a
    FIFO: the launcher, root, reads files other accounts wrote (the orchestrator's run
    directory), and must not be sent to another file by a link they left there."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a plain file")
    return fd


def _read_regular(path: Path, limit: int) -> bytes:
    with os.fdopen(_open_regular(path), "rb") as f:
        return f.read(limit)


def _copy_regular(src: Path, dest: Path) -> None:
    """Copy a plain file to `dest`, replacing it (never writing through a link there)."""
    with os.fdopen(_open_regular(src), "rb") as inp:
        dest.unlink(missing_ok=True)
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(inp, out)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (a service stops cleanly on it), then SIGKILL; never raises."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(log: Path, lines: int = 12) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "\n  " + "\n  ".join(text) if text else ""
