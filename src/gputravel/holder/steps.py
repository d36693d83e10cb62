"""What a data holder's travel machine (holder/machine.py) is told (events, reported by
holder/cvm.py after each step) and what it asks for (actions: one IO step each)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gputravel.protocol.travel import TravelRefused, TravelRequest, TravelResult


# ----------------------------------------------------------------------------- events
@dataclass(frozen=True)
class Attest:
    """Attest the orchestrator: joining, or told AttestDue (between travels, the GPU home)."""

    joining: bool


@dataclass(frozen=True)
class Attested:
    valid_s: float  # our policy's age limit for what we just verified


@dataclass(frozen=True)
class HelloAnswered:
    message: object  # a Welcome, or anything else (a Bye with its reason)


@dataclass(frozen=True)
class Request:
    request: TravelRequest


@dataclass(frozen=True)
class BaselineAsked:
    """The orchestrator asks for a chunk in plaintext (the TLS baseline, paper 7.2)."""


@dataclass(frozen=True)
class Imported:
    pass


@dataclass(frozen=True)
class Attached:
    pass


@dataclass(frozen=True)
class Audited:
    nonzero: int  # non-zero bytes found in the buffer before copying


@dataclass(frozen=True)
class Granted:
    nbytes: int  # the size of the buffer the device says the orchestrator granted


@dataclass(frozen=True)
class Copied:
    nbytes: int


@dataclass(frozen=True)
class StepFailed:
    """The pending step failed (the error names what is wrong, never a value)."""

    reason: str


@dataclass(frozen=True)
class SwitchAsked:
    pass


@dataclass(frozen=True)
class Exported:
    blob: bytes = field(repr=False)


@dataclass(frozen=True)
class Replied:
    pass


@dataclass(frozen=True)
class SwitchedHome:
    pass


# ----------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class Challenge:
    """Attest the orchestrator (our nonce, its quote and fresh GPU evidence)."""


@dataclass(frozen=True)
class Introduce:
    """Send our hello (name, dataset size, manifest) and wait for the answer."""


@dataclass(frozen=True)
class ImportBlob:
    blob: bytes = field(repr=False)


@dataclass(frozen=True)
class AwaitGpu:
    pass


@dataclass(frozen=True)
class AuditArrival:
    buffer_offset: int
    buffer_bytes: int


@dataclass(frozen=True)
class CheckBuffer:
    buffer_offset: int


@dataclass(frozen=True)
class CopyChunk:
    buffer_offset: int
    buffer_bytes: int  # what the request asked for
    dataset_offset: int
    nbytes: int
    granted_bytes: int  # what the device granted (at least buffer_bytes)


@dataclass(frozen=True)
class ExportBlob:
    pass


@dataclass(frozen=True)
class SwitchBack:
    pass


@dataclass(frozen=True)
class Reply:
    message: TravelResult | TravelRefused


@dataclass(frozen=True)
class AwaitSwitchHome:
    pass


#: Every action the machine returns (DataHolder.ACTIONS carries out each).
ACTIONS = (Challenge, Introduce, ImportBlob, AwaitGpu, AuditArrival, CheckBuffer, CopyChunk, SwitchBack, ExportBlob,
           Reply, AwaitSwitchHome)
