"""A data holder's side of one travel, as a sans-IO state machine.

The holder is essentially a server (paper 4.2): a travel request arrives while the PCIe MUX
switches the GPU to it; it imports the context, waits until the host says the GPU is its
own, copies the requested chunk through the driver copy API, exports the context, asks the
host to switch the GPU back and, without waiting for that, replies (the orchestrator imports
the context while the switch runs). A request it cannot serve is refused, but it still
waits for the GPU and returns the context and the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ..errors import IllegalTransition
from ..messages import ChunkInfo, TravelRefused, TravelRequest, TravelResult
from .manifest import chunk_digest_from_manifest


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

    def _expect(self, phase: HolderPhase, action: str) -> None:
        if self.phase is not phase:
            raise IllegalTransition(f"holder {self.name}", self.phase.value, action)

    def on_request(self, req: TravelRequest, now: float) -> ImportBlob | AwaitGpu:
        self._expect(HolderPhase.IDLE, "take a travel request")
        self._req, self._marks, self._chunk, self._arrival, self._blob = req, {"start": now}, None, -1, b""
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
        self.phase = HolderPhase.ATTACH
        return AwaitGpu()

    def attached(self, now: float) -> CopyChunk | SwitchBack:
        """The host says the GPU is ours: copy (or, refusing, send it straight back)."""
        self._expect(HolderPhase.ATTACH, "take the GPU")
        self._marks["dh_switch"] = now
        if self._refusal is not None:
            for name in ("dh_copy", "dh_export"):
                self._marks[name] = now
            self.phase = HolderPhase.SWITCH
            return SwitchBack()
        req = self._req
        assert req is not None
        nbytes = min(req.buffer_bytes, self.dataset_bytes - req.dataset_offset)
        self.phase = HolderPhase.COPY
        return CopyChunk(req.buffer_offset, req.buffer_bytes, req.dataset_offset, nbytes)

    def attach_failed(self, reason: str, now: float) -> ExportBlob | SwitchBack:
        """The GPU never became ours: refuse, hand back the context (exported again if we
        imported it) and ask for the switch home all the same."""
        self._expect(HolderPhase.ATTACH, "give up waiting for the GPU")
        imported = self._refusal is None  # in this phase: unless refusing, we imported
        self._refusal = self._refusal or reason
        for name in ("dh_switch", "dh_copy"):
            self._marks[name] = now
        if not imported:  # refusing already: the context is untouched
            self._marks["dh_export"] = now
            self.phase = HolderPhase.SWITCH
            return SwitchBack()
        self.phase = HolderPhase.EXPORT
        return ExportBlob()

    def audited(self, nonzero: int) -> None:
        """Record what an arrival audit found in the buffer (non-zero bytes before copying)."""
        self._expect(HolderPhase.COPY, "record an arrival audit")
        self._arrival = nonzero

    def copied(self, nbytes: int, now: float) -> ExportBlob:
        self._expect(HolderPhase.COPY, "finish copying")
        req = self._req
        assert req is not None
        digest = chunk_digest_from_manifest(self.manifest, req.dataset_offset, nbytes, self.piece_bytes)
        self._chunk = ChunkInfo(dataset_offset=req.dataset_offset, nbytes=nbytes, digest=digest)
        self._marks["dh_copy"] = now
        self.phase = HolderPhase.EXPORT
        return ExportBlob()

    def copy_failed(self, reason: str, now: float) -> ExportBlob:
        """The copy was refused locally or by the device: still export and go home."""
        self._expect(HolderPhase.COPY, "fail a copy")
        self._refusal = reason
        self._marks["dh_copy"] = now
        self.phase = HolderPhase.EXPORT
        return ExportBlob()

    def exported(self, blob: bytes, now: float) -> SwitchBack:
        self._expect(HolderPhase.EXPORT, "finish exporting")
        self._blob = blob
        self._marks["dh_export"] = now
        self.phase = HolderPhase.SWITCH
        return SwitchBack()

    def switch_requested(self, now: float) -> Reply:
        """The switch home is asked for: reply now, the orchestrator imports while it runs."""
        self._expect(HolderPhase.SWITCH, "ask for the switch back")
        m = self._marks
        steps = {
            "dh_import": m["dh_import"] - m["start"],
            "dh_switch": m["dh_switch"] - m["dh_import"],  # what the MUX made us wait, after importing
            "dh_copy": m["dh_copy"] - m["dh_switch"],
            "dh_export": m["dh_export"] - m["dh_copy"],
            "handler": now - m["start"],
        }
        steps_ns = {k: int(v * 1e9) for k, v in steps.items()}
        req = self._req
        assert req is not None
        self.phase = HolderPhase.IDLE
        if self._refusal is not None or self._chunk is None:
            return Reply(TravelRefused(req.travel_id, self._blob, self._refusal or "copy failed", steps_ns))
        return Reply(TravelResult(req.travel_id, self._blob, self._chunk, steps_ns, self._arrival))
