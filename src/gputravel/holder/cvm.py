"""A data holder CVM: boots first, keeps its dataset mapped and resident, serves travel requests
(records are encrypted straight from that mapping into the staging slots)."""

from __future__ import annotations

import mmap
import os
import selectors
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from gputravel.crypto.pki import CohortPki
from gputravel.driver.driver import Driver
from gputravel.driver.link import PcieMuxClient, register_with_host
from gputravel.errors import BadInput, GputravelError, IllegalTransition, PeerTimeout, ProtocolError, TransportClosed
from gputravel.files import EVAL_SHARE, RAW, RECORDS, TOKENS, DatasetFormat, check_split, dataset_kind
from gputravel.protocol.layout import Layout, manifest_piece_bytes
from gputravel.protocol.parties import ORCHESTRATOR
from gputravel.protocol.travel import (Bye, HolderHello, JobResults, ProbeDone, ProbeNow, ReleaseSigned, SendChunk,
                                      TravelRequest)
from gputravel.holder.machine import Deadlines, HolderTravel
from gputravel.holder.steps import (
    Attached, Attest, Attested, AuditArrival, Audited, AwaitGpu, AwaitSwitchHome, BaselineAsked, Challenge, CheckBuffer,
    Copied, CopyChunk, ExportBlob, Exported, Granted, HelloAnswered, ImportBlob, Imported, Introduce, Replied, Reply,
    Request, StepFailed, SwitchAsked, SwitchBack, SwitchedHome,
)
from gputravel.protocol.manifest import piece_digests
from gputravel.transport.base import Transport
from gputravel.transport.unix import connect_unix
from gputravel.transport.tls import connect_tls
from gputravel.attest import AttestDue, OrchestratorAttestation
from gputravel.holder.attestation import challenge_orchestrator
from gputravel.holder.baseline import send_chunk
from gputravel.protocol.control import JoinCohort, Ready, Shutdown
from gputravel.net.pace import pace
from gputravel.protocol.hardware import at_least, hardware_profile
from gputravel.holder.membership import HOLDER_COMMANDS, holder_command
from gputravel.holder.membership import join as join_cohort
from gputravel.holder.log_key import own_log_key
from gputravel.attest.material import HolderMaterial

if TYPE_CHECKING:
    from gputravel.data.records import RecordSchema


@dataclass(frozen=True)
class HolderConfig:
    name: str
    dataset_path: str
    host_socket: str
    pki_dir: str
    layout: Layout
    device_timeout: float = 30.0  # the host's MUX and the device, each step of a travel
    orchestrator_timeout: float = 30.0  # an attestation exchange, the answer to a join, one whole message
    audit_arrival: bool = False  # read the buffer back on arrival and count non-zero bytes
    dataset_format: DatasetFormat = RAW  # files.py DATASET_FORMATS
    die_mid_copy_on_travel: int = 0  # fault injection: die half-way through this travel's copy (1-based; 0: never)
    pace_mbit: float | None = None  # token-bucket links: pace what we send the orchestrator to this rate
    trust_dir: str = ""  # the roots and this holder's policy (cohort/trust.py); required to join
    probe_at_boot: bool = True  # False: a late holder, probing when the orchestrator lends it the GPU
    hardware: str = "emulated"  # protocol/hardware.py: floors on the copy and the baseline's reads
    # A "records" dataset's held-out share, kept for evaluation and never trained on, chosen by a
    # permutation seeded with eval_seed (data/records.py held_out): the holder's own choice.
    eval_share: float = EVAL_SHARE
    eval_seed: int = 0
    # Sign the release of the job's model to the recipients its approved manifest names (issue 28).
    sign_release: bool = True

    def __post_init__(self) -> None:
        try:
            check_split(self.eval_share, self.eval_seed)
        except ValueError as exc:
            raise BadInput(f"holder {self.name!r}: {exc}") from None


class Dataset:
    """A holder's dataset, mapped read-only once. A "tokens" dataset (llm.c shards, or text) is its
    shards' tokens without headers, in order, laid out once at boot in the CVM's private memory.
    A "records" dataset (data/records.py) is laid out there too: its training records, then its
    held-out records from a fresh piece, whole records to each `piece_bytes` manifest piece."""

    def __init__(self, path: str, fmt: DatasetFormat, *, piece_bytes: int = 0, eval_share: float = EVAL_SHARE,
                 eval_seed: int = 0) -> None:
        try:
            dataset_kind(fmt)
        except ValueError as exc:
            raise BadInput(str(exc)) from None
        self.tokenizer = ""
        self.schema: RecordSchema | None = None  # a records dataset's
        self.train_records = self.eval_records = 0
        self.held_base = 0  # where its held-out records start (0: none): no chunk crosses it
        if fmt == RECORDS:
            self._map: mmap.mmap | None = self._load_records(path, piece_bytes, eval_share, eval_seed)
        else:
            self._map = self._load_tokens(path) if fmt == TOKENS else self._load_raw(path)  # None: empty
        self.view = memoryview(self._map if self._map is not None else b"")
        self.size = len(self.view)

    @classmethod
    def of(cls, config: HolderConfig) -> Dataset:
        """The dataset a holder CVM with `config` serves, laid out in its manifest's pieces."""
        return cls(config.dataset_path, config.dataset_format, piece_bytes=manifest_piece_bytes(config.layout),
                   eval_share=config.eval_share, eval_seed=config.eval_seed)

    def _load_raw(self, path: str) -> mmap.mmap | None:
        if not os.path.isfile(path):
            raise BadInput(f"dataset {path!r} does not exist or is not a file")
        if not (size := os.path.getsize(path)):
            return None
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)

    def _load_tokens(self, path: str) -> mmap.mmap | None:
        from gputravel.data.holder_tokens import load_tokens  # lazy: numpy costs a raw holder's boot 40 ms

        loaded = load_tokens(path)
        data = loaded.tokens.astype("<u2", copy=False).tobytes()
        self.tokenizer = loaded.tokenizer
        if not data:
            return None
        mem = mmap.mmap(-1, len(data))
        mem.write(data)
        return mem

    def _load_records(self, path: str, piece_bytes: int, share: float, seed: int) -> mmap.mmap:
        from gputravel.data.records import RECORDS_FILE, SCHEMA_FILE, Units, lay_out_split, load_records  # lazy: numpy

        if piece_bytes <= 0:
            raise ValueError("a records dataset is laid out in its holder's manifest pieces: pass piece_bytes")
        for item in (Path(path) / SCHEMA_FILE, Path(path) / RECORDS_FILE):
            if item.exists() and not item.is_file():  # a FIFO would block the boot, a device never end it
                raise BadInput(f"dataset {str(item)!r} is not a regular file")
        records = load_records(path)
        units = Units(records.schema.record_bytes, piece_bytes)  # a record larger than a piece: refused
        # Laid out straight into the CVM's private mapping, a block at a time: no second whole copy.
        mem, self.train_records, self.eval_records = lay_out_split(records, units, share, seed,
                                                                   into=lambda n: mmap.mmap(-1, n))
        if not self.train_records:
            raise BadInput(f"dataset {path!r}: none of its {len(records)} records is left to train on with "
                           f"eval_share {share}: lower eval_share or add records")
        self.schema = records.schema
        self.held_base = units.eval_base(self.train_records) if self.eval_records else 0
        assert isinstance(mem, mmap.mmap)
        return mem


class DataHolder:
    """A data holder CVM's engine, given what it opened at boot (:meth:`from_config` opens them);
    ``connect`` opens the link to an orchestrator (default: mutual TLS). Building one does no IO."""

    _clock = staticmethod(time.perf_counter)  # the one clock the machine is told: step timings, attestation ages

    def __init__(self, config: HolderConfig, *, dataset: Dataset, host: Transport, driver: Driver,
                 mux: PcieMuxClient, log_key: bytes, connect: Callable[[str, int], Transport] | None = None,
                 policy: Callable[[], HolderMaterial] | None = None,
                 challenge: Callable[..., OrchestratorAttestation] = challenge_orchestrator) -> None:
        if connect is None and not config.pki_dir:  # "" would be the working directory
            raise BadInput("a holder needs its pki directory: its TLS key and its travel-log key live there")
        self.config = config
        self.dataset, self.host, self.driver, self.mux = dataset, host, driver, mux
        self.profile = hardware_profile(config.hardware)
        self.piece_bytes = manifest_piece_bytes(config.layout)
        deadlines = Deadlines(device=config.device_timeout, orchestrator=config.orchestrator_timeout)
        self.sm = HolderTravel(config.name, self.dataset.size, piece_digests(self.dataset.view, self.piece_bytes),
                               self.piece_bytes, deadlines, config.audit_arrival, self.dataset.held_base)
        self._log_key = log_key  # sent only in our hello to the orchestrator we attested (holder/log_key.py)
        self._connect = connect if connect is not None else partial(_connect_tls, config)
        self._load_policy = policy if policy is not None else partial(HolderMaterial.load, config.trust_dir)
        self._challenge_orchestrator = challenge
        self.orchestrator: Transport | None = None
        self.attestation: OrchestratorAttestation | None = None  # our last one of the orchestrator
        self.travels_served = 0
        self.probed = False  # set up our driver on the GPU yet (paper 4.1): at boot, or on a lent GPU
        self._policy: HolderMaterial | None = None  # what the attestation under way checks against

    @classmethod
    def from_config(cls, config: HolderConfig, **extra: Any) -> Self:
        """The holder CVM's own boot (``extra``: a subclass's own arguments)."""
        dataset, host, driver, mux, log_key = _open(config)
        return cls(config, dataset=dataset, host=host, driver=driver, mux=mux, log_key=log_key, **extra)

    def boot(self) -> None:
        """Paper 4.1: set up the driver while this CVM has the GPU, before the orchestrator boots."""
        if self.config.probe_at_boot:  # else a late holder: it probes when the orchestrator lends it the GPU
            self.probe()

    def probe(self) -> None:
        self.switch(self.config.name)
        self.probe_driver()

    def probe_driver(self) -> None:
        """Set up our driver on the GPU we hold (paper 4.1)."""
        self.driver.probe(timeout=self.config.device_timeout)
        self.probed = True

    def switch(self, target: str) -> int:
        return self.mux.switch(target, self.config.device_timeout).elapsed_ns

    # ------------------------------------------------------------------ what the orchestrator asks of us
    def join(self, host: str, port: int) -> OrchestratorAttestation:
        """Connect, attest the orchestrator (paper 4.5: every join), and only then introduce ourselves."""
        if self.orchestrator is not None:
            raise IllegalTransition(self.config.name, "joined", "join again before leaving")
        self._policy = self._load_policy()
        self.orchestrator = self._connect(host, port)
        try:
            self._run(Attest(joining=True))
        except BaseException:
            self.drop_orchestrator()
            raise
        assert self.attestation is not None
        return self.attestation

    def reattest(self) -> None:
        """Paper 4.5: evidence has a lifetime. Told `AttestDue` (between travels, GPU home), attest
        the orchestrator again for a new nonce; a refusal closes the connection and we leave."""
        self._policy = self._load_policy()  # the policy as it is now
        self._run(Attest(joining=False))
        print(f"{self.config.name}: re-attested the orchestrator", flush=True)

    def drop_orchestrator(self) -> None:
        """Close the link to the orchestrator: whatever travel or attestation ran on it is over."""
        if self.orchestrator is not None:
            self.orchestrator.close()
        self.orchestrator = None
        self.sm.abort()

    def handle(self, msg: object) -> None:
        """One message from the orchestrator (a Bye is the caller's to handle)."""
        if isinstance(msg, AttestDue):  # between travels, with the GPU home
            self.reattest()
        elif isinstance(msg, TravelRequest):
            self.serve_travel(msg)
        elif isinstance(msg, SendChunk):  # the centralised TLS baseline (paper 7.2)
            self.send_baseline(msg)
        elif isinstance(msg, JobResults):  # the job is done: its metrics, and the release to sign or not
            self.answer_results(msg)

    def answer_results(self, msg: JobResults) -> None:
        """Sign the release of the job we attested and approved, or decline it; numbers only are logged."""
        from gputravel.holder.release import answer_results, summary  # lazy: the manifest, at the job's end

        job = self.attestation.job_digest if self.attestation is not None else None
        key = CohortPki.load(self.config.pki_dir).member(self.config.name).key_pem
        reply = answer_results(msg, name=self.config.name, attested_job=job, key_pem=key,
                               sign=self.config.sign_release)
        print(f"{self.config.name}: the job is done: {summary(msg.metrics)}", flush=True)
        verdict = "signed the release" if isinstance(reply, ReleaseSigned) else f"declined the release: {reply.reason}"
        print(f"{self.config.name}: {verdict}", flush=True)
        assert self.orchestrator is not None
        self.orchestrator.send(reply)

    def serve_travel(self, req: TravelRequest) -> None:
        self._run(Request(req))

    def send_baseline(self, msg: SendChunk) -> None:
        """The TLS baseline (paper 7.2): plaintext leaves, so only to a freshly attested orchestrator."""
        self.sm.handle(BaselineAsked(), self._clock())
        assert self.orchestrator is not None
        send_chunk(self.dataset.view, self.piece_bytes, self.orchestrator, msg, self.profile, self.dataset.held_base)

    # ------------------------------------------------------------------ the loop
    def _run(self, event: object) -> None:
        now = self._clock()
        self._drive(self.sm.handle(event, now), now)

    def _drive(self, act: object, now: float) -> None:
        """Carry out each action the machine returns (``ACTIONS``) and tell it how each ended, until
        it has nothing to do. A step's GputravelError is the machine's to judge; any other goes up."""
        while act is not None:
            try:
                event = self.ACTIONS[type(act)](self, act, self.sm.time_left(now))
            except GputravelError as exc:
                now = self._clock()
                act = self._failed(exc, now)
                continue
            now = self._clock()
            act = self.sm.handle(event, now)

    def _failed(self, exc: GputravelError, now: float) -> object:
        """A step failed: a timeout is the machine's to judge; any other failure refuses the travel
        where the machine still can (naming what is wrong, never a value), and otherwise goes up."""
        act = self.sm.on_timeout(now) if isinstance(exc, PeerTimeout) else None
        if act is not None:
            return act
        if not self.sm.accepts(StepFailed):
            raise exc
        return self.sm.handle(StepFailed(f"{type(exc).__name__}: {exc}"), now)

    # ------------------------------------------------------------------ one step each
    def _challenge(self, act: Challenge, timeout: float) -> Attested:
        assert self.orchestrator is not None and self._policy is not None
        self.attestation = self._challenge_orchestrator(self.orchestrator, self._policy, timeout=timeout)
        return Attested(self._policy.policy.max_evidence_age_s)

    def _introduce(self, act: Introduce, timeout: float | None) -> HelloAnswered:
        assert self.orchestrator is not None
        ds = self.dataset
        schema = ds.schema.canonical_json() if ds.schema is not None else ""
        self.orchestrator.send(HolderHello(self.config.name, ds.size, self.piece_bytes, self.sm.manifest, ds.tokenizer,
                                           schema, ds.train_records, ds.eval_records, probed=self.probed,
                                           log_key=self._log_key))
        answer = self.orchestrator.recv(timeout=timeout).message
        if isinstance(answer, ProbeNow) and not self.probed:  # a late holder: probe on the lent GPU first
            self._probe_lent_gpu()
            self.orchestrator.send(ProbeDone(holder=self.config.name))
            answer = self.orchestrator.recv(timeout=timeout).message
        return HelloAnswered(answer)

    def _probe_lent_gpu(self) -> None:
        """Paper 4.1 for a late holder: probe the GPU lent between travels, then give it back."""
        try:
            self.probe()
        finally:
            self.switch(ORCHESTRATOR)

    def _import_blob(self, act: ImportBlob, timeout: float | None) -> Imported:
        self.driver.import_context(act.blob)  # while the MUX switches the GPU to us
        return Imported()

    def _attach(self, act: AwaitGpu, timeout: float) -> Attached:
        self.mux.attached(timeout)
        return Attached()

    def _audit(self, act: AuditArrival, timeout: float) -> Audited:
        data = self.driver.copy_from_vram(act.buffer_offset, act.buffer_bytes, timeout=timeout)
        return Audited(act.buffer_bytes - data.count(0))

    def _check_buffer(self, act: CheckBuffer, timeout: float) -> Granted:
        return Granted(self.driver.query_buffer(act.buffer_offset, timeout=timeout).nbytes)

    def _copy_chunk(self, act: CopyChunk, timeout: float) -> Copied:
        chunk = self.dataset.view[act.dataset_offset : act.dataset_offset + act.nbytes]
        self.travels_served += 1
        if self.travels_served == self.config.die_mid_copy_on_travel:  # no goodbye, no context back
            if half := len(chunk) // 2:  # the GPU is left with half a chunk
                self.driver.copy_to_vram(chunk[:half], act.buffer_offset, buffer_bytes=act.granted_bytes,
                                         timeout=timeout)
            os._exit(70)
        with at_least(self.profile.copy_s(act.nbytes)):  # the hardware's dataset read, then GPU write
            self.driver.copy_to_vram(chunk, act.buffer_offset, buffer_bytes=act.granted_bytes, timeout=timeout)
        return Copied(act.nbytes)

    def _switch_back(self, act: SwitchBack, timeout: float | None) -> SwitchAsked:
        self.mux.request(ORCHESTRATOR)
        return SwitchAsked()

    def _export_blob(self, act: ExportBlob, timeout: float | None) -> Exported:
        return Exported(self.driver.export_context())

    def _send_reply(self, act: Reply, timeout: float | None) -> Replied:
        assert self.orchestrator is not None
        self.orchestrator.send(act.message)
        return Replied()

    def _await_switch_home(self, act: AwaitSwitchHome, timeout: float) -> SwitchedHome:
        self.mux.switched(timeout)
        return SwitchedHome()

    #: How each action is carried out: one IO step, one event. Its timeout is ``sm.time_left``
    #: (None in phases that do not wait).
    ACTIONS: dict[type, Callable[[Any, Any, Any], object]] = {
        Challenge: _challenge, Introduce: _introduce, ImportBlob: _import_blob, AwaitGpu: _attach,
        AuditArrival: _audit, CheckBuffer: _check_buffer, CopyChunk: _copy_chunk, SwitchBack: _switch_back,
        ExportBlob: _export_blob, Reply: _send_reply, AwaitSwitchHome: _await_switch_home,
    }


def _open(config: HolderConfig) -> tuple[Dataset, Transport, Driver, PcieMuxClient, bytes]:
    """What a holder CVM opens at boot, in order: its dataset, the host, and its travel-log key."""
    dataset = Dataset.of(config)
    host = connect_unix(config.host_socket, "host")
    driver = Driver(register_with_host(host, config.name, config.layout))
    mux = PcieMuxClient(host, config.name)
    if not config.pki_dir:  # "" would be the working directory
        raise BadInput("a holder needs its pki directory: its TLS key and its travel-log key live there")
    return dataset, host, driver, mux, own_log_key(Path(config.pki_dir))


def _connect_tls(config: HolderConfig, host: str, port: int) -> Transport:
    """Mutual TLS to the orchestrator (each join loads the cohort's PKI as it is then)."""
    ctx = CohortPki.load(config.pki_dir).client_context(config.name)
    return connect_tls(host, port, ctx, server_hostname=ORCHESTRATOR)


def serve(config: HolderConfig, control: Transport) -> None:
    holder = DataHolder.from_config(config)
    holder.boot()
    control.send(Ready(role=config.name, detail={"dataset_bytes": holder.dataset.size}))
    sel = selectors.DefaultSelector()
    sel.register(control.fileno(), selectors.EVENT_READ, "control")
    while True:
        for key, _ in sel.select():
            if key.data == "control":
                cmd = control.recv().message
                if isinstance(cmd, Shutdown):
                    return
                if isinstance(cmd, HOLDER_COMMANDS):  # late probe, leave (orchestrator/membership.py)
                    holder_command(holder, cmd, control, sel)
                if isinstance(cmd, JoinCohort):
                    if not join_cohort(holder, cmd, control):  # refused: reported, still out
                        continue
                    assert holder.orchestrator is not None
                    pace(holder.orchestrator, config.pace_mbit)
                    sel.register(holder.orchestrator.fileno(), selectors.EVENT_READ, "orchestrator")
            elif not _serve_orchestrator(holder, sel):
                return


def _serve_orchestrator(holder: DataHolder, sel: selectors.BaseSelector) -> bool:
    """Take one message from the orchestrator. False: the cohort is over for this process. A broken
    link, or a travel that fails here, leaves the cohort; the holder stays up and may rejoin."""
    conn = holder.orchestrator
    assert conn is not None
    try:
        msg = conn.recv(timeout=holder.sm.deadlines.orchestrator).message  # once it is arriving, a whole one
    except TransportClosed:
        return False
    except (ProtocolError, PeerTimeout) as exc:
        return _leave_after(holder, sel, f"the orchestrator's link failed ({type(exc).__name__}: {exc})")
    if isinstance(msg, Bye):
        return False
    try:
        holder.handle(msg)
    except TransportClosed:
        return False
    except GputravelError as exc:
        return _leave_after(holder, sel, f"{type(msg).__name__} failed ({type(exc).__name__}: {exc})")
    return True


def _leave_after(holder: DataHolder, sel: selectors.BaseSelector, why: str) -> bool:
    conn = holder.orchestrator
    assert conn is not None
    print(f"{holder.config.name}: left the cohort: {why}", flush=True)
    sel.unregister(conn.fileno())
    holder.drop_orchestrator()
    return True
