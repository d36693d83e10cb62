"""A data holder's side of the cohort as a sans-IO state machine (paper 4.2): the order of
holder/steps.py's events and actions. It touches a context only while its attestation of the
orchestrator is fresh. A request it cannot serve, or a step that fails or times out before the
copy is done, is refused; the context and the GPU still go back.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from gputravel.attest import AttestationError
from gputravel.errors import ProtocolError
from gputravel.holder.steps import (
    Attached, Attest, Attested, AuditArrival, Audited, AwaitGpu, AwaitSwitchHome, BaselineAsked, Challenge, CheckBuffer,
    Copied, CopyChunk, ExportBlob, Exported, Granted, HelloAnswered, ImportBlob, Imported, Introduce, Replied, Reply,
    Request, StepFailed, SwitchAsked, SwitchBack, SwitchedHome,
)
from gputravel.protocol.machine import TimedOut, TravelMachine
from gputravel.protocol.manifest import chunk_digest_from_manifest, chunk_nbytes
from gputravel.protocol.travel import Bye, ChunkInfo, TravelRefused, TravelRequest, TravelResult, Welcome


class HolderPhase(Enum):
    IDLE = "idle"
    ATTEST = "attest"  # attesting the orchestrator (joining, or after it said AttestDue)
    WELCOME = "welcome"  # joining: introduced ourselves, waiting to be welcomed
    IMPORT = "import"
    ATTACH = "attach"  # waiting for the GPU to be ours
    AUDIT = "audit"  # reading the buffer back on arrival
    GRANT = "grant"  # asking the device how large the granted buffer is
    COPY = "copy"
    SWITCH = "switch"  # asking for the switch home
    EXPORT = "export"
    REPLY = "reply"
    HOMEWARD = "homeward"  # replied; waiting for the MUX to switch the GPU home
    ERROR = "error"


@dataclass(frozen=True)
class Deadlines:
    """Seconds each wait may take (HolderConfig sets them)."""

    device: float = 30.0  # the host's MUX and the device, during a travel
    orchestrator: float = 30.0  # an attestation exchange, the answer to a join


P = HolderPhase
Step = tuple[HolderPhase, object]  # what a handler returns: the next phase, and the action (None: nothing)
_REFUSABLE: dict[tuple[Enum, type], tuple[Enum, ...]] = {
    (p, e): (P.SWITCH,) for p in (P.ATTACH, P.AUDIT, P.GRANT, P.COPY) for e in (StepFailed, TimedOut)}


class HolderTravel(TravelMachine):
    IDLE, ERROR = P.IDLE, P.ERROR
    TABLE = {
        (P.IDLE, Attest): (P.ATTEST,),
        (P.IDLE, BaselineAsked): (P.IDLE,),
        (P.IDLE, Request): (P.IMPORT, P.ATTACH),  # ATTACH: refused on sight
        (P.ATTEST, Attested): (P.WELCOME, P.IDLE),  # WELCOME: joining
        (P.WELCOME, HelloAnswered): (P.IDLE,),
        (P.IMPORT, Imported): (P.ATTACH,),
        (P.IMPORT, StepFailed): (P.ATTACH,),  # refused, the context untouched
        (P.ATTACH, Attached): (P.AUDIT, P.GRANT, P.SWITCH),  # SWITCH: refusing
        (P.AUDIT, Audited): (P.GRANT,),
        (P.GRANT, Granted): (P.COPY, P.SWITCH),
        (P.COPY, Copied): (P.SWITCH,),
        **_REFUSABLE,
        (P.SWITCH, SwitchAsked): (P.EXPORT, P.REPLY),  # REPLY: never imported, nothing to export
        (P.EXPORT, Exported): (P.REPLY,),
        (P.REPLY, Replied): (P.HOMEWARD,),
        (P.HOMEWARD, SwitchedHome): (P.IDLE,),
    }

    def __init__(self, name: str, dataset_bytes: int, manifest: tuple[bytes, ...], piece_bytes: int,
                 deadlines: Deadlines = Deadlines(), audit_arrival: bool = False, held_base: int = 0) -> None:
        budgets: dict[Enum, float] = dict.fromkeys((P.ATTACH, P.AUDIT, P.GRANT, P.COPY, P.HOMEWARD), deadlines.device)
        super().__init__(f"holder {name}", budgets | dict.fromkeys((P.ATTEST, P.WELCOME), deadlines.orchestrator))
        self.name, self.dataset_bytes, self.manifest, self.piece_bytes = name, dataset_bytes, manifest, piece_bytes
        self.held_base = held_base  # where its held-out records start (0: none): no chunk crosses it
        self.deadlines = deadlines
        self.audit_arrival = audit_arrival  # read the buffer back on arrival and count non-zero bytes
        self._attested_at, self._valid_s = 0.0, 0.0  # our last attestation of the orchestrator
        self._joining = False
        self._forget()

    def _forget(self) -> None:
        self._req: TravelRequest | None = None
        self._refusal: str | None = None
        self._blob = b""
        self._marks: dict[str, float] = {}
        self._chunk: ChunkInfo | None = None
        self._arrival = -1
        self._imported = False

    # ------------------------------------------------------------------ attestation of the orchestrator
    def _on_attest(self, ev: Attest, now: float) -> Step:
        self._joining = ev.joining
        return P.ATTEST, Challenge()

    def _on_attested(self, ev: Attested, now: float) -> Step:
        self._attested_at, self._valid_s = now, ev.valid_s
        return (P.WELCOME, Introduce()) if self._joining else (P.IDLE, None)

    def _on_answer(self, ev: HelloAnswered, now: float) -> Step:
        if not isinstance(ev.message, Welcome):
            why = f": {ev.message.reason}" if isinstance(ev.message, Bye) else ""
            raise ProtocolError(f"orchestrator did not welcome us{why}")
        return P.IDLE, None

    def _check_attested(self, now: float) -> None:
        """Before we touch a context or send plaintext: our attestation of the orchestrator is fresh."""
        age = now - self._attested_at
        if age > self._valid_s:
            raise AttestationError("expired", f"our attestation of the orchestrator is {age:.0f} s old; the "
                                              f"policy allows {self._valid_s:.0f} s and it did not "
                                              "let us attest it again")

    def _on_baseline(self, ev: BaselineAsked, now: float) -> Step:
        self._check_attested(now)
        return P.IDLE, None

    # ------------------------------------------------------------------ a travel
    def _on_request(self, ev: Request, now: float) -> Step:
        self._check_attested(now)
        req = ev.request
        self._forget()
        self._req, self._marks = req, {"start": now}
        self._refusal = self._check(req)
        if self._refusal is not None:
            # Refused untouched; still wait for the GPU, so the switch home comes after this one.
            self._blob = req.context
            self._marks["dh_import"] = now
            return P.ATTACH, AwaitGpu()
        return P.IMPORT, ImportBlob(req.context)

    def _check(self, req: TravelRequest) -> str | None:
        if self.dataset_bytes == 0:
            return f"holder {self.name} has an empty dataset"
        if req.buffer_bytes <= 0 or req.buffer_bytes % self.piece_bytes:
            return f"buffer of {req.buffer_bytes} bytes is not a whole number of {self.piece_bytes}-byte pieces"
        if req.dataset_offset % self.piece_bytes or not 0 <= req.dataset_offset < self.dataset_bytes:
            return f"dataset offset {req.dataset_offset} is outside holder {self.name}'s dataset"
        return None

    def _on_imported(self, ev: Imported, now: float) -> Step:
        self._marks["dh_import"] = now
        self._imported = True
        return P.ATTACH, AwaitGpu()

    def _on_attached(self, ev: Attached, now: float) -> Step:
        """The host says the GPU is ours: audit, check the buffer, copy (or, refusing, go home)."""
        self._marks["dh_switch"] = now
        if self._refusal is not None:
            return self._leave(now)
        req = self._request
        if self.audit_arrival:
            return P.AUDIT, AuditArrival(req.buffer_offset, req.buffer_bytes)
        return P.GRANT, CheckBuffer(req.buffer_offset)

    def _on_audited(self, ev: Audited, now: float) -> Step:
        self._arrival = ev.nonzero
        return P.GRANT, CheckBuffer(self._request.buffer_offset)

    def _on_granted(self, ev: Granted, now: float) -> Step:
        req = self._request
        if ev.nbytes < req.buffer_bytes:
            self._refusal = f"BadInput: the device buffer holds {ev.nbytes} bytes, the request claims {req.buffer_bytes}"
            return self._leave(now)
        nbytes = chunk_nbytes(self.name, self.dataset_bytes, self.piece_bytes, req.dataset_offset, req.buffer_bytes,
                              self.held_base)
        return P.COPY, CopyChunk(req.buffer_offset, req.buffer_bytes, req.dataset_offset, nbytes, ev.nbytes)

    def _on_copied(self, ev: Copied, now: float) -> Step:
        """The chunk is in VRAM: the GPU goes home at once; the context is packed meanwhile."""
        req = self._request
        digest = chunk_digest_from_manifest(self.manifest, req.dataset_offset, ev.nbytes, self.piece_bytes)
        self._chunk = ChunkInfo(dataset_offset=req.dataset_offset, nbytes=ev.nbytes, digest=digest)
        return self._leave(now)

    def _on_failed(self, ev: StepFailed, now: float) -> Step:
        """A step failed (import, the GPU's arrival, the copy): refuse; still go home with the context."""
        if self._phase is P.IMPORT:  # the untouched context goes back, once the GPU has come and gone
            self._refusal, self._blob = ev.reason, self._request.context
            self._marks["dh_import"] = now
            return P.ATTACH, AwaitGpu()
        if self._phase is P.ATTACH:  # and, so the host's view is consistent, the switch home all the same
            self._refusal = self._refusal or f"the GPU never came: {ev.reason}"
            self._marks["dh_switch"] = now
        else:
            self._refusal = ev.reason
        return self._leave(now)

    def _on_timeout(self, ev: TimedOut, now: float) -> Step:
        return self._on_failed(StepFailed(f"PeerTimeout: the {self._phase.value} step took over {ev.waited_s:g} s"), now)

    def _leave(self, now: float) -> Step:
        self._marks["dh_copy"] = now
        return P.SWITCH, SwitchBack()

    def _on_switch_asked(self, ev: SwitchAsked, now: float) -> Step:
        """Export the context while the MUX switches home, or, never imported, reply with it untouched."""
        self._marks["left"] = now
        if not self._imported:
            return P.REPLY, self._reply(now)
        return P.EXPORT, ExportBlob()

    def _on_exported(self, ev: Exported, now: float) -> Step:
        """The context is packed: reply now, the orchestrator imports while the MUX switches."""
        self._blob = ev.blob
        return P.REPLY, self._reply(now)

    def _on_replied(self, ev: Replied, now: float) -> Step:
        return P.HOMEWARD, AwaitSwitchHome()

    def _on_home(self, ev: SwitchedHome, now: float) -> Step:
        self._forget()
        return P.IDLE, None

    @property
    def _request(self) -> TravelRequest:
        assert self._req is not None
        return self._req

    def _reply(self, now: float) -> Reply:
        m = self._marks
        steps = {
            "dh_import": m["dh_import"] - m["start"],
            "dh_switch": m["dh_switch"] - m["dh_import"],  # what the MUX made us wait, after importing
            "dh_copy": m["dh_copy"] - m["dh_switch"],
            "dh_export": now - m["left"],
            "handler": now - m["start"],
        }
        steps_ns = {k: int(v * 1e9) for k, v in steps.items()}
        req = self._request
        if self._refusal is not None or self._chunk is None:
            return Reply(TravelRefused(req.travel_id, self._blob, self._refusal or "copy failed", steps_ns))
        return Reply(TravelResult(req.travel_id, self._blob, self._chunk, steps_ns, self._arrival))

    HANDLERS = {
        Attest: _on_attest, Attested: _on_attested, HelloAnswered: _on_answer,
        BaselineAsked: _on_baseline, Request: _on_request, Imported: _on_imported, Attached: _on_attached,
        Audited: _on_audited, Granted: _on_granted, Copied: _on_copied, StepFailed: _on_failed,
        TimedOut: _on_timeout, SwitchAsked: _on_switch_asked, Exported: _on_exported, Replied: _on_replied,
        SwitchedHome: _on_home,
    }
