"""A data holder CVM: boots first, keeps its dataset, serves travel requests.

The dataset is mapped once at boot (page tables populated, as a holder CVM keeps its data
resident) and its manifest computed; during a travel, records are encrypted straight from
that mapping into the staging slots (zero-copy on the holder side).
"""

from __future__ import annotations

import mmap
import os
import selectors
import time
from dataclasses import dataclass

from gputravel.crypto.pki import CohortPki
from gputravel.driver.driver import Driver
from gputravel.driver.link import PcieMuxClient, register_with_host
from gputravel.errors import (
    BadInput,
    GputravelError,
    IllegalTransition,
    PeerTimeout,
    ProtocolError,
    TransportClosed,
)
from gputravel.protocol.layout import Layout
from gputravel.protocol.travel import Bye, HolderHello, TravelRequest, Welcome
from gputravel.holder.machine import CopyChunk, ExportBlob, HolderTravel, ImportBlob, Reply, SwitchBack
from gputravel.protocol.manifest import PIECE_BYTES, piece_digests
from gputravel.transport.base import Transport
from gputravel.transport.stream import connect_unix
from gputravel.transport.tls import connect_tls
from gputravel.attest import AttestationError, AttestDue, OrchestratorAttestation
from gputravel.orchestrator.attester import challenge_orchestrator
from gputravel.orchestrator.baseline import SendChunk, send_chunk
from gputravel.protocol.control import JoinCohort, Ready, Shutdown
from gputravel.cohort.links import pace
from gputravel.orchestrator.membership import HOLDER_COMMANDS, holder_command
from gputravel.orchestrator.membership import join as join_cohort
from gputravel.cohort.trust import HolderMaterial

ORCHESTRATOR = "orchestrator"


@dataclass(frozen=True)
class HolderConfig:
    name: str
    dataset_path: str
    host_socket: str
    pki_dir: str
    layout: Layout
    device_timeout: float = 30.0
    audit_arrival: bool = False  # read the buffer back on arrival and count non-zero bytes
    dataset_format: str = "raw"  # "raw": the file's bytes; "tokens": llm.c shards or text, as uint16 tokens
    # Fault injection for tests and the red team: on this travel (1-based), die half-way
    # through the copy, as a CVM that crashes or is killed would. 0: never.
    die_mid_copy_on_travel: int = 0
    pace_mbit: float | None = None  # token-bucket links: pace what we send the orchestrator to this rate
    trust_dir: str = ""  # the roots and this holder's policy (cohort/trust.py); required to join
    probe_at_boot: bool = True  # False: a late holder, probing when the orchestrator lends it the GPU


class Dataset:
    """A holder's dataset, mapped read-only once.

    A "tokens" dataset (a directory of llm.c shards, one shard, or text) is the concatenation
    of its shards' tokens, without headers, in shard order; it is laid out once at boot in the
    CVM's private memory, so travels copy from it without touching the files again.
    """

    def __init__(self, path: str, fmt: str = "raw") -> None:
        self.tokenizer = ""
        self._map: mmap.mmap | None = None
        if fmt == "tokens":
            self._load_tokens(path)
        elif fmt == "raw":
            self._load_raw(path)
        else:
            raise BadInput(f"unknown dataset format {fmt!r}: use 'raw' or 'tokens'")
        self.view = memoryview(self._map) if self._map is not None else memoryview(b"")

    def _load_raw(self, path: str) -> None:
        if not os.path.isfile(path):
            raise BadInput(f"dataset {path!r} does not exist or is not a file")
        self.size = os.path.getsize(path)
        if self.size:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), self.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)

    def _load_tokens(self, path: str) -> None:
        from gputravel.data.shards import load_tokens

        loaded = load_tokens(path)
        data = loaded.tokens.astype("<u2", copy=False).tobytes()
        self.tokenizer = loaded.tokenizer
        self.size = len(data)
        if self.size:
            self._map = mmap.mmap(-1, self.size)
            self._map.write(data)


class DataHolder:
    def __init__(self, config: HolderConfig) -> None:
        self.config = config
        self.dataset = Dataset(config.dataset_path, config.dataset_format)
        self.host = connect_unix(config.host_socket, "host")
        self.driver = Driver(register_with_host(self.host, config.name, config.layout))
        self.mux = PcieMuxClient(self.host, config.name)
        # Manifest pieces must tile any buffer the orchestrator may have: buffers are whole
        # records, so pieces are at most one record.
        self.piece_bytes = min(PIECE_BYTES, config.layout.record_bytes)
        self.sm = HolderTravel(config.name, self.dataset.size, piece_digests(self.dataset.view, self.piece_bytes),
                               self.piece_bytes)
        self.orchestrator: Transport | None = None
        self.travels_served = 0
        self.attested_at = 0.0  # time.monotonic() of our last attestation of the orchestrator
        self.attestation_valid_s = 0.0  # the policy's evidence age limit, when we last attested

    def boot(self) -> None:
        """Paper 4.1: set up the driver while this CVM has the GPU, before the orchestrator boots."""
        if not self.config.probe_at_boot:
            return  # a late holder: it probes when the orchestrator lends it the GPU (orchestrator/membership.py)
        self.switch(self.config.name)
        self.driver.probe(timeout=self.config.device_timeout)

    def switch(self, target: str) -> int:
        return self.mux.switch(target, self.config.device_timeout).elapsed_ns

    def join(self, host: str, port: int) -> OrchestratorAttestation:
        """Connect, attest the orchestrator against our policy (paper 4.5, CPU phase: every
        join, rejoins included), and only then introduce ourselves."""
        if self.orchestrator is not None:
            raise IllegalTransition(self.config.name, "joined", "join again before leaving")
        material = HolderMaterial.load(self.config.trust_dir)
        ctx = CohortPki.load(self.config.pki_dir).client_context(self.config.name)
        conn = connect_tls(host, port, ctx, server_hostname=ORCHESTRATOR)
        attestation = challenge_orchestrator(conn, material, timeout=30)  # closes conn if refused
        self.attested_at = time.monotonic()
        self.attestation_valid_s = material.policy.max_evidence_age_s
        try:
            conn.send(HolderHello(self.config.name, self.dataset.size, self.piece_bytes, self.sm.manifest,
                                  self.dataset.tokenizer))
            answer = conn.recv(timeout=30).message
            if not isinstance(answer, Welcome):
                why = f": {answer.reason}" if isinstance(answer, Bye) else ""
                raise ProtocolError(f"orchestrator did not welcome us{why}")
        except GputravelError:
            conn.close()
            raise
        self.orchestrator = conn
        return attestation

    def reattest(self) -> None:
        """Paper 4.5: evidence has a lifetime. The orchestrator sends `AttestDue` between
        travels, with the GPU home, once half our policy's age limit has passed (we told it
        so when we last accepted it); we attest it again on this connection: a fresh quote and
        fresh GPU evidence, both for a new nonce of ours. A refusal closes the connection
        (challenge_orchestrator): this holder leaves the cohort and stays up."""
        material = HolderMaterial.load(self.config.trust_dir)  # the policy as it is now
        assert self.orchestrator is not None
        challenge_orchestrator(self.orchestrator, material, timeout=30)
        self.attested_at = time.monotonic()
        self.attestation_valid_s = material.policy.max_evidence_age_s
        print(f"{self.config.name}: re-attested the orchestrator", flush=True)

    def check_attested(self) -> None:
        """Before we touch a context: our attestation of the orchestrator is within our
        policy's age limit. An orchestrator that never asked us to re-attest is left."""
        age = time.monotonic() - self.attested_at
        if age > self.attestation_valid_s:
            raise AttestationError("expired", f"our attestation of the orchestrator is {age:.0f} s old; the "
                                              f"policy allows {self.attestation_valid_s:.0f} s and it did not "
                                              "let us attest it again")

    def serve_travel(self, req: TravelRequest) -> None:
        self.check_attested()
        clock = time.perf_counter
        act = self.sm.on_request(req, clock())
        if isinstance(act, ImportBlob):  # while the MUX switches the GPU to us
            try:
                self.driver.import_context(act.blob)
            except GputravelError as exc:  # refuse; the error names what is wrong, never a value
                self.sm.import_failed(f"{type(exc).__name__}: {exc}", clock())
            else:
                self.sm.imported(clock())
        act = self._await_gpu(clock)
        if isinstance(act, CopyChunk):
            act = self._copy(act, clock)
        assert isinstance(act, SwitchBack)
        self.go_home(clock)

    def _await_gpu(self, clock):
        try:
            self.mux.attached(self.config.device_timeout)
        except GputravelError as exc:
            return self.sm.attach_failed(f"the GPU never came: {type(exc).__name__}: {exc}", clock())
        return self.sm.attached(clock())

    def go_home(self, clock, returned=None) -> bytes:
        """Ask for the switch home, export the context while it runs, reply at once (the
        orchestrator imports while the MUX switches), then take the host's answer.
        ``returned`` (red team only) picks the blob handed back. Returns the exported blob."""
        self.mux.request(ORCHESTRATOR)
        act = self.sm.switch_requested(clock())
        blob = b""
        if isinstance(act, ExportBlob):
            blob = self.driver.export_context()
            act = self.sm.exported(returned(blob) if returned else blob, clock())
        assert isinstance(act, Reply)
        assert self.orchestrator is not None
        self.orchestrator.send(act.message)
        self.mux.switched(self.config.device_timeout)
        return blob

    def _copy(self, act: CopyChunk, clock):
        try:
            if self.config.audit_arrival:  # in here: a fault during the audit refuses the travel too
                self.sm.audited(self._audit(act))
            info = self.driver.query_buffer(act.buffer_offset, timeout=self.config.device_timeout)
            if info.nbytes < act.buffer_bytes:
                raise BadInput(f"the device buffer holds {info.nbytes} bytes, the request claims {act.buffer_bytes}")
            chunk = self.dataset.view[act.dataset_offset : act.dataset_offset + act.nbytes]
            self.travels_served += 1
            if self.travels_served == self.config.die_mid_copy_on_travel:
                self._die_mid_copy(chunk, act.buffer_offset, info.nbytes)
            self.driver.copy_to_vram(chunk, act.buffer_offset, buffer_bytes=info.nbytes, timeout=self.config.device_timeout)
        except GputravelError as exc:
            return self.sm.copy_failed(f"{type(exc).__name__}: {exc}", clock())
        return self.sm.copied(act.nbytes, clock())

    def _die_mid_copy(self, chunk: memoryview, buffer_offset: int, buffer_bytes: int) -> None:
        half = len(chunk) // 2
        if half:
            self.driver.copy_to_vram(chunk[:half], buffer_offset, buffer_bytes=buffer_bytes,
                                     timeout=self.config.device_timeout)
        os._exit(70)  # no goodbye, no context back: the GPU is left with half a chunk

    def _audit(self, act: CopyChunk) -> int:
        data = self.driver.copy_from_vram(act.buffer_offset, act.buffer_bytes, timeout=self.config.device_timeout)
        return act.buffer_bytes - data.count(0)


def serve(config: HolderConfig, control: Transport) -> None:
    holder = DataHolder(config)
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
    """Take one message from the orchestrator. False: the cohort is over for this process.

    An orchestrator that sends garbage or stalls mid-message is left (the connection is
    dropped, and the holder stays up, out of the cohort, as after a refused join); it has been
    attested, so this is a fault, not an attack we can do anything more about. So is a travel
    that fails here (the host refusing the switch home, say): the orchestrator recovers the
    GPU on its side, and this holder may be told to join again."""
    conn = holder.orchestrator
    assert conn is not None
    try:
        msg = conn.recv(timeout=30).message
    except TransportClosed:
        return False
    except (ProtocolError, PeerTimeout) as exc:
        return _leave_after(holder, sel, f"the orchestrator's link failed ({type(exc).__name__}: {exc})")
    if isinstance(msg, Bye):
        return False
    try:
        if isinstance(msg, AttestDue):  # between travels, with the GPU home
            holder.reattest()
        elif isinstance(msg, TravelRequest):
            holder.serve_travel(msg)
        elif isinstance(msg, SendChunk):  # the centralised TLS baseline (paper 7.2)
            holder.check_attested()  # plaintext leaves here: only to an orchestrator attested in time
            send_chunk(holder.dataset.view, holder.piece_bytes, conn, msg)
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
    conn.close()
    holder.orchestrator = None
    return True
