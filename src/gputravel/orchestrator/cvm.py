"""The orchestrator CVM's engine: boots last, owns the session with the GPU, and carries out the
actions its travel machine (orchestrator/machine.py) returns, one IO step each."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import mmap
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, Self

from gputravel.crypto.pki import CohortPki
from gputravel.driver.link import PcieMuxClient, register_with_host
from gputravel.driver.orchestrator import OrchestratorDriver
from gputravel.errors import (BadInput, ContextBlobError, ContextRefused, GputravelError, HolderLost, PeerTimeout,
                              ProtocolError, RemoteError, TransportClosed, TravelHalted)
from gputravel.protocol.hardware import hardware_profile, hold_exchange
from gputravel.protocol.layout import Layout
from gputravel.protocol.travel import Bye, HolderHello, TravelRefused, TravelResult, Welcome
from gputravel.protocol.device import VramGrant, VramRequest
from gputravel.protocol.manifest import chunk_digest
from gputravel.protocol.parties import ORCHESTRATOR
from gputravel.orchestrator.machine import (
    AwaitGpu, AwaitReply, AwaitRotation, AwaitScrub, AwaitSwitch, Buffer, Deadlines, ExportContext, Exported, Home,
    ImportContext, Imported, OrchestratorTravel, Replied, RequestSent, Rotated, RotationStarted, Scrubbed,
    ScrubStarted, SendRequest, Start, StartRotation, StartScrub, SwitchAsked, Switched, SwitchTo, Verified,
    VerifyChunk,
)
from gputravel.transport.base import Transport
from gputravel.transport.stream import StreamTransport
from gputravel.transport.unix import connect_unix
from gputravel.transport.tls import TlsListener
from gputravel.orchestrator.attester import GpuAttester, TlsIdentity, orchestrator_attester
from gputravel.orchestrator.job import job_digest
from gputravel.orchestrator.baseline import BaselinePath
from gputravel.protocol.control import BaselineReport, TravelReport
from gputravel.net.pace import pace
from gputravel.orchestrator.travel_log import TravelLog
from gputravel.attest.material import utcnow

NAME = ORCHESTRATOR
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OrchestratorConfig:
    host_socket: str
    pki_dir: str
    layout: Layout
    buffer_bytes: int
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    holder_timeout: float = 60.0
    device_timeout: float = 10.0
    verify: bool = True
    tokenizer: str = ""  # when set, holders whose tokens were made by another tokenizer are refused
    # The record schema the job expects (data/records.py, canonical JSON); "": tokens. Holders
    # holding records of another schema, or tokens where records are expected, are refused.
    schema: str = ""
    pace_mbit: float | None = None  # token-bucket links: pace each holder connection to this rate
    trust_dir: str = ""  # roots, GPU reference values, where its TDX module listens (cohort/trust.py); required
    audit_log: str = ""  # where the signed travel log goes (orchestrator/travel_log.py); "": none
    hardware: str = "emulated"  # protocol/hardware.py: floors on the context exchange and the baseline's write
    # The one job it runs (TrainConfig.canonical_json; "": any) and its manifest (gputravel.manifest,
    # canonical JSON; "": none): not in its measurement but extended into RTMR[3] at boot, as one
    # digest (orchestrator/job.py), which holders approve.
    job_json: str = ""
    manifest_json: str = ""
    # The key broker (broker/) that seals its checkpoints and model: where it listens (placement), and
    # its identity (P-384 SubjectPublicKeyInfo, hex; measured: a broker of another key is refused).
    broker_socket: str = ""
    broker_key: str = ""
    # SHA-384 of the trust anchors its holders' certificates chain to (orchestrator/release.py
    # anchors_digest; "": unbound). Measured: a job with a manifest counts release signatures only
    # under them, so an operator's own CA for invented holders is another measurement.
    anchors_sha384: str = ""


class Listener(Protocol):
    """Where holders connect; ``accept`` names the holder as its verified certificate does."""

    port: int

    def accept(self, timeout: float | None = None) -> tuple[Transport, str]: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...


def _refuse(conn: Transport, reason: str, error: GputravelError) -> NoReturn:
    conn.send(Bye(reason=reason))
    raise error


def _unfit_schema(peer: str, want: str, hello: HolderHello) -> str:
    """Why a holder saying `hello` cannot join a job expecting schema `want` ("": tokens), or ""."""
    from gputravel.data.records import RecordSchema  # lazy: numpy, for records only

    got = hello.schema
    if not got:
        held = f"{hello.tokenizer!r} tokens" if hello.tokenizer else "raw bytes"
        return (f"holder {peer!r} holds {held}, this cohort trains on records "
                f"({RecordSchema.from_json(want).text()}): pack its data with `gputravel data pack`")
    try:
        theirs = RecordSchema.from_json(got)
    except BadInput as exc:
        return f"holder {peer!r} announced a schema that is refused: {exc}"
    if not want:
        return (f"holder {peer!r} holds records ({theirs.text()}), this cohort trains on tokens: "
                "give it token shards or text, or start the job with the records' schema")
    diff = RecordSchema.from_json(want).difference(theirs)
    return f"holder {peer!r} holds records of another schema: {diff}" if diff else ""


class Orchestrator:
    """The travelling engine: one dataset buffer, one travel at a time; built with its links open."""

    _clock = staticmethod(time.perf_counter)  # the one clock the machine is told (step timings, deadlines)

    def __init__(self, config: OrchestratorConfig, *, host: Transport, driver: OrchestratorDriver,
                 mux: PcieMuxClient, device: Transport, listener: Listener, log_key: bytes,
                 attester: Callable[[OrchestratorConfig], GpuAttester] | None = None) -> None:
        if config.buffer_bytes <= 0 or config.buffer_bytes % config.layout.record_bytes:
            raise BadInput("the dataset buffer must be a positive multiple of the record size (1 MiB by default)")
        if config.schema:  # a malformed one stops the boot, not the first holder's join
            from gputravel.data.records import RecordSchema  # lazy: numpy, for records only

            try:
                RecordSchema.from_json(config.schema)
            except BadInput as exc:
                raise BadInput(f"the job's schema: {exc}") from None
        self.config = config
        self.host, self.driver, self.mux, self._device, self.listener = host, driver, mux, device, listener
        self.profile, self._request_sent = hardware_profile(config.hardware), 0.0
        self.holders: dict[str, Transport] = {}
        self.vram: mmap.mmap | None = None
        self.travel_sm: OrchestratorTravel | None = None
        self._log_key, self._make_attester = log_key, attester  # both used at boot
        self.travel_log: TravelLog | None = None  # opened at boot, once the GPU it names is attested
        self.baseline_path = BaselinePath(self)  # its staging buffer is made at its first transfer

    @classmethod
    def from_config(cls, config: OrchestratorConfig, device_link: socket.socket) -> Self:
        """The CVM's own links: the host (registered with), the device's, TLS for holders."""
        pki = CohortPki.load(config.pki_dir)  # before anything is opened
        identity = TlsIdentity.of_member(pki.member(NAME))
        with contextlib.ExitStack() as opened:  # a step that fails closes what the steps before it opened
            host = connect_unix(config.host_socket, "host")
            opened.callback(host.close)
            link = register_with_host(host, NAME, config.layout)
            opened.callback(link.close)
            listener = TlsListener(config.listen_host, config.listen_port, pki.server_context(NAME))
            opened.callback(listener.close)
            engine = cls(config, host=host, driver=OrchestratorDriver(link), mux=PcieMuxClient(host, NAME),
                         device=StreamTransport(device_link, "device-link"), listener=listener,
                         log_key=pki.member(NAME).key_pem,
                         attester=lambda c: orchestrator_attester(c.trust_dir, identity, job_digest(c)))
            opened.pop_all()
        return engine

    # ------------------------------------------------------------------ boot
    def boot(self) -> None:
        """Paper 4.1: the orchestrator boots last, attests and keys the GPU, allocates its buffer."""
        self.switch(NAME)
        # Paper 4.5, GPU phase: an AttestationError (naming the claim) stops the boot here. Making the
        # attester extends RTMR[3] with the job, before any quote: an unreachable TDX module stops it too.
        assert self._make_attester is not None, "from_config gives the engine its attester"
        self.attester: GpuAttester = self._make_attester(self.config)
        self.attester.open_session(self.driver, utcnow(), self.config.device_timeout)
        if self.config.audit_log:  # its entries name the GPU just attested (re-keys keep it)
            assert self.attester.gpu is not None
            self.travel_log = TravelLog(self.config.audit_log, self._log_key, self.attester.gpu)
        self._device.send(VramRequest())
        grant = self._device.recv(timeout=self.config.device_timeout)
        if not isinstance(grant.message, VramGrant) or len(grant.fds) != 1:
            raise ProtocolError("device did not grant VRAM")
        self.vram = mmap.mmap(grant.fds[0], grant.message.vram_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        buf = self.driver.alloc_dataset_buffer(self.config.buffer_bytes, timeout=self.config.device_timeout)
        deadlines = Deadlines(device=self.config.device_timeout, holder=self.config.holder_timeout)
        self.travel_sm = OrchestratorTravel(Buffer(buf.offset, buf.nbytes), deadlines, verify=self.config.verify)

    def rekey(self) -> None:
        """Fail-closed recovery: a new SPDM session, verified as at boot; TravelHalted if it fails."""
        assert self.travel_sm is not None
        try:
            self.switch(NAME)
            self.attester.open_session(self.driver, utcnow(), self.config.device_timeout)
            buf = self.driver.alloc_dataset_buffer(self.config.buffer_bytes, timeout=self.config.device_timeout)
        except GputravelError as exc:
            self._halt(f"the GPU could not be re-keyed by a new SPDM session ({type(exc).__name__}: {exc}); "
                       "no travel is possible: stop the cohort")
        if (buf.offset, buf.nbytes) != (self.travel_sm.buffer.offset, self.travel_sm.buffer.nbytes):
            self._halt("the re-keyed GPU placed the dataset buffer elsewhere: stop the cohort")
        log.warning("re-keyed the GPU through a new SPDM session (VRAM wiped)")

    def _halt(self, why: str) -> NoReturn:
        """A failed re-key: the driver may hold either session's keys, so it is halted first."""
        self.driver.ledger.halt(why)
        raise TravelHalted(why) from None

    def switch(self, target: str) -> int:
        return self.mux.switch(target, self.config.device_timeout).elapsed_ns

    # ------------------------------------------------------------------ cohort
    def accept_holder(self, timeout: float, probe: Callable[[str, Transport], None] | None = None) -> str:
        """Admit one holder: it attests us and introduces itself; a late one is lent the GPU via ``probe``."""
        conn, peer = self.listener.accept(timeout=timeout)
        try:  # paper 4.5, CPU phase: the holder attests us before it says anything else
            named = self._named_certificate(peer)
            if named is None:  # the manifest names each holder's certificate, and none under this name
                _refuse(conn, "the job's manifest names no certificate for this holder",
                        ProtocolError(f"holder {peer!r} is not a holder the job's manifest names a certificate for "
                                      "(release.certificates)"))
            if named and hashlib.sha384(conn.peer_certificate()).hexdigest() != named:
                # ca.pem is the host's to write: an extra certificate under a holder's name joins no job
                _refuse(conn, "this certificate is not the one the job's manifest names for this holder",
                        ProtocolError(f"holder {peer!r} connected with a certificate other than the one the "
                                         "job's manifest names for it (release.certificates)"))
            self.attester.serve_challenge(conn, self.driver, timeout, self._clock())
            hello = conn.recv(timeout=timeout).message
            if not isinstance(hello, HolderHello) or hello.holder != peer:
                _refuse(conn, "the first message must be a hello naming the certificate's holder",
                        ProtocolError(f"holder {peer!r} did not introduce itself correctly"))
            reason = self._unfit(peer, hello)
            if reason:
                _refuse(conn, reason, BadInput(reason))
            assert self.travel_sm is not None
            try:
                self.travel_sm.enrol(hello)
            except GputravelError as exc:  # a bad manifest or piece size: refused like any bad hello
                _refuse(conn, str(exc), exc)
            if not hello.probed:
                if probe is None:
                    _refuse(conn, "the GPU cannot be lent for a probe here: boot before the orchestrator",
                            BadInput(f"holder {peer!r} has not probed the GPU and cannot be lent it now"))
                probe(peer, conn)
        except BaseException:
            conn.close()
            raise
        self.drop(peer)  # the link it joined with before, if any
        self.holders[peer] = conn
        if self.travel_log is not None and not self.travel_log.closed:  # it accepted the job in our RTMR[3]
            self.travel_log.approved(peer, self.attester.job_digest)
        conn.send(Welcome(cohort=NAME))
        pace(conn, self.config.pace_mbit)  # once, from its start: pacing again would give a fresh burst
        return peer

    def _unfit(self, peer: str, hello: HolderHello) -> str:
        """Why `peer`'s data is not what this job trains on (records of its schema, or tokens of
        its tokenizer), in words naming the holder and the field; "" if it is."""
        if self.config.schema or hello.schema:
            return _unfit_schema(peer, self.config.schema, hello) or self._unfit_split(peer, hello)
        want = self.config.tokenizer
        if want and hello.tokenizer != want:
            return (f"holder {peer!r} tokenized its data with {hello.tokenizer or 'no tokenizer (raw bytes)'!r}, "
                    f"this cohort trains on {want!r} tokens: re-run `gputravel data prepare --tokenizer {want}`")
        return ""

    @functools.cached_property
    def _manifest(self) -> Any:
        """The job's manifest (gputravel.manifest.JobManifest), read once; None: a job without one."""
        if not self.config.manifest_json:
            return None
        from gputravel.manifest import JobManifest  # lazy: pydantic, for manifest jobs only

        return JobManifest.from_json(self.config.manifest_json)

    def _named_certificate(self, peer: str) -> str | None:
        """The SHA-384 (hex) of the certificate the manifest names for `peer`; "" where it names no
        certificate at all (a local cohort's CA vouches); None where it names others but not `peer`'s."""
        named = {} if self._manifest is None else self._manifest.release.certificates
        return named.get(peer) if named else ""

    def _unfit_split(self, peer: str, hello: HolderHello) -> str:
        """Why `peer`'s held-out split is not the one the job's manifest states (issue 28), or ""."""
        if self._manifest is None:
            return ""
        share = self._manifest.evaluation.share
        total = hello.train_records + hello.eval_records
        if hello.eval_records != round(total * share):
            return (f"holder {peer!r} holds out {hello.eval_records} of its {total} records; the job's manifest "
                    f"says a share of {share:g} ({round(total * share)}): set its eval_share to {share:g}")
        return ""

    def await_holders(self, names: tuple[str, ...], timeout: float,
                      probe: Callable[[str, Transport], None] | None = None,
                      stop: tuple[int, Callable[[], bool]] | None = None) -> dict[str, int] | None:
        """Admit `names`; None if `stop` (a descriptor, and whether what it says asks us to stop) did
        first: a launcher that saw a holder refuse us stops us while we wait for it."""
        deadline, broken = time.monotonic() + timeout, ""
        while not set(names) <= set(self.holders):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(names) - set(self.holders))
                last = f" (the last connection that broke off: {broken})" if broken else ""
                raise PeerTimeout(f"holders did not join in {timeout:g} s: {', '.join(missing)}{last}")
            if stop is not None:
                ready = select.select([self.listener.fileno(), stop[0]], [], [], left)[0]
                if stop[0] in ready and stop[1]():
                    return None
                if self.listener.fileno() not in ready:
                    continue
            try:
                self.accept_holder(left, probe)
            except PeerTimeout:  # every wait in a join runs to the deadline: said above, with who is missing
                continue
            except TransportClosed as exc:  # its CVM went away mid-join (it tries again); a refusal stops
                broken = str(exc)
                log.warning("a holder's connection broke off while it joined: %s", exc)
        assert self.travel_sm is not None
        return {n: self.travel_sm.holders[n].dataset_bytes for n in self.holders}

    # ------------------------------------------------------------------ the travel cycle
    def travel(self, holder: str, dataset_offset: int) -> TravelReport:
        """One travel (paper Fig. 3), logged when it completes or a remote party makes it fail."""
        travel_log = self.travel_log
        if travel_log is None:
            return self._travel(holder, dataset_offset)
        travel_log.check_open()
        before = self.driver.epoch or 0
        try:
            report = self._travel(holder, dataset_offset)
        except RemoteError:
            travel_log.aborted(holder, dataset_offset, before, self.driver.epoch or 0)
            raise
        assert self.travel_sm is not None
        key = self.travel_sm.holders[holder].log_key  # the holder's travel-log key, from its hello
        travel_log.travelled(report, dataset_offset, before, self.driver.epoch or 0, key)
        return report

    def job_done(self) -> None:
        """Sign the travel log's closing entry, so a log cut short of it reads as not closed."""
        if self.travel_log is not None and not self.travel_log.closed:
            self.travel_log.job_done(self.driver.epoch or 0)

    def _travel(self, holder: str, dataset_offset: int) -> TravelReport:
        """Carry out the machine's actions until it reports; on any failure, recover the GPU first."""
        sm, drv = self.travel_sm, self.driver
        assert sm is not None
        if holder in sm.holders and holder not in self.holders:
            raise HolderLost(holder, "it is offline (not connected); it may join again")
        if not drv.epoch_fresh:  # the orchestrator copied under it (baseline), or travel halted
            self._fresh_epoch()
        self._attest_before(holder)
        now = self._clock()
        try:
            act = sm.handle(Start(holder, dataset_offset), now)
        except Exception:
            sm.abort()  # refused before anything moved: nothing to recover
            raise
        try:
            while not isinstance(act, TravelReport):
                try:
                    event = self.ACTIONS[type(act)](self, act, sm.time_left(now))
                except PeerTimeout:
                    sm.on_timeout(self._clock())  # past its deadline, the machine gives the travel up
                    raise
                now = self._clock()
                act = self._handle(event, now, holder)
            return act
        except Exception:
            sm.abort()
            self._recover()  # raises TravelHalted if the GPU can neither rotate nor be re-keyed
            raise

    def _handle(self, event: object, now: float, holder: str) -> object:
        assert self.travel_sm is not None
        try:
            return self.travel_sm.handle(event, now)
        except ProtocolError:
            if isinstance(event, Replied):  # the holder broke the protocol: its link is out of step
                self.drop(holder)
            raise

    # ------------------------------------------------------------------ one step each
    def _start_scrub(self, act: StartScrub, timeout: float) -> ScrubStarted:
        return ScrubStarted(self.driver.start_scrub(act.offset, act.nbytes, timeout=timeout))

    def _export(self, act: ExportContext, timeout: float | None) -> Exported:
        return Exported(self.driver.export_for_travel())  # while the device scrubs

    def _await_scrub(self, act: AwaitScrub, timeout: float) -> Scrubbed:
        return Scrubbed(self.driver.finish_scrub(act.release, timeout=timeout))  # a new blob if the device moved on

    def _switch_to(self, act: SwitchTo, timeout: float | None) -> SwitchAsked:
        self.mux.request(act.holder)
        return SwitchAsked()

    def _send_request(self, act: SendRequest, timeout: float | None) -> RequestSent:
        try:
            self._request_sent = self._clock()
            self.holders[act.holder].send(act.request)
        except (TransportClosed, PeerTimeout, ProtocolError) as exc:
            self.drop(act.holder)
            raise HolderLost(act.holder, f"{type(exc).__name__}: {exc}") from None
        return RequestSent()

    def _await_switch(self, act: AwaitSwitch, timeout: float) -> Switched:
        try:
            self.mux.switched(timeout)
        except GputravelError:  # the holder has the request but may never get the GPU:
            self.drop(act.holder)  # its state is unknown, so it is dropped (it may join again)
            raise
        return Switched()

    def _await_reply(self, act: AwaitReply, timeout: float | None) -> Replied:
        try:
            reply = self.holders[act.holder].recv(timeout=timeout, expect=(TravelResult, TravelRefused)).message
        except (TransportClosed, PeerTimeout, ProtocolError) as exc:
            self.drop(act.holder)
            raise HolderLost(act.holder, f"{type(exc).__name__}: {exc}") from None
        hold_exchange(self.profile, self._request_sent, reply.steps_ns.get("handler", 0) / 1e9, clock=self._clock)  # the hardware's TLS
        return Replied(reply)

    def _await_gpu(self, act: AwaitGpu, timeout: float) -> Home:
        self.mux.attached(timeout)  # the holder asked for the switch home before it exported
        return Home()

    def _start_rotation(self, act: StartRotation, timeout: float) -> RotationStarted:
        self.driver.start_rotation(timeout=timeout)
        return RotationStarted()

    def _import(self, act: ImportContext, timeout: float | None) -> Imported:
        """A holder that returns a context it could not have is dropped; the rotation recovers."""
        try:
            self.driver.import_returned(act.blob)
        except ContextBlobError as exc:
            self.drop(act.holder)
            raise ContextRefused(act.holder, str(exc)) from None
        return Imported()

    def _await_rotation(self, act: AwaitRotation, timeout: float) -> Rotated:
        self.driver.finish_rotation(timeout=timeout)
        return Rotated()

    def _verify(self, act: VerifyChunk, timeout: float | None) -> Verified:
        assert self.vram is not None
        with memoryview(self.vram)[act.offset : act.offset + act.nbytes] as view:
            return Verified(chunk_digest(view, act.piece_bytes))

    #: Each action's IO step; its timeout is ``sm.time_left`` (None where the step does not wait).
    ACTIONS: dict[type, Callable[[Any, Any, Any], object]] = {
        StartScrub: _start_scrub, ExportContext: _export, AwaitScrub: _await_scrub, SwitchTo: _switch_to,
        SendRequest: _send_request, AwaitSwitch: _await_switch, AwaitReply: _await_reply, AwaitGpu: _await_gpu,
        StartRotation: _start_rotation, ImportContext: _import, AwaitRotation: _await_rotation, VerifyChunk: _verify,
    }

    # ------------------------------------------------------------------ around a travel
    def _attest_before(self, holder: str) -> None:
        """Before a travel or baseline transfer: fresh GPU claims, and the holder's re-attestation if due."""
        try:
            self.attester.refresh(self.driver, utcnow(), self.config.device_timeout)
            conn = self.holders.get(holder)  # None: the machine's Start says why there is no travel
            try:
                if conn is not None:
                    self.attester.reattest_if_due(conn, self.driver, self.config.holder_timeout, self._clock())
            except GputravelError as exc:  # it failed (or refused us): dropped, it may join again
                self.drop(holder)
                raise HolderLost(holder, f"{type(exc).__name__}: {exc}", during="its re-attestation") from None
        except GputravelError:
            self._recover()  # a dropped RPC leaves the queue out of step until a rotation
            raise

    def drop(self, holder: str) -> None:
        conn = self.holders.pop(holder, None)
        if conn is not None:
            conn.close()

    def _recover(self) -> None:
        """Take the GPU back and rotate (else re-key), so whatever the holder kept is useless."""
        try:
            self.switch(NAME)
            if self.driver.rotating:  # submitted when the GPU came home: finish it (it takes the context back)
                self.driver.finish_rotation(timeout=self.config.device_timeout)
            else:
                self.driver.abandon_travel()
                self.driver.rotate(timeout=self.config.device_timeout)
        except GputravelError as exc:
            log.warning("recovery rotation failed (%s: %s): re-keying the GPU", type(exc).__name__, exc)
            self.driver.abandon_travel()
            self.rekey()

    def _fresh_epoch(self) -> None:
        """Replace an epoch the orchestrator used, or a halt, by a confirmed rotation or a re-key."""
        if self.driver.ledger.halted is None:
            try:
                self.driver.rotate(timeout=self.config.device_timeout)
                return
            except GputravelError as exc:
                log.warning("rotation before a travel failed (%s: %s): re-keying the GPU", type(exc).__name__, exc)
        self.rekey()

    def baseline(self, holder: str, dataset_offset: int) -> BaselineReport:
        """The centralised TLS baseline (paper 7.2, orchestrator/baseline.py): the GPU does not travel."""
        if holder in self.holders:  # as before a travel (an offline holder is reported by run)
            self._attest_before(holder)
        return self.baseline_path.run(holder, dataset_offset)

    def buffer_view(self) -> memoryview:
        """Read-only view of the dataset buffer (what a training kernel reads)."""
        assert self.vram is not None and self.travel_sm is not None
        b = self.travel_sm.buffer
        return memoryview(self.vram)[b.offset : b.offset + b.nbytes]

    def close(self) -> None:
        for conn in self.holders.values():
            with contextlib.suppress(GputravelError):
                conn.send(Bye(reason="cohort shutting down"))
            conn.close()
        self.listener.close()
        self.host.close()
        if self.travel_log is not None:
            self.travel_log.close()
