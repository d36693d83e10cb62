"""The orchestrator's side of one travel (paper Fig. 3), a sans-IO state machine: the one place
the cycle's order is written. Steps overlap where nothing forces a wait, so each step's figure is
its share of the critical path (``o_export`` lies inside ``o_cleanup``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from gputravel.errors import BadInput, ProtocolError
from gputravel.protocol.control import STEPS, TravelReport
from gputravel.protocol.machine import TravelMachine
from gputravel.protocol.travel import ChunkInfo, HolderHello, TravelRefused, TravelRequest, TravelResult
from gputravel.protocol.manifest import LOG_KEY_BYTES, chunk_digest_from_manifest, chunk_nbytes


class Phase(Enum):
    IDLE = "idle"
    CLEANUP = "cleanup"  # submitting the scrub
    EXPORT = "export"  # the device scrubs; the context is exported meanwhile
    SCRUB = "scrub"  # exported; waiting for the scrub to be confirmed
    DEPART = "depart"  # asking the MUX to switch the GPU to the holder
    SEND = "send"  # sending the request while the MUX switches
    SWITCH = "switch"  # waiting for the MUX's reply
    AWAY = "away"  # waiting for the holder's reply
    HOMECOMING = "homecoming"  # the holder replied; waiting for the GPU to be home
    START_ROTATION = "start-rotation"
    IMPORT = "import"  # rotation submitted; importing the returned context meanwhile
    ROTATE = "rotate"  # imported; waiting for the device to confirm the rotation
    VERIFY = "verify"
    ERROR = "error"


@dataclass(frozen=True)
class Deadlines:  # seconds each wait may take
    device: float = 10.0  # the device and the host's MUX
    holder: float = 60.0  # a holder's reply to its travel request


def _check_split(hello: HolderHello) -> int:
    """A records holder's counts must be its dataset's laid-out size: its training records, whole
    records to a piece, then its held-out records from the next piece (data/records.py). Returns
    where its held-out records start (0: none), where every training chunk ends."""
    name, train, held = hello.holder, hello.train_records, hello.eval_records
    if not hello.schema:
        if train or held:
            raise ProtocolError(f"holder {name}: record counts without a schema")
        return 0
    from gputravel.data.records import RecordSchema, Units  # lazy: numpy, for records only

    try:
        units = Units(RecordSchema.from_json(hello.schema).record_bytes, hello.piece_bytes)
    except BadInput as exc:
        raise ProtocolError(f"holder {name}: its schema is refused: {exc}") from None
    if train < 1 or held < 0 or hello.dataset_bytes != units.split_bytes(train, held):
        raise ProtocolError(f"holder {name}: {train} training and {held} held-out records of {units.unit_bytes} "
                            f"bytes do not lay out as its {hello.dataset_bytes} bytes")
    return units.eval_base(train) if held else 0


# ----------------------------------------------------------------------------- events
@dataclass(frozen=True)
class _Bare:
    """An event or action that carries nothing: its class is all it says."""


@dataclass(frozen=True)
class Start:
    holder: str
    dataset_offset: int


@dataclass(frozen=True)
class ScrubStarted:
    release: int  # the kernel-channel semaphore value that confirms it


@dataclass(frozen=True)
class Exported:
    blob: bytes = field(repr=False)


@dataclass(frozen=True)
class Scrubbed:
    reexported: bytes | None = field(default=None, repr=False)  # the device moved on: this context travels


class SwitchAsked(_Bare):
    pass


class RequestSent(_Bare):
    pass


class Switched(_Bare):  # the MUX answered: the GPU is the holder's
    pass


@dataclass(frozen=True)
class Replied:
    reply: TravelResult | TravelRefused


class Home(_Bare):  # the MUX switched the GPU back (the holder asked before it exported)
    pass


class RotationStarted(_Bare):
    pass


class Imported(_Bare):
    pass


class Rotated(_Bare):
    pass


@dataclass(frozen=True)
class Verified:
    digest: bytes  # of what the device holds; it must equal the holder's manifest entry


# ----------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class StartScrub:
    offset: int
    nbytes: int


class ExportContext(_Bare):
    pass


@dataclass(frozen=True)
class AwaitScrub:
    release: int


@dataclass(frozen=True)
class SwitchTo:
    holder: str


@dataclass(frozen=True)
class SendRequest:
    holder: str
    request: TravelRequest


@dataclass(frozen=True)
class AwaitSwitch:
    holder: str  # a holder that has the request but may never get the GPU is in an unknown state


@dataclass(frozen=True)
class AwaitReply:
    holder: str


class AwaitGpu(_Bare):
    pass


class StartRotation(_Bare):
    pass


@dataclass(frozen=True)
class ImportContext:
    holder: str
    blob: bytes = field(repr=False)


class AwaitRotation(_Bare):
    pass


@dataclass(frozen=True)
class VerifyChunk:
    offset: int
    nbytes: int
    piece_bytes: int  # the holder's manifest pieces: the digest is computed over pieces this size


#: Every action the machine returns but its report: one IO step each.
ACTIONS = (StartScrub, ExportContext, AwaitScrub, SwitchTo, SendRequest, AwaitSwitch, AwaitReply, AwaitGpu,
           StartRotation, ImportContext, AwaitRotation, VerifyChunk)


@dataclass(frozen=True)
class Buffer:
    offset: int
    nbytes: int


P = Phase
Step = tuple[Phase, object]  # what a handler returns: the next phase, and the action for the runtime


class OrchestratorTravel(TravelMachine):
    """One dataset buffer, travels one at a time. A travel ends with a TravelReport."""

    IDLE, ERROR = P.IDLE, P.ERROR
    TABLE = {
        (P.IDLE, Start): (P.CLEANUP,),
        (P.CLEANUP, ScrubStarted): (P.EXPORT,),
        (P.EXPORT, Exported): (P.SCRUB,),
        (P.SCRUB, Scrubbed): (P.DEPART,),
        (P.DEPART, SwitchAsked): (P.SEND,),
        (P.SEND, RequestSent): (P.SWITCH,),
        (P.SWITCH, Switched): (P.AWAY,),
        (P.AWAY, Replied): (P.HOMECOMING,),
        (P.HOMECOMING, Home): (P.START_ROTATION,),
        (P.START_ROTATION, RotationStarted): (P.IMPORT,),
        (P.IMPORT, Imported): (P.ROTATE,),
        (P.ROTATE, Rotated): (P.VERIFY, P.IDLE),  # IDLE: refused (nothing to verify) or not verifying
        (P.VERIFY, Verified): (P.IDLE,),
    }

    def __init__(self, buffer: Buffer, deadlines: Deadlines = Deadlines(), verify: bool = True) -> None:
        d = deadlines
        super().__init__("orchestrator", {P.CLEANUP: d.device, P.SCRUB: d.device, P.SWITCH: d.device,
                                          P.AWAY: d.holder, P.HOMECOMING: d.device, P.START_ROTATION: d.device,
                                          P.ROTATE: d.device})
        self.buffer = buffer
        self.verify = verify  # False: the holder's digest is taken on trust (no read-back of VRAM)
        self.holders: dict[str, HolderHello] = {}
        self.held_base: dict[str, int] = {}  # where each holder's held-out records start (0: none)
        self._travel_id = 0
        self._forget()

    def _forget(self) -> None:
        self._holder = ""
        self._offset = 0
        self._release = 0  # the scrub's confirmation value
        self._marks: dict[str, float] = {}
        self._steps: dict[str, float] = {}
        self._chunk: ChunkInfo | None = None
        self._refused: str | None = None
        self._blob = b""
        self._arrival = -1

    # ------------------------------------------------------------------ cohort
    def enrol(self, hello: HolderHello) -> None:
        if hello.piece_bytes <= 0 or self.buffer.nbytes % hello.piece_bytes:
            raise ProtocolError(f"holder {hello.holder}: piece size must divide the buffer size")
        if len(hello.manifest) != -(-hello.dataset_bytes // hello.piece_bytes):
            raise ProtocolError(f"holder {hello.holder}: manifest does not match the dataset size")
        if len(hello.log_key) != LOG_KEY_BYTES:  # what keys its entries in the public travel log
            raise ProtocolError(f"holder {hello.holder}: its travel-log key must be {LOG_KEY_BYTES} bytes")
        self.held_base[hello.holder] = _check_split(hello)
        self.holders[hello.holder] = hello

    def chunk_nbytes(self, holder: str, offset: int) -> int:  # BadInput if no chunk starts there
        hello = self.holders[holder]
        return chunk_nbytes(holder, hello.dataset_bytes, hello.piece_bytes, offset, self.buffer.nbytes,
                            self.held_base.get(holder, 0))

    # ------------------------------------------------------------------ events
    def _on_start(self, ev: Start, now: float) -> Step:
        holder, dataset_offset = ev.holder, ev.dataset_offset
        hello = self.holders.get(holder)
        if hello is None:
            known = ", ".join(sorted(self.holders)) or "none"
            raise BadInput(f"unknown holder {holder!r} (enrolled: {known})")
        self.chunk_nbytes(holder, dataset_offset)  # refuses a chunk that does not start a piece
        self._forget()
        self._travel_id += 1
        self._holder, self._offset = holder, dataset_offset
        self._marks = {"start": now}
        return P.CLEANUP, StartScrub(self.buffer.offset, self.buffer.nbytes)

    def _on_scrub_started(self, ev: ScrubStarted, now: float) -> Step:
        self._release = ev.release
        return P.EXPORT, ExportContext()

    def _on_exported(self, ev: Exported, now: float) -> Step:  # it leaves only after the scrub
        self._blob = ev.blob
        self._step("o_export", "start", now)
        return P.SCRUB, AwaitScrub(self._release)

    def _on_scrubbed(self, ev: Scrubbed, now: float) -> Step:
        if ev.reexported is not None:
            self._blob = ev.reexported
        self._step("o_cleanup", "start", now)
        return P.DEPART, SwitchTo(self._holder)  # the context goes over TLS while the MUX switches

    def _on_switch_asked(self, ev: SwitchAsked, now: float) -> Step:
        req = TravelRequest(self._travel_id, self.buffer.offset, self.buffer.nbytes, self._offset, self._blob)
        self._blob = b""
        return P.SEND, SendRequest(self._holder, req)

    def _on_sent(self, ev: RequestSent, now: float) -> Step:
        return P.SWITCH, AwaitSwitch(self._holder)

    def _on_switched(self, ev: Switched, now: float) -> Step:
        return P.AWAY, AwaitReply(self._holder)

    def _on_replied(self, ev: Replied, now: float) -> Step:
        reply = ev.reply
        if reply.travel_id != self._travel_id:
            raise ProtocolError(f"holder {self._holder}: reply to travel {reply.travel_id}, expected {self._travel_id}")
        remote = {k: v / 1e6 for k, v in reply.steps_ns.items()}
        for name in ("dh_import", "dh_switch", "dh_copy", "dh_export"):
            self._steps[name] = remote.get(name, 0.0)
        away_ms = (now - self._marks["o_cleanup"]) * 1e3  # the request left right after the scrub
        self._steps["tls"] = max(away_ms - remote.get("handler", 0.0), 0.0)
        self._marks["away"] = now
        if isinstance(reply, TravelRefused):
            self._refused = reply.reason
        else:
            self._chunk = self._check_chunk(reply.chunk)
            self._arrival = reply.nonzero_on_arrival
        self._blob = reply.context
        return P.HOMECOMING, AwaitGpu()  # the holder asked for the switch home before exporting

    def _check_chunk(self, chunk: ChunkInfo) -> ChunkInfo:
        hello = self.holders[self._holder]
        want = self.chunk_nbytes(self._holder, self._offset)
        if chunk.dataset_offset != self._offset or chunk.nbytes != want:
            raise ProtocolError(f"holder {self._holder}: copied {chunk.nbytes} bytes at {chunk.dataset_offset}, asked {want} at {self._offset}")
        if chunk.digest != chunk_digest_from_manifest(hello.manifest, self._offset, want, hello.piece_bytes):
            raise ProtocolError(f"holder {self._holder}: chunk digest does not match its manifest")
        return chunk

    def _on_home(self, ev: Home, now: float) -> Step:
        self._step("o_switch", "away", now)
        return P.START_ROTATION, StartRotation()  # the device rotates while we import

    def _on_rotation_started(self, ev: RotationStarted, now: float) -> Step:
        blob, self._blob = self._blob, b""
        return P.IMPORT, ImportContext(self._holder, blob)

    def _on_imported(self, ev: Imported, now: float) -> Step:
        self._step("o_import", "o_switch", now)
        return P.ROTATE, AwaitRotation()

    def _on_rotated(self, ev: Rotated, now: float) -> Step:
        self._step("o_rotate", "o_import", now)
        if self._chunk is None or not self.verify:
            return P.IDLE, self._finish(verify_ms=0.0)
        return P.VERIFY, VerifyChunk(self.buffer.offset, self._chunk.nbytes, self.holders[self._holder].piece_bytes)

    def _on_verified(self, ev: Verified, now: float) -> Step:
        assert self._chunk is not None
        if ev.digest != self._chunk.digest:
            raise ProtocolError(f"travel {self._travel_id}: VRAM does not hold the chunk holder {self._holder} described")
        return P.IDLE, self._finish(verify_ms=(now - self._marks["o_rotate"]) * 1e3)

    # ------------------------------------------------------------------ helpers
    def _step(self, name: str, since: str, now: float) -> None:
        self._steps[name] = (now - self._marks[since]) * 1e3
        self._marks[name] = now

    def _finish(self, verify_ms: float) -> TravelReport:
        total = (self._marks["o_rotate"] - self._marks["start"]) * 1e3
        steps = {name: self._steps.get(name, 0.0) for name in STEPS}
        return TravelReport(self._travel_id, self._holder, self._chunk, steps, total, verify_ms, self._refused, self._arrival)

    HANDLERS = {
        Start: _on_start, ScrubStarted: _on_scrub_started, Exported: _on_exported, Scrubbed: _on_scrubbed,
        SwitchAsked: _on_switch_asked, RequestSent: _on_sent, Switched: _on_switched, Replied: _on_replied,
        Home: _on_home, RotationStarted: _on_rotation_started, Imported: _on_imported, Rotated: _on_rotated,
        Verified: _on_verified,
    }
