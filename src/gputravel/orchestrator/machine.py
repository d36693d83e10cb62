"""The orchestrator's side of one travel (paper Fig. 3) as a sans-IO state machine.

Each method is an event (a step finished, a message arrived) with ``now`` passed in; each
returns the next action for the runtime to carry out. The machine checks the order of
steps, validates what the holder sends back against its manifest, and times every step.

Steps of the paper's cycle overlap here where nothing forces them to wait: the context is
exported while the device scrubs (the scrub is kernel-channel work, the context the user
channel's), the context goes to the holder over TLS while the PCIe MUX switches the GPU to
it, the holder exports while the MUX switches the GPU home, and the orchestrator imports
the returned context while the device rotates (the rotation, again kernel-channel work,
happens whatever comes back). So each step's figure is its share of the travel's critical
path: ``dh_switch`` and ``o_switch`` are only what the holder and the orchestrator still had
to wait for the MUX, ``o_rotate`` only what was left of the rotation after the import, and
``o_export`` lies inside ``o_cleanup``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from gputravel.errors import BadInput, IllegalTransition, ProtocolError
from gputravel.protocol.travel import ChunkInfo, HolderHello, TravelRefused, TravelRequest, TravelResult
from gputravel.protocol.codec import message
from gputravel.protocol.manifest import chunk_digest_from_manifest

#: Step names of the paper's Table 1, in cycle order.
STEPS = ("o_cleanup", "o_export", "dh_switch", "dh_import", "dh_copy", "dh_export", "tls", "o_switch", "o_import", "o_rotate")


class Phase(Enum):
    IDLE = "idle"
    CLEANUP = "cleanup"  # the device scrubs; the context is being exported meanwhile
    SCRUB = "scrub"  # exported; waiting for the scrub to be confirmed
    DEPART = "depart"  # switch asked for and request sent; waiting for the MUX's reply
    AWAY = "away"
    HOMECOMING = "homecoming"  # the holder replied; waiting for the GPU to be home
    IMPORT = "import"  # rotation submitted; importing the returned context meanwhile
    ROTATE = "rotate"  # imported; waiting for the device to confirm the rotation
    VERIFY = "verify"


# ----------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class ScrubBuffer:
    offset: int
    nbytes: int


@dataclass(frozen=True)
class AwaitScrub:
    pass


@dataclass(frozen=True)
class Depart:
    """Ask the MUX to switch the GPU to ``holder`` and, without waiting, send the request."""

    holder: str
    request: TravelRequest


@dataclass(frozen=True)
class AwaitReply:
    pass


@dataclass(frozen=True)
class AwaitGpu:
    pass


@dataclass(frozen=True)
class RotateAndImport:
    """Submit the rotation, import ``blob`` while the device rotates, then finish it."""

    blob: bytes = field(repr=False)


@dataclass(frozen=True)
class AwaitRotation:
    pass


@dataclass(frozen=True)
class VerifyChunk:
    offset: int
    nbytes: int
    piece_bytes: int  # the holder's manifest pieces: the digest is computed over pieces this size


@message("report.travel")
@dataclass(frozen=True)
class TravelReport:
    travel_id: int
    holder: str
    chunk: ChunkInfo | None  # None when the holder refused
    steps_ms: dict[str, float]
    total_ms: float
    verify_ms: float
    refused: str | None
    nonzero_on_arrival: int  # what the holder's arrival audit found (-1: not audited)


@dataclass(frozen=True)
class Buffer:
    offset: int
    nbytes: int


class OrchestratorTravel:
    """One dataset buffer, travels one at a time."""

    def __init__(self, buffer: Buffer) -> None:
        self.buffer = buffer
        self.holders: dict[str, HolderHello] = {}
        self.phase = Phase.IDLE
        self._travel_id = 0
        self._holder = ""
        self._offset = 0
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
        self.holders[hello.holder] = hello

    def expected_nbytes(self, holder: str, offset: int) -> int:
        return min(self.buffer.nbytes, self.holders[holder].dataset_bytes - offset)

    # ------------------------------------------------------------------ events
    def _expect(self, phase: Phase, action: str) -> None:
        if self.phase is not phase:
            raise IllegalTransition("orchestrator", self.phase.value, action)

    def start(self, holder: str, dataset_offset: int, now: float) -> ScrubBuffer:
        self._expect(Phase.IDLE, "start a travel")
        hello = self.holders.get(holder)
        if hello is None:
            known = ", ".join(sorted(self.holders)) or "none"
            raise BadInput(f"unknown holder {holder!r} (enrolled: {known})")
        if hello.dataset_bytes == 0:
            raise BadInput(f"holder {holder!r} has an empty dataset: nothing to travel for")
        # A chunk may start at any manifest piece boundary inside the dataset (training resumes
        # mid-dataset); its digest is then checkable from the manifest.
        if dataset_offset % hello.piece_bytes or not 0 <= dataset_offset < hello.dataset_bytes:
            raise BadInput(f"dataset offset {dataset_offset} is not a chunk start of holder {holder!r}: chunks start "
                           f"on a {hello.piece_bytes}-byte piece boundary inside its {hello.dataset_bytes}-byte dataset")
        self._travel_id += 1
        self._holder, self._offset = holder, dataset_offset
        self._marks = {"start": now}
        self._steps, self._chunk, self._refused, self._arrival = {}, None, None, -1
        self.phase = Phase.CLEANUP
        return ScrubBuffer(self.buffer.offset, self.buffer.nbytes)

    def exported(self, blob: bytes, now: float) -> AwaitScrub:
        """The context is packed (while the device scrubs); it leaves only after the scrub."""
        self._expect(Phase.CLEANUP, "finish exporting")
        self._blob = blob
        self._step("o_export", "start", now)
        self.phase = Phase.SCRUB
        return AwaitScrub()

    def scrubbed(self, now: float, reexported: bytes | None = None) -> Depart:
        """The scrub is confirmed. ``reexported``: the driver had to export the context again
        (the device had moved on since the first export); that one travels."""
        self._expect(Phase.SCRUB, "finish scrubbing")
        if reexported is not None:
            self._blob = reexported
        self._step("o_cleanup", "start", now)
        self.phase = Phase.DEPART
        req = TravelRequest(self._travel_id, self.buffer.offset, self.buffer.nbytes, self._offset, self._blob)
        self._blob = b""
        return Depart(self._holder, req)

    def switched(self, now: float) -> AwaitReply:
        """The MUX answered: the GPU is the holder's (it may already be working on it)."""
        self._expect(Phase.DEPART, "finish switching to the holder")
        self.phase = Phase.AWAY
        return AwaitReply()

    def holder_replied(self, reply: TravelResult | TravelRefused, now: float) -> AwaitGpu:
        self._expect(Phase.AWAY, "take a holder's reply")
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
        self.phase = Phase.HOMECOMING
        return AwaitGpu()

    def _check_chunk(self, chunk: ChunkInfo) -> ChunkInfo:
        hello = self.holders[self._holder]
        want = self.expected_nbytes(self._holder, self._offset)
        if chunk.dataset_offset != self._offset or chunk.nbytes != want:
            raise ProtocolError(f"holder {self._holder}: copied {chunk.nbytes} bytes at {chunk.dataset_offset}, asked {want} at {self._offset}")
        if chunk.digest != chunk_digest_from_manifest(hello.manifest, self._offset, want, hello.piece_bytes):
            raise ProtocolError(f"holder {self._holder}: chunk digest does not match its manifest")
        return chunk

    def home(self, now: float) -> RotateAndImport:
        """The MUX has switched the GPU back (the holder asked before it exported)."""
        self._expect(Phase.HOMECOMING, "take the GPU back")
        self._step("o_switch", "away", now)
        self.phase = Phase.IMPORT
        blob, self._blob = self._blob, b""
        return RotateAndImport(blob)

    def imported(self, now: float) -> AwaitRotation:
        self._expect(Phase.IMPORT, "finish importing")
        self._step("o_import", "o_switch", now)
        self.phase = Phase.ROTATE
        return AwaitRotation()

    def rotated(self, now: float) -> VerifyChunk | TravelReport:
        self._expect(Phase.ROTATE, "finish rotating")
        self._step("o_rotate", "o_import", now)
        if self._chunk is None:
            return self._finish(now, verify_ms=0.0)
        self.phase = Phase.VERIFY
        return VerifyChunk(self.buffer.offset, self._chunk.nbytes, self.holders[self._holder].piece_bytes)

    def verified(self, digest: bytes, now: float) -> TravelReport:
        """The digest of what the device holds; it must equal the holder's manifest entry."""
        self._expect(Phase.VERIFY, "verify a chunk")
        assert self._chunk is not None
        if digest != self._chunk.digest:
            self.phase = Phase.IDLE
            raise ProtocolError(f"travel {self._travel_id}: VRAM does not hold the chunk holder {self._holder} described")
        return self._finish(now, verify_ms=(now - self._marks["o_rotate"]) * 1e3)

    def abort(self) -> None:
        """A step failed: the runtime has recovered the GPU; forget this travel."""
        self.phase = Phase.IDLE

    # ------------------------------------------------------------------ helpers
    def _step(self, name: str, since: str, now: float) -> None:
        self._steps[name] = (now - self._marks[since]) * 1e3
        self._marks[name] = now

    def _finish(self, now: float, verify_ms: float) -> TravelReport:
        self.phase = Phase.IDLE
        total = (self._marks["o_rotate"] - self._marks["start"]) * 1e3
        steps = {name: self._steps.get(name, 0.0) for name in STEPS}
        return TravelReport(self._travel_id, self._holder, self._chunk, steps, total, verify_ms, self._refused, self._arrival)
