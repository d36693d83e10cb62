"""The supervisor: starts a whole local cohort, one OS process per trust domain, and tears it
all down on any failure, leaving no process, socket or shared segment behind.

Boot order follows paper 4.1: host, device, then each data holder in turn (each sets up its
driver while it holds the GPU), then the orchestrator last; holders then join over TLS.
"""

from __future__ import annotations

import dataclasses
import json
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gputravel import errors
from gputravel.crypto.pki import CohortCa
from gputravel.host.tap import TcpTap
from gputravel.errors import (
    BadInput,
    GputravelError,
    PeerTimeout,
    ProtocolError,
    RemoteError,
    TransportClosed,
)
from gputravel.protocol.layout import Layout
from gputravel.net.shaped import LinkError
from gputravel.transport.stream import StreamTransport
from gputravel.orchestrator.baseline import BaselineReport, DoBaseline
from gputravel.protocol.control import (
    AwaitHolders,
    Certified,
    DoTravel,
    Enroll,
    Failed,
    Holders,
    JoinCohort,
    Ready,
    Shutdown,
    Train,
    TrainDone,
    TrainStep,
    TravelReport,
)
from gputravel.cohort.links import CohortLinks, check_link_config, resolve_link
from gputravel.cohort.placement import Placement
from gputravel.cohort.isolation import Isolation
from gputravel.orchestrator.membership import (
    AwaitDeparture,
    Joined,
    Leave,
    Left,
    LendGpu,
    ProbeGpu,
    Probed,
    ReclaimGpu,
)
from gputravel.cohort.quoting import KEY as TDX_MODULE, QuotingLaunch
from gputravel.cohort.trust import (
    CohortTrust,
    TrustOptions,
    attestation_error_from,
    certify_device,
    pin_orchestrator,
    provision_cohort_trust,
)


SNOOP_FILE = Path("parties/host/snoop.bin")  # in the cohort directory: the host writes it in its own


@dataclass(frozen=True)
class HolderSpec:
    name: str
    dataset: str
    format: str = "raw"  # "raw" bytes, or "tokens": llm.c shards (a directory or one .bin) or text
    die_mid_copy_on_travel: int = 0  # fault injection (tests, red team): see HolderConfig


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
    # The orchestrator's signed travel log (orchestrator/travel_log.py); None: audit.log in the
    # cohort's directory (gone with it unless `workdir` is set).
    audit_log: str | None = None
    boot_timeout: float = 60.0
    travel_timeout: float = 120.0
    # How long the orchestrator and holders wait for the device (a semaphore, an RPC, a switch);
    # None: their own defaults. The red team makes it small so dropped pushes time out quickly.
    device_timeout: float | None = None
    # The holder<->orchestrator links (cohort/links.py): a cap per link and direction in
    # Mbit/s (None: uncapped), and the kind: "auto" (netns-tc when capped and namespaces work,
    # else the in-process token bucket; no shaping when uncapped), "netns", "token-bucket", "none".
    bandwidth_mbit: float | None = None
    link: str = "auto"
    # The chain of trust (cohort/trust.py): the defaults give an honest cohort; tests break one
    # link on purpose to see it refused.
    trust: TrustOptions = field(default_factory=TrustOptions)
    # Holders enrolled now (certificate, policy) that boot and join later: Cohort.add_holder.
    late_holders: tuple[HolderSpec, ...] = ()
    # Each party under its own uid, non-dumpable (cohort/isolation.py): None (auto) whenever
    # the launcher is root; False turns it off; True insists (BadInput without root).
    isolate: bool | None = None
    # Directories the orchestrator writes into (a training run directory): lent to its uid
    # while the cohort runs, given back at close. Paths in them reach it however deep they lie.
    output_dirs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = [h.name for h in self.holders]
        if not names:
            raise BadInput("a cohort needs at least one data holder")
        names += [h.name for h in self.late_holders]
        if len(set(names)) != len(names):
            raise BadInput("data holder names must be unique")
        if "orchestrator" in names:
            raise BadInput("'orchestrator' is reserved and cannot name a data holder")
        if self.buffer_bytes <= 0 or self.buffer_bytes % self.layout.record_bytes:
            raise BadInput(f"buffer size must be a positive multiple of {self.layout.record_bytes} bytes")
        for h in self.holders + self.late_holders:
            if h.format not in ("raw", "tokens"):
                raise BadInput(f"dataset format of holder {h.name!r} must be 'raw' or 'tokens', not {h.format!r}")
            exists = Path(h.dataset).is_file() if h.format == "raw" else Path(h.dataset).exists()
            if not exists:
                raise BadInput(f"dataset of holder {h.name!r} not found: {h.dataset}")

        check_link_config(self.link, self.bandwidth_mbit, self.tap)

    @property
    def device_vram(self) -> int:
        return self.vram_bytes or self.buffer_bytes + (64 << 20)


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
        self.links: CohortLinks | None = None
        self.trust: CohortTrust | None = None
        self.attestations: dict[str, Joined] = {}  # what each holder verified when it last joined
        self._host_sock = ""
        self._join_port = 0
        self.placement: Placement | None = None
        self._ca: CohortCa | None = None  # in this process's memory only, never on disk
        self._certs: dict[str, bytes] = {}  # what the CA issued (public)

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
        place = self.placement = Placement(self.dir, cfg.isolate)
        names = tuple(h.name for h in cfg.holders)
        members = names + tuple(h.name for h in cfg.late_holders)
        self.links = CohortLinks.for_cohort(cfg.link, members, cfg.bandwidth_mbit)
        self.links.open()
        # Each member makes its own key at boot and sends a request (_certify); the CA's key
        # stays in this process until close, for late and restarted holders.
        self._ca = CohortCa()
        for member in ("orchestrator",) + members:
            (self.dir / "pki" / member).mkdir(parents=True, mode=0o700)
            place.own(self.dir / "pki" / member, member)
        host_sock = self._host_sock = place.path(place.socket_dir / "host.sock")
        snoop = place.path(self.snoop_path) if self.snoop_path else None
        quoting = QuotingLaunch(place, self.dir)  # the orchestrator's TDX module (cohort/quoting.py)
        self.trust = provision_cohort_trust(self.dir / "trust", options=cfg.trust, quoting_socket=quoting.socket)
        place.own(self.trust.device_dir, "device")
        place.own(self.trust.orchestrator_dir, "orchestrator")
        for out in cfg.output_dirs:
            place.lend_dir("orchestrator", out)
        audit = place.lend_file("orchestrator", cfg.audit_log) if cfg.audit_log else None
        orchestrator = {"host_socket": host_sock, "pki_dir": place.path(self.dir / "pki" / "orchestrator"),
                        "layout": cfg.layout, "buffer_bytes": cfg.buffer_bytes,
                        "holder_timeout": cfg.travel_timeout, "tokenizer": cfg.tokenizer,
                        "trust_dir": place.path(self.trust.orchestrator_dir), **self._device_timeout(),
                        "audit_log": audit or place.path(self.audit_log_path)}
        self._spawn("host", {"socket_path": host_sock, "snoop_path": snoop})
        self._spawn(TDX_MODULE, quoting.config)  # makes its quoting key; we certify it, then drop the root key
        self.trust = quoting.certify(self.children[TDX_MODULE].control, self.trust, cfg.boot_timeout)
        dev_end, orch_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._spawn("device", {"host_socket": host_sock, "vram_bytes": cfg.device_vram, "layout": cfg.layout,
                                   "gpu_dir": place.path(self.trust.device_dir)}, extra_fd=dev_end.fileno())
            for h in cfg.holders:  # each holder sets up its driver while it holds the GPU
                self._spawn_holder(h)
            self.trust = self._pin(orchestrator, members)  # as late as possible before it boots
            measured = quoting.measure_launch(self._launched(orchestrator), place.popen_kwargs("orchestrator", None))
            ready = self._spawn("orchestrator", {**self._launched(orchestrator), "enroll": "orchestrator"},
                                extra_fd=orch_end.fileno())
            quoting.register(self.children[TDX_MODULE].control, self.children["orchestrator"].proc.pid,
                             place.uid("orchestrator") if place.on else None, measured, cfg.boot_timeout)
        finally:
            dev_end.close()
            orch_end.close()
        self.port = ready.detail["port"]
        port = self.port
        if cfg.tap:
            self._tap = TcpTap(("127.0.0.1", self.port), self.dir / "tap.bin")
            port = self._tap.port
        self._join_port = port
        self.dataset_bytes = self._join(names)

    def _spawn(self, role: str, config: dict, *, key: str | None = None, extra_fd: int | None = None) -> Ready:
        assert self.dir is not None
        key = key or role
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds = [theirs.fileno()] + ([extra_fd] if extra_fd is not None else [])
        log = self.dir / f"{key}.log"
        prefix, config = self._on_link(role, key, config)
        netns = self.links.netns_path(key) if prefix and self.placement.on else None
        if netns is not None:
            prefix = []  # the child enters the namespace itself, while still root (isolation.dropper)
        payload = json.dumps(config, default=_jsonable)
        argv = [*prefix, sys.executable, "-m", "gputravel.cohort.entry", role, payload, *map(str, fds)]
        popen = {**self.placement.popen_kwargs(key, netns), **self._popen_extras(role, key)}
        fds += popen.pop("pass_fds")
        with open(log, "wb") as logf:
            proc = subprocess.Popen(argv, pass_fds=fds, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, **popen)
        theirs.close()
        child = Child(role, proc, StreamTransport(ours, key), log)
        self.children[key] = child
        try:
            msg = child.control.recv(timeout=self.config.boot_timeout).message
            if isinstance(msg, Enroll):
                self._certify(key, config, child, msg)
                msg = child.control.recv(timeout=self.config.boot_timeout).message
        except GputravelError as exc:
            raise RemoteError(f"{key} failed to boot: {exc}{self._log_tail(child)}") from None
        if isinstance(msg, Failed):
            raise _typed(msg, f"{key} failed to boot")
        if not isinstance(msg, Ready):
            raise RemoteError(f"{key} sent {type(msg).__name__} instead of ready")
        self.placement.check(key, proc.pid)  # what it runs as, read back from /proc once it is up
        return msg

    def _certify(self, key: str, config: dict, child: Child, msg: Enroll) -> None:
        """Sign the key a member made itself; only the member this child was started as. The
        device's firmware key is the GPU vendor's to certify, once (cohort/trust.py)."""
        if child.role == "device" and msg.name == "device" and self.trust is not None:
            self.trust, (cert_pem, ca_pem) = certify_device(self.trust, msg.csr_pem)
            child.control.send(Certified(cert_pem=cert_pem, ca_pem=ca_pem))
            return
        if self._ca is None or child.role == "device" or msg.name != config.get("enroll"):
            raise ProtocolError(f"{key} asked to be certified as {msg.name!r}")
        self._certs[msg.name] = self._ca.issue(msg.name, msg.csr_pem)
        child.control.send(Certified(cert_pem=self._certs[msg.name], ca_pem=self._ca.cert_pem))

    def _popen_extras(self, role: str, key: str) -> dict:
        """More Popen arguments for one child (the red team's colluders share their loot)."""
        return {}

    def _on_link(self, role: str, key: str, config: dict) -> tuple[list[str], dict]:
        """Holders and the orchestrator start on their side of the cohort's link."""
        if self.links is None or role not in ("holder", "orchestrator"):
            return [], config
        extra: dict = {"pace_mbit": self.links.pace_mbit}
        if role == "orchestrator":
            extra["listen_host"] = self.links.listen_host
        return self.links.prefix(key), {**config, **extra}

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
        self._close_links()
        self._ca = None  # nobody is certified any more
        if self.placement is not None:
            self.placement.close()  # lent outputs go back to their owners
        if self.dir is not None and self.config.workdir is None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _close_links(self) -> None:
        """Delete the namespaces once every process inside has been reaped."""
        if self.links is None:
            return
        try:
            self.links.close()
        except LinkError as exc:
            warnings.warn(f"shaped-link teardown: {exc}", RuntimeWarning, stacklevel=3)
        self.links = None

    @property
    def link(self) -> str:
        """The kind of link the holders reach the orchestrator on: netns-tc, token-bucket or none."""
        if self.links is None:
            return resolve_link(self.config.link, self.config.bandwidth_mbit)
        return self.links.kind

    # ------------------------------------------------------------------ trust and membership
    def _pin(self, orchestrator: dict, members: tuple[str, ...]) -> CohortTrust:
        """Holders' policies pin this orchestrator's measurement (cohort/trust.py). Done as
        late as possible: a source file saved between this and the launch measurement
        (cohort/quoting.py) would look like a changed orchestrator, and holders would refuse it."""
        from gputravel.orchestrator.cvm import OrchestratorConfig

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
        """What the orchestrator is started with: what was pinned, unless a test changes it."""
        return {**orchestrator, **dict(self.config.trust.orchestrator_changes)}

    def _spawn_holder(self, h: HolderSpec, *, late: bool = False) -> Ready:
        assert self.dir is not None
        cfg = self.config
        place = self.placement
        return self._spawn("holder", {"name": h.name, "dataset_path": place.dataset(h.name, h.dataset),
                                      "host_socket": self._host_sock,
                                      "pki_dir": place.path(self.dir / "pki" / h.name), "layout": cfg.layout,
                                      "audit_arrival": cfg.audit_arrival, "dataset_format": h.format,
                                      "die_mid_copy_on_travel": h.die_mid_copy_on_travel,
                                      "trust_dir": place.path(self.trust.holder_dir(h.name)),
                                      "probe_at_boot": not late, **self._device_timeout(), "enroll": h.name},
                           key=h.name)

    def _device_timeout(self) -> dict:
        t = self.config.device_timeout
        return {} if t is None else {"device_timeout": t}

    def _join(self, names: tuple[str, ...]) -> dict[str, int]:
        """Holders attest the orchestrator and join; the dataset size of every joined holder."""
        assert self.links is not None
        timeout = self.config.boot_timeout
        for name in names:
            self.children[name].control.send(JoinCohort(host=self.links.connect_host, port=self._join_port))
        try:
            reply = self._ask(AwaitHolders(names=names, timeout=timeout), timeout + 5)
        except (TransportClosed, PeerTimeout, ProtocolError) as exc:
            # The orchestrator only saw a holder hang up or go quiet; the holder knows why
            # (an attestation it refused, naming the claim). An orchestrator's own refusal
            # (another error type) says why itself and propagates as is.
            refused = self._holder_failure(names)
            if refused is not None:
                raise refused from None
            raise exc
        assert isinstance(reply, Holders)
        for name in names:
            self.attestations[name] = self._from_holder(name, Joined)
        return dict(reply.dataset_bytes)

    def _holder_failure(self, names: tuple[str, ...], grace: float = 5.0) -> GputravelError | None:
        """The first error a holder reports within `grace` seconds (only used after a failure)."""
        pending = {self.children[n].control.fileno(): n for n in names}
        deadline = time.monotonic() + grace
        with selectors.DefaultSelector() as sel:
            for fd in pending:
                sel.register(fd, selectors.EVENT_READ)
            while pending and deadline > time.monotonic():
                for key, _ in sel.select(deadline - time.monotonic()):
                    name = pending.pop(key.fd)
                    sel.unregister(key.fd)
                    try:
                        msg = self.children[name].control.recv(timeout=1).message
                    except GputravelError:
                        continue
                    if isinstance(msg, Failed):
                        return _typed(msg, f"{name} did not join")
        return None

    def _from_holder(self, name: str, expect: type, cmd: object | None = None) -> object:
        holder = self.children[name]
        if cmd is not None:
            holder.control.send(cmd)
        try:
            msg = holder.control.recv(timeout=self.config.boot_timeout).message
        except GputravelError as exc:
            raise RemoteError(f"{name} stopped answering: {exc}{self._log_tail(holder)}") from None
        if isinstance(msg, Failed):
            raise _typed(msg, name)
        if not isinstance(msg, expect):
            raise RemoteError(f"{name} sent {type(msg).__name__} instead of {expect.__name__}")
        return msg

    def add_holder(self, name: str) -> int:
        """Paper 4.5: a late holder (one of config.late_holders) boots and joins the running
        cohort. The orchestrator lends it the GPU for its probe between travels, takes it back,
        then the holder attests the orchestrator and joins. Returns its dataset size."""
        spec = {h.name: h for h in self.config.late_holders}.get(name)
        if spec is None or name in self.children:
            raise BadInput(f"{name!r} is not a late holder of this cohort that has not started yet")
        return self._boot_and_join(spec)

    def restart_holder(self, name: str) -> int:
        """A holder CVM that died (crashed, killed mid-copy) boots again and rejoins, the way a
        late holder joins: a probe on the lent GPU, then attestation afresh. Faults injected
        into the first run are not repeated."""
        spec = {h.name: h for h in self.config.holders + self.config.late_holders}.get(name)
        child = self.children.get(name)
        if spec is None or child is None or child.proc.poll() is None:
            raise BadInput(f"{name!r} is not a holder of this cohort whose process has ended")
        child.control.close()
        del self.children[name]
        return self._boot_and_join(dataclasses.replace(spec, die_mid_copy_on_travel=0))

    def _boot_and_join(self, spec: HolderSpec) -> int:
        name = spec.name
        self._spawn_holder(spec, late=True)
        wait = self.config.boot_timeout + 5
        self._ask(LendGpu(holder=name), wait)
        try:
            self._from_holder(name, Probed, ProbeGpu())
        finally:
            self._ask(ReclaimGpu(), wait)  # whatever the probe did, the orchestrator takes the GPU back
        self.dataset_bytes.update(self._join((name,)))
        return self.dataset_bytes[name]

    def leave(self, name: str, reason: str = "leaving the cohort") -> None:
        """Paper 4.5: the holder says goodbye to the orchestrator and stops providing data; the
        orchestrator drops its link (travels to it then fail: HolderLost) until it rejoins."""
        self._from_holder(name, Left, Leave(reason=reason))
        self._ask(AwaitDeparture(holder=name, timeout=self.config.boot_timeout), self.config.boot_timeout + 5)
        self.dataset_bytes.pop(name, None)
        self.attestations.pop(name, None)

    def rejoin(self, name: str) -> int:
        """A holder that left joins again, attesting the orchestrator afresh."""
        self.dataset_bytes.update(self._join((name,)))
        return self.dataset_bytes[name]

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

    def baseline(self, holder: str, dataset_offset: int = 0) -> BaselineReport:
        """Fill the dataset buffer the centralised TLS way (paper 7.2, orchestrator/baseline.py)."""
        bw = self.config.bandwidth_mbit
        on_link = 3 * self.config.buffer_bytes * 8 / (bw * 1e6) if bw else 0.0  # generous: 3x size/rate
        reply = self._ask(DoBaseline(holder=holder, dataset_offset=dataset_offset),
                          self.config.travel_timeout + 30 + on_link)
        if not isinstance(reply, BaselineReport):
            raise RemoteError(f"orchestrator answered a baseline transfer with {type(reply).__name__}")
        return reply

    def travel(self, holder: str, dataset_offset: int = 0) -> TravelReport:
        reply = self._ask(DoTravel(holder=holder, dataset_offset=dataset_offset), self.config.travel_timeout + 30)
        if not isinstance(reply, TravelReport):
            raise RemoteError(f"orchestrator answered a travel with {type(reply).__name__}")
        return reply

    def train(self, config_json: str, run_dir: str = "", resume_checkpoint: str = "",
              on_step: Callable[[TrainStep], None] | None = None) -> dict:
        """Run a training job in the orchestrator CVM; returns its report (see train.loop.make_report)."""
        orch = self.children["orchestrator"]
        run_dir, resume_checkpoint = (self.placement.output("orchestrator", p) for p in (run_dir, resume_checkpoint))
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
        return self.dir / SNOOP_FILE if self.dir is not None and self.config.snoop else None

    @property
    def audit_log_path(self) -> Path | None:
        """Where the orchestrator writes its signed travel log."""
        if self.config.audit_log:
            return Path(self.config.audit_log)
        return self.dir / "parties" / "orchestrator" / "audit.log" if self.dir is not None else None

    def orchestrator_certificate(self) -> bytes:
        """The orchestrator's cohort certificate (public): the key that signs the travel log."""
        assert self.dir is not None
        return self._certs["orchestrator"]

    @property
    def isolation(self) -> Isolation:
        """The isolation this cohort got: on or off (and why), each party's uid and dumpability."""
        return self.placement.isolation if self.placement is not None else Isolation(False, "not started")

    def pids(self) -> dict[str, int]:
        return {k: c.proc.pid for k, c in self.children.items()}


def _typed(msg: Failed, where: str) -> GputravelError:
    refused = attestation_error_from(msg.kind, msg.reason, where)  # keeps the failing claim
    if refused is not None:
        return refused
    cls = getattr(errors, msg.kind, None)
    if not (isinstance(cls, type) and issubclass(cls, GputravelError)) or cls is errors.IllegalTransition:
        cls = RemoteError
    try:
        return cls(f"{where}: {msg.reason}")
    except TypeError:  # a constructor that wants more than a message (HolderLost): the nearest
        for base in cls.__mro__[1:]:  # type that takes one, with the kind named in the message
            if issubclass(base, GputravelError) and base not in (errors.IllegalTransition, errors.HolderLost):
                return base(f"{where}: {msg.kind}: {msg.reason}")
        return RemoteError(f"{where}: {msg.kind}: {msg.reason}")


def _wait(proc: subprocess.Popen, deadline: float) -> None:
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
    except subprocess.TimeoutExpired:
        pass


def _jsonable(obj: object) -> object:
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    raise TypeError(f"cannot pass {type(obj).__name__} to a child process")


