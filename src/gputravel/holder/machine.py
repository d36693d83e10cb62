"""A data holder's side of one travel, as a sans-IO state machine.

The holder is essentially a server (paper 4.2): a travel request arrives while the PCIe MUX
switches the GPU to it; it imports the context, waits until the host says the GPU is its
own, copies the requested chunk through the driver copy API, asks the host to switch the GPU
back, exports the context while that runs and, without waiting for the switch, replies (the
orchestrator imports the context while the switch goes on). A request it cannot serve is
refused, but it still waits for the GPU and returns the context and the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from gputravel.errors import IllegalTransition
from gputravel.protocol.travel import ChunkInfo, TravelRefused, TravelRequest, TravelResult
from gputravel.protocol.manifest import chunk_digest_from_manifest


class HolderPhase(Enum):
    IDLE = "idle"
    IMPORT = "import"
    ATTACH = "attach"  # waiting for the GPU to be ours
    COPY = "copy"
    EXPORT = "export"
    SWITCH = "switch"


@dataclass(frozen=True)
class ImportBlob:
    blob: bytes = field(repr=False)


@dataclass(frozen=True)
class AwaitGpu:
    pass


@dataclass(frozen=True)
class CopyChunk:
    buffer_offset: int
    buffer_bytes: int
    dataset_offset: int
    nbytes: int


@dataclass(frozen=True)
class ExportBlob:
    pass


@dataclass(frozen=True)
class SwitchBack:
    pass


@dataclass(frozen=True)
class Reply:
    message: TravelResult | TravelRefused


class HolderTravel:
    def __init__(self, name: str, dataset_bytes: int, manifest: tuple[bytes, ...], piece_bytes: int) -> None:
        self.name = name
        self.dataset_bytes = dataset_bytes
        self.manifest = manifest
        self.piece_bytes = piece_bytes
        self.phase = HolderPhase.IDLE
        self._req: TravelRequest | None = None
        self._refusal: str | None = None
        self._blob: bytes = b""
        self._marks: dict[str, float] = {}
        self._chunk: ChunkInfo | None = None
        self._arrival = -1
        self._imported = False

    def _expect(self, phase: HolderPhase, action: str) -> None:
        if self.phase is not phase:
            raise IllegalTransition(f"holder {self.name}", self.phase.value, action)

    def on_request(self, req: TravelRequest, now: float) -> ImportBlob | AwaitGpu:
        self._expect(HolderPhase.IDLE, "take a travel request")
        self._req, self._marks, self._chunk, self._arrival, self._blob = req, {"start": now}, None, -1, b""
        self._imported = False
        self._refusal = self._check(req)
        if self._refusal is not None:
            # Refuse without touching the context; still wait for the GPU (so the switch home
            # comes after the switch here), then hand back the untouched context and the link.
            self._blob = req.context
            self._marks["dh_import"] = now
            self.phase = HolderPhase.ATTACH
            return AwaitGpu()
        self.phase = HolderPhase.IMPORT
        return ImportBlob(req.context)

    def _check(self, req: TravelRequest) -> str | None:
        if self.dataset_bytes == 0:
            return f"holder {self.name} has an empty dataset"
        if req.buffer_bytes <= 0 or req.buffer_bytes % self.piece_bytes:
            return f"buffer of {req.buffer_bytes} bytes is not a whole number of {self.piece_bytes}-byte pieces"
        if req.dataset_offset % self.piece_bytes or not 0 <= req.dataset_offset < self.dataset_bytes:
            return f"dataset offset {req.dataset_offset} is outside holder {self.name}'s dataset"
        return None

    def imported(self, now: float) -> AwaitGpu:
        self._expect(HolderPhase.IMPORT, "finish importing")
        self._marks["dh_import"] = now
        self._imported = True
        self.phase = HolderPhase.ATTACH
        return AwaitGpu()

    def import_failed(self, reason: str, now: float) -> AwaitGpu:
        """The context would not import (corrupted, another layout or token): refuse, and hand
        it back untouched once the GPU has come and gone, as for any refusal."""
        self._expect(HolderPhase.IMPORT, "fail an import")
        req = self._req
        assert req is not None
        self._refusal, self._blob = reason, req.context
        self._marks["dh_import"] = now
        self.phase = HolderPhase.ATTACH
        return AwaitGpu()

    def attached(self, now: float) -> CopyChunk | SwitchBack:
        """The host says the GPU is ours: copy (or, refusing, send it straight back)."""
        self._expect(HolderPhase.ATTACH, "take the GPU")
        self._marks["dh_switch"] = now
        if self._refusal is not None:
            return self._leave(now)
        req = self._req
        assert req is not None
        nbytes = min(req.buffer_bytes, self.dataset_bytes - req.dataset_offset)
        self.phase = HolderPhase.COPY
        return CopyChunk(req.buffer_offset, req.buffer_bytes, req.dataset_offset, nbytes)

    def attach_failed(self, reason: str, now: float) -> SwitchBack:
        """The GPU never became ours: refuse, and hand back the context and (so the host's
        view is consistent) ask for the switch home all the same."""
        self._expect(HolderPhase.ATTACH, "give up waiting for the GPU")
        self._refusal = self._refusal or reason
        self._marks["dh_switch"] = now
        return self._leave(now)

    def audited(self, nonzero: int) -> None:
        """Record what an arrival audit found in the buffer (non-zero bytes before copying)."""
        self._expect(HolderPhase.COPY, "record an arrival audit")
        self._arrival = nonzero

    def copied(self, nbytes: int, now: float) -> SwitchBack:
        """The chunk is in VRAM: the GPU goes home at once; the context is packed meanwhile."""
        self._expect(HolderPhase.COPY, "finish copying")
        req = self._req
        assert req is not None
        digest = chunk_digest_from_manifest(self.manifest, req.dataset_offset, nbytes, self.piece_bytes)
        self._chunk = ChunkInfo(dataset_offset=req.dataset_offset, nbytes=nbytes, digest=digest)
        return self._leave(now)

    def copy_failed(self, reason: str, now: float) -> SwitchBack:
        """The copy was refused locally or by the device: still go home with the context."""
        self._expect(HolderPhase.COPY, "fail a copy")
        self._refusal = reason
        return self._leave(now)

    def _leave(self, now: float) -> SwitchBack:
        self._marks["dh_copy"] = now
        self.phase = HolderPhase.SWITCH
        return SwitchBack()

    def switch_requested(self, now: float) -> ExportBlob | Reply:
        """The switch home is asked for (we are done with the device): export the context
        while the MUX switches, or, if we never took it, reply with it untouched."""
        self._expect(HolderPhase.SWITCH, "ask for the switch back")
        self._marks["left"] = now
        if not self._imported:
            return self._reply(now)
        self.phase = HolderPhase.EXPORT
        return ExportBlob()

    def exported(self, blob: bytes, now: float) -> Reply:
        """The context is packed: reply now, the orchestrator imports while the MUX switches."""
        self._expect(HolderPhase.EXPORT, "finish exporting")
        self._blob = blob
        return self._reply(now)

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
        req = self._req
        assert req is not None
        self.phase = HolderPhase.IDLE
        if self._refusal is not None or self._chunk is None:
            return Reply(TravelRefused(req.travel_id, self._blob, self._refusal or "copy failed", steps_ns))
        return Reply(TravelResult(req.travel_id, self._blob, self._chunk, steps_ns, self._arrival))
