"""The supervisor: starts a local cohort, one process per trust domain, in paper 4.1's order
(host, device, holders, the orchestrator last), checks each is isolated as planned, and tears
it all down on any failure, leaving nothing behind. Commands are the client's (cohort/client.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gputravel.cohort.client import error_from
from gputravel.cohort.entry import jsonable
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort import isolation, stopping
from gputravel.cohort.isolation import Isolation
from gputravel.cohort.links import CohortLinks, resolve_link
from gputravel.cohort.placement import Placement
from gputravel.cohort.broker import KEY as KEY_BROKER, BrokerLaunch
from gputravel.cohort.quoting import KEY as TDX_MODULE, QuotingLaunch
from gputravel.orchestrator.release import anchors_digest
from gputravel.release.seal import anchors
from gputravel.cohort.trust import CohortTrust, certify_device, pin_orchestrator, provision_cohort_trust
from gputravel.crypto.pki import CohortCa
from gputravel.processes import Children
from gputravel.errors import BadInput, GputravelError, ProtocolError, RemoteError, Terminated
from gputravel.host.tap import TcpTap
from gputravel.net import LinkError
from gputravel.orchestrator.cvm import OrchestratorConfig
from gputravel.protocol.hardware import EMULATED
from gputravel.protocol.control import Certified, Enroll, Failed, Ready, Shutdown
from gputravel.transport.stream import StreamTransport

PREFIX = "gputravel-"  # of a cohort's directory, in the system's temporary directory
SNOOP_FILE = Path("parties/host/snoop.bin")  # in the cohort directory: the host writes it in its own
PRODUCTION_ENTRY = "gputravel.cohort.entry"
TRUSTED_ROLES = ("orchestrator", "device", TDX_MODULE)  # a launch hook starts these only as they are
# Holders booting at once: every core busy, the last well within its enrolment timeout.
BOOT_WINDOW = min(32, max(4, 2 * (os.cpu_count() or 1)))


@dataclass(frozen=True)
class PartySpec:
    role: str  # what it is in the cohort: host, device, holder, orchestrator, tdx-module
    key: str  # its name: its uid, its log, its control link
    config: dict
    entry: str = PRODUCTION_ENTRY  # another module may serve the role (see cohort/entry.run_party)
    umask: int | None = None  # None: the launcher's


# Given the spec the supervisor made for a party, the spec to start it with.
Launch = Callable[[PartySpec], PartySpec]


@dataclass
class Child:
    """A party's role and control link; its process and log are kept by `procs` alone."""

    role: str
    control: StreamTransport
    key: str
    procs: Children = field(repr=False)

    @property
    def proc(self) -> subprocess.Popen:
        return self.procs[self.key]

    @property
    def log(self) -> Path:
        return self.procs.logs[self.key]


class Supervisor:
    """The processes of one local cohort. ``launch``: how each party is started, given its spec."""

    def __init__(self, config: CohortConfig, launch: Launch | None = None) -> None:
        self.config = config
        self.launch = launch
        self.children: dict[str, Child] = {}  # each party's role and link; its process is procs'
        self.procs = Children(5)
        self.dir: Path | None = None
        self.port = 0  # where the orchestrator listens for holders
        self.links: CohortLinks | None = None
        self.trust: CohortTrust | None = None
        self.placement: Placement | None = None
        self._tap: TcpTap | None = None
        self._broker: BrokerLaunch | None = None
        self._host_sock = ""
        self._ca: CohortCa | None = None  # in this process's memory only, never on disk
        self._certs: dict[str, bytes] = {}  # what the CA issued (public)
        self._undo_term: Callable[[], None] = lambda: None

    # ------------------------------------------------------------------ starting
    def start(self) -> None:
        cfg = self.config
        self._undo_term = stopping.catch_term("the cohort was stopped")  # close() puts it back
        orchestrator, quoting = self._provision()
        snoop = self.placement.path(self.snoop_path) if self.snoop_path else None
        self._spawn("host", {"socket_path": self._host_sock, "snoop_path": snoop, **self._hardware()})
        self._spawn(TDX_MODULE, quoting.config)  # makes its quoting key; we certify it, then drop the root key
        self.trust = quoting.certify(self.children[TDX_MODULE].control, self.trust, cfg.boot_timeout)
        self.port = self._boot_gpu_side(orchestrator, quoting)
        if cfg.tap:
            self._tap = TcpTap(("127.0.0.1", self.port), self.dir / "tap.bin")

    def _provision(self) -> tuple[dict, QuotingLaunch]:
        cfg = self.config
        if cfg.workdir is None:  # a directory given is the caller's to keep and to clean
            stopping.sweep(None, PREFIX)  # what a launcher killed outright left: its keys among it
        self.dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir=cfg.workdir))
        stopping.claim(self.dir)
        place = self.placement = Placement(self.dir, cfg.isolate)
        self.links = CohortLinks(resolve_link(cfg.link, cfg.bandwidth_mbit), self.members, cfg.bandwidth_mbit)
        self.links.open()
        # Members make their keys at boot (_certify); the CA's key stays here for late holders.
        self._ca = CohortCa()
        for member in ("orchestrator",) + self.members:
            (self.dir / "pki" / member).mkdir(parents=True, mode=0o700)
            place.own(self.dir / "pki" / member, member)
        self._host_sock = place.path(place.socket_dir / "host.sock")
        quoting = QuotingLaunch(place, self.dir)  # the orchestrator's TDX module (cohort/quoting.py)
        self.trust = provision_cohort_trust(self.dir / "trust", options=cfg.trust, quoting_socket=quoting.socket,
                                            roots_from=cfg.roots, gpu_index=cfg.gpu_index)
        # Only a job with a manifest seals: without one the orchestrator's measurement stays the same
        # in every cohort (several GPUs' ranks check each other's), with no broker or anchors in it.
        if cfg.manifest_json:
            self._broker = BrokerLaunch(place, self.dir, self.trust.root / "roots", cfg.broker_dir)
        place.own(self.trust.device_dir, "device")
        place.own(self.trust.orchestrator_dir, "orchestrator")
        for out in cfg.output_dirs:
            place.lend_dir("orchestrator", out)
        audit = place.lend_file("orchestrator", cfg.audit_log) if cfg.audit_log else None
        orchestrator = {"host_socket": self._host_sock, "pki_dir": place.path(self.dir / "pki" / "orchestrator"),
                        "layout": cfg.layout, "buffer_bytes": cfg.buffer_bytes,
                        "holder_timeout": cfg.travel_timeout, "tokenizer": cfg.tokenizer, "schema": cfg.schema,
                        "trust_dir": place.path(self.trust.orchestrator_dir), **self._device_timeout(), **self._hardware(),
                        "audit_log": audit or place.path(self.audit_log_path), "job_json": cfg.job_json}
        if self._broker is not None:
            orchestrator.update(manifest_json=cfg.manifest_json, broker_socket=self._broker.socket,
                                broker_key=self._broker.public_key,
                                # What its holders' certificates chain to: release signatures count under it only.
                                anchors_sha384=anchors_digest(anchors(self._ca.cert_pem)))
        return orchestrator, quoting

    def _boot_gpu_side(self, orchestrator: dict, quoting: QuotingLaunch) -> int:
        """Device, holders, then the orchestrator (measured, registered with its TDX module); its port."""
        cfg, place = self.config, self.placement
        dev_end, orch_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._spawn("device", {"host_socket": self._host_sock, "vram_bytes": cfg.device_vram, "layout": cfg.layout,
                                   "gpu_dir": place.path(self.trust.device_dir)}, extra_fd=dev_end.fileno())
            self._boot_holders()  # each holder sets up its driver while it holds the GPU
            self.trust = self._pin(orchestrator, self.members)  # as late as possible before it boots
            measured = quoting.measure_launch(self._launched(orchestrator), place.popen_kwargs("orchestrator", None))
            if self._broker is not None:
                self._spawn(KEY_BROKER, self._broker.config(measured))  # it serves that measurement only
            ready = self._spawn("orchestrator", {**self._launched(orchestrator), "enroll": "orchestrator"},
                                extra_fd=orch_end.fileno())
            quoting.register(self.children[TDX_MODULE].control, self.children["orchestrator"].proc.pid,
                             place.uid("orchestrator") if place.on else None, measured, cfg.boot_timeout)
        finally:
            dev_end.close()
            orch_end.close()
        return ready.detail["port"]

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(h.name for h in self.config.holders + self.config.late_holders)

    def _boot_holders(self) -> None:
        """BOOT_WINDOW holders start at once; their GPU probes (paper 4.1) stay one at a time, in order."""
        started: deque[tuple[str, dict, Child]] = deque()
        for h in self.config.holders:
            spec = self._launched_as(PartySpec("holder", h.name, self._holder_config(h, late=False)))
            started.append(self._launch(spec, None))
            if len(started) >= BOOT_WINDOW:
                self._await_up(*started.popleft())
        while started:
            self._await_up(*started.popleft())

    def _holder_config(self, h: HolderSpec, late: bool) -> dict:
        assert self.dir is not None
        cfg, place = self.config, self.placement
        return {"name": h.name, "dataset_path": place.dataset(h.name, h.dataset), "host_socket": self._host_sock,
                "pki_dir": place.path(self.dir / "pki" / h.name), "layout": cfg.layout,
                "audit_arrival": cfg.audit_arrival, "dataset_format": h.format,
                "die_mid_copy_on_travel": h.die_mid_copy_on_travel, "eval_share": h.eval_share, "eval_seed": h.eval_seed,
                "sign_release": h.sign_release,
                "trust_dir": place.path(self.trust.holder_dir(h.name)),
                "probe_at_boot": not late, **self._device_timeout(), **self._hardware(), "enroll": h.name}

    def forget(self, name: str) -> None:
        self.children.pop(name).control.close()
        self.procs.forget(name)

    def _hardware(self) -> dict:
        return {} if self.config.hardware == EMULATED else {"hardware": self.config.hardware}

    def _device_timeout(self) -> dict:
        t = self.config.device_timeout
        return {} if t is None else {"device_timeout": t}

    def _spawn(self, role: str, config: dict, *, key: str | None = None, extra_fd: int | None = None) -> Ready:
        spec = PartySpec(role, key or role, config)
        return self._await_up(*self._launch(self._launched_as(spec), extra_fd))

    def _launched_as(self, spec: PartySpec) -> PartySpec:
        """The launch hook's spec: it may start an untrusted party another way, but never change who a
        party is, nor anything of a trusted one (measured and pinned before it starts)."""
        if self.launch is None:
            return spec
        out = self.launch(spec)
        if (out.role, out.key, out.config.get("enroll")) != (spec.role, spec.key, spec.config.get("enroll")):
            raise BadInput(f"the launch hook may not change who {spec.key!r} is (role, name, enrolment)")
        if spec.role in TRUSTED_ROLES and out != spec:
            raise BadInput(f"the launch hook may not change how the {spec.role} starts: it is trusted "
                           f"({', '.join(TRUSTED_ROLES)} start as the launcher measured them)")
        return out

    def _launch(self, spec: PartySpec, extra_fd: int | None) -> tuple[str, dict, Child]:
        assert self.dir is not None
        key = spec.key
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds = [theirs.fileno()] + ([extra_fd] if extra_fd is not None else [])
        prefix, config = self._on_link(spec.role, key, spec.config)
        netns = self.links.netns_path(key) if prefix and self.placement.on else None
        if netns is not None:
            prefix = []  # the child enters the namespace itself, while still root (isolation.dropper)
        payload = json.dumps(config, default=jsonable)
        argv = [*prefix, sys.executable, "-m", spec.entry, spec.role, payload, *map(str, fds)]
        popen = self.placement.popen_kwargs(key, netns)
        popen["env"] = isolation.party_env(spec.role, popen.get("env"))
        if spec.umask is not None:
            popen["umask"] = spec.umask
        fds += popen.pop("pass_fds")
        # In a session of its own: Ctrl-C reaches the launcher alone, which stops them in order.
        self.procs.start(key, argv, log=self.dir / f"{key}.log", pass_fds=fds, start_new_session=True, **popen)
        theirs.close()
        child = Child(spec.role, StreamTransport(ours, key), key, self.procs)
        self.children[key] = child
        return key, config, child

    def _await_up(self, key: str, config: dict, child: Child) -> Ready:
        try:
            msg = child.control.recv(timeout=self.config.boot_timeout).message
            if isinstance(msg, Enroll):
                self._certify(key, config, child, msg)
                msg = child.control.recv(timeout=self.config.boot_timeout).message
        except Terminated:
            raise  # this launcher is being stopped: said as that, not as a failed boot
        except GputravelError as exc:
            raise RemoteError(f"{key} failed to boot: {exc}{self.log_tail(key)}") from None
        if isinstance(msg, Failed):
            raise error_from(msg, f"{key} failed to boot")
        if not isinstance(msg, Ready):
            raise RemoteError(f"{key} sent {type(msg).__name__} instead of ready")
        self.placement.check(key, child.proc.pid)  # what it runs as, read back from /proc once it is up
        return msg

    def _certify(self, key: str, config: dict, child: Child, msg: Enroll) -> None:
        """Sign the key a member made, only as the member it was started as; the device's, once."""
        if child.role == "device" and msg.name == "device" and self.trust is not None:
            self.trust, (cert_pem, ca_pem) = certify_device(self.trust, msg.csr_pem)
            child.control.send(Certified(cert_pem=cert_pem, ca_pem=ca_pem))
            return
        if self._ca is None or child.role == "device" or msg.name != config.get("enroll"):
            raise ProtocolError(f"{key} asked to be certified as {msg.name!r}")
        self._certs[msg.name] = self._ca.issue(msg.name, msg.csr_pem)
        child.control.send(Certified(cert_pem=self._certs[msg.name], ca_pem=self._ca.cert_pem))

    def _on_link(self, role: str, key: str, config: dict) -> tuple[list[str], dict]:
        if self.links is None or role not in ("holder", "orchestrator"):
            return [], config
        extra: dict = {"pace_mbit": self.links.pace_mbit}
        if role == "orchestrator":
            extra["listen_host"] = self.links.listen_host
        return self.links.prefix(key), {**config, **extra}

    # ------------------------------------------------------------------ trust
    def _pin(self, orchestrator: dict, members: tuple[str, ...]) -> CohortTrust:
        """Holders' policies pin this orchestrator, as late as possible: a source file saved before its
        launch measurement would look like a changed orchestrator."""
        assert self.trust is not None
        try:
            pinned = OrchestratorConfig(**orchestrator)
            OrchestratorConfig(**self._launched(orchestrator))
        except TypeError as exc:
            raise BadInput(f"orchestrator configuration: {exc}") from None
        trust = pin_orchestrator(self.trust, orchestrator=pinned, holders=members, options=self.config.trust)
        for name in members:
            self.placement.own(trust.holder_dir(name), name)
        return trust

    def _launched(self, orchestrator: dict) -> dict:
        return {**orchestrator, **dict(self.config.trust.orchestrator_changes)}

    # ------------------------------------------------------------------ what the client reaches (client.Parties)
    def control(self, name: str) -> StreamTransport:
        return self.children[name].control

    def log_tail(self, name: str) -> str:
        log = self.procs.logs.get(name)
        try:
            text = log.read_text(errors="replace").strip().splitlines()[-15:] if log else []
        except OSError:
            return ""
        return ("\n  " + "\n  ".join(text)) if text else ""

    def join_address(self) -> tuple[str, int]:
        assert self.links is not None
        return self.links.listen_host, self._tap.port if self._tap is not None else self.port  # the tap records

    # ------------------------------------------------------------------ stopping
    def close(self) -> None:
        """Stop everything, leaving nothing behind; never raises, and no signal cuts it short."""
        with stopping.uninterrupted():
            self._close()
        self._undo_term()
        self._undo_term = lambda: None

    def _close(self) -> None:
        members = [k for k, c in self.children.items() if c.role in ("orchestrator", "holder")]
        for key in members:
            try:
                self.children[key].control.send(Shutdown())
            except GputravelError:
                pass
        self.procs.stop(members, asked=True)  # asked: each finishes its goodbye first
        self.procs.close()  # the rest, last started first
        for child in self.children.values():
            child.control.close()
        self.children.clear()
        if self._tap is not None:
            self._tap.close()
            self._tap = None
        if self.links is not None:  # once every process inside its namespaces is reaped
            try:
                self.links.close()
            except LinkError as exc:
                warnings.warn(f"shaped-link teardown: {exc}", RuntimeWarning, stacklevel=3)
            self.links = None
        self._ca = None  # nobody is certified any more
        if self.placement is not None:
            self.placement.close()  # lent outputs go back to their owners
        if self.dir is not None and self.config.workdir is None:
            stopping.delete(self.dir)
        elif self.dir is not None:
            stopping.release(self.dir)  # a directory given is the caller's to keep

    # ------------------------------------------------------------------ looking at it
    @property
    def link(self) -> str:
        """netns-tc, token-bucket or none."""
        return self.links.kind if self.links is not None else resolve_link(self.config.link, self.config.bandwidth_mbit)

    @property
    def snoop_path(self) -> Path | None:
        return self.dir / SNOOP_FILE if self.dir is not None and self.config.snoop else None

    @property
    def audit_log_path(self) -> Path | None:
        if self.config.audit_log:
            return Path(self.config.audit_log)
        return self.dir / "parties" / "orchestrator" / "audit.log" if self.dir is not None else None

    def orchestrator_certificate(self) -> bytes:
        """The orchestrator's cohort certificate: the key that signs the travel log."""
        return self._certs["orchestrator"]

    @property
    def isolation(self) -> Isolation:
        return self.placement.isolation if self.placement is not None else Isolation(False, "not started")

    def pids(self) -> dict[str, int]:
        return {k: self.procs[k].pid for k in self.children}

