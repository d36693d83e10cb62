"""The supervisor: starts a whole local cohort, one OS process per trust domain, and tears it
all down on any failure, leaving no process, socket or shared segment behind.

Boot order follows paper 4.1: host, device, then each data holder in turn (each sets up its
driver while it holds the GPU), then the orchestrator last; holders then join over TLS.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import errors
from ..crypto.pki import CohortPki
from ..host.tap import TcpTap
from ..errors import BadInput, GputravelError, PeerTimeout, RemoteError
from ..layout import Layout
from ..transport.stream import StreamTransport
from .control import (AwaitHolders, DoTravel, Failed, Holders, JoinCohort, Ready, Shutdown, Train, TrainDone,
                      TrainStep, TravelReport)


@dataclass(frozen=True)
class HolderSpec:
    name: str
    dataset: str
    format: str = "raw"  # "raw" bytes, or "tokens": llm.c shards (a directory or one .bin) or text


@dataclass(frozen=True)
class CohortConfig:
    holders: tuple[HolderSpec, ...]
    buffer_bytes: int
    vram_bytes: int = 0  # 0: buffer plus 64 MiB
    layout: Layout = field(default_factory=Layout)
    workdir: str | None = None
    snoop: bool = False  # the host records every CVM's unprotected memory (snoop.bin)
    tap: bool = False  # holders reach the orchestrator through a recording TCP tap (tap.bin)
    audit_arrival: bool = False
    tokenizer: str = ""  # for training: the tokenizer every holder's tokens must come from
    boot_timeout: float = 60.0
    travel_timeout: float = 120.0

    def __post_init__(self) -> None:
        names = [h.name for h in self.holders]
        if not names:
            raise BadInput("a cohort needs at least one data holder")
        if len(set(names)) != len(names):
            raise BadInput("data holder names must be unique")
        if "orchestrator" in names:
            raise BadInput("'orchestrator' is reserved and cannot name a data holder")
        if self.buffer_bytes <= 0 or self.buffer_bytes % self.layout.record_bytes:
            raise BadInput(f"buffer size must be a positive multiple of {self.layout.record_bytes} bytes")
        for h in self.holders:
            if h.format not in ("raw", "tokens"):
                raise BadInput(f"dataset format of holder {h.name!r} must be 'raw' or 'tokens', not {h.format!r}")
            exists = Path(h.dataset).is_file() if h.format == "raw" else Path(h.dataset).exists()
            if not exists:
                raise BadInput(f"dataset of holder {h.name!r} not found: {h.dataset}")

    @property
    def device_vram(self) -> int:
        return self.vram_bytes or self.buffer_bytes + (64 << 20)


def _pdeathsig() -> None:
    """Children die with the supervisor even if it is killed outright."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    role: str
    proc: subprocess.Popen
    control: StreamTransport
    log: Path


class Cohort:
    """A running local cohort. Use as a context manager."""

    def __init__(self, config: CohortConfig) -> None:
        self.config = config
        self.children: dict[str, Child] = {}
        self.dir: Path | None = None
        self.port = 0
        self.dataset_bytes: dict[str, int] = {}
        self._tap: TcpTap | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Cohort:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        cfg = self.config
        self.dir = Path(tempfile.mkdtemp(prefix="gputravel-", dir=cfg.workdir))
        names = tuple(h.name for h in cfg.holders)
        CohortPki.create(self.dir / "pki", ("orchestrator",) + names)
        for member in ("orchestrator",) + names:
            _member_dir(self.dir / "pki", member)
        host_sock = str(self.dir / "host.sock")
        snoop = str(self.dir / "snoop.bin") if cfg.snoop else None
        self._spawn("host", {"socket_path": host_sock, "snoop_path": snoop})
        dev_end, orch_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._spawn("device", {"host_socket": host_sock, "vram_bytes": cfg.device_vram, "layout": cfg.layout},
                        extra_fd=dev_end.fileno())
            for h in cfg.holders:  # each holder sets up its driver while it holds the GPU
                self._spawn("holder", {"name": h.name, "dataset_path": h.dataset, "host_socket": host_sock,
                                       "pki_dir": str(self.dir / "pki" / h.name), "layout": cfg.layout,
                                       "audit_arrival": cfg.audit_arrival, "dataset_format": h.format}, key=h.name)
            ready = self._spawn("orchestrator", {"host_socket": host_sock, "pki_dir": str(self.dir / "pki" / "orchestrator"),
                                                 "layout": cfg.layout, "buffer_bytes": cfg.buffer_bytes,
                                                 "holder_timeout": cfg.travel_timeout, "tokenizer": cfg.tokenizer},
                                extra_fd=orch_end.fileno())
        finally:
            dev_end.close()
            orch_end.close()
        self.port = ready.detail["port"]
        port = self.port
        if cfg.tap:
            self._tap = TcpTap(("127.0.0.1", self.port), self.dir / "tap.bin")
            port = self._tap.port
        for h in cfg.holders:
            self.children[h.name].control.send(JoinCohort(host="127.0.0.1", port=port))
        reply = self._ask(AwaitHolders(names=names, timeout=cfg.boot_timeout), cfg.boot_timeout + 5)
        assert isinstance(reply, Holders)
        self.dataset_bytes = dict(reply.dataset_bytes)

    def _spawn(self, role: str, config: dict, *, key: str | None = None, extra_fd: int | None = None) -> Ready:
        assert self.dir is not None
        key = key or role
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds = [theirs.fileno()] + ([extra_fd] if extra_fd is not None else [])
        payload = json.dumps(config, default=_jsonable)
        log = self.dir / f"{key}.log"
        argv = [sys.executable, "-m", "gputravel.runtime.entry", role, payload, *map(str, fds)]
        with open(log, "wb") as logf:
            proc = subprocess.Popen(argv, pass_fds=fds, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                    preexec_fn=_pdeathsig)
        theirs.close()
        child = Child(role, proc, StreamTransport(ours, key), log)
        self.children[key] = child
        try:
            msg = child.control.recv(timeout=self.config.boot_timeout).message
        except GputravelError as exc:
            raise RemoteError(f"{key} failed to boot: {exc}{self._log_tail(child)}") from None
        if isinstance(msg, Failed):
            raise _typed(msg, f"{key} failed to boot")
        if not isinstance(msg, Ready):
            raise RemoteError(f"{key} sent {type(msg).__name__} instead of ready")
        return msg

    def _log_tail(self, child: Child) -> str:
        try:
            text = child.log.read_text(errors="replace").strip().splitlines()[-15:]
        except OSError:
            return ""
        return ("\n  " + "\n  ".join(text)) if text else ""

    def close(self) -> None:
        """Stop everything; never raises; leaves nothing behind."""
        for key in [k for k, c in self.children.items() if c.role in ("orchestrator", "holder")]:
            try:
                self.children[key].control.send(Shutdown())
            except GputravelError:
                pass
        deadline = time.monotonic() + 5
        for child in self.children.values():
            if child.role in ("orchestrator", "holder"):
                _wait(child.proc, deadline)
        for child in self.children.values():
            if child.proc.poll() is None:
                child.proc.terminate()
        deadline = time.monotonic() + 5
        for child in self.children.values():
            _wait(child.proc, deadline)
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()
            child.control.close()
        self.children.clear()
        if self._tap is not None:
            self._tap.close()
            self._tap = None
        if self.dir is not None and self.config.workdir is None:
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ commands
    def _ask(self, cmd: object, timeout: float) -> object:
        orch = self.children["orchestrator"]
        orch.control.send(cmd)
        try:
            msg = orch.control.recv(timeout=timeout).message
        except PeerTimeout:
            raise
        except GputravelError as exc:
            raise RemoteError(f"orchestrator stopped answering: {exc}{self._log_tail(orch)}") from None
        if isinstance(msg, Failed):
            raise _typed(msg, "orchestrator")
        return msg

    def travel(self, holder: str, dataset_offset: int = 0) -> TravelReport:
        reply = self._ask(DoTravel(holder=holder, dataset_offset=dataset_offset), self.config.travel_timeout + 30)
        if not isinstance(reply, TravelReport):
            raise RemoteError(f"orchestrator answered a travel with {type(reply).__name__}")
        return reply

    def train(self, config_json: str, run_dir: str = "", resume_checkpoint: str = "",
              on_step: Callable[[TrainStep], None] | None = None) -> dict:
        """Run a training job in the orchestrator CVM; returns its report (see train.loop.make_report)."""
        orch = self.children["orchestrator"]
        orch.control.send(Train(config_json=config_json, run_dir=run_dir, resume_checkpoint=resume_checkpoint))
        while True:
            try:
                msg = orch.control.recv(timeout=self.config.travel_timeout + 30).message
            except GputravelError as exc:
                raise RemoteError(f"orchestrator stopped answering during training: {exc}{self._log_tail(orch)}") from None
            if isinstance(msg, TrainStep):
                if on_step is not None:
                    on_step(msg)
            elif isinstance(msg, TrainDone):
                return json.loads(msg.report_json)
            elif isinstance(msg, Failed):
                raise _typed(msg, "training")
            else:
                raise RemoteError(f"orchestrator sent {type(msg).__name__} during training")

    @property
    def snoop_path(self) -> Path | None:
        return self.dir / "snoop.bin" if self.dir is not None and self.config.snoop else None

    def pids(self) -> dict[str, int]:
        return {k: c.proc.pid for k, c in self.children.items()}


def _member_dir(pki: Path, member: str) -> None:
    """Each CVM gets only the cohort CA and its own certificate and key, never another's key."""
    own = pki / member
    own.mkdir(mode=0o700)
    for name in ("ca.pem", f"{member}.pem", f"{member}.key"):
        shutil.copy2(pki / name, own / name)
    os.unlink(pki / f"{member}.key")


def _typed(msg: Failed, where: str) -> GputravelError:
    cls = getattr(errors, msg.kind, None)
    if not (isinstance(cls, type) and issubclass(cls, GputravelError)) or cls is errors.IllegalTransition:
        cls = RemoteError
    return cls(f"{where}: {msg.reason}")


def _wait(proc: subprocess.Popen, deadline: float) -> None:
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
    except subprocess.TimeoutExpired:
        pass


def _jsonable(obj: object) -> object:
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    raise TypeError(f"cannot pass {type(obj).__name__} to a child process")


