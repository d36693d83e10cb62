"""Orchestrator <-> data holder, over attested TLS."""

from __future__ import annotations

from dataclasses import dataclass, field

from gputravel.protocol.codec import message


@message("travel.hello")
@dataclass(frozen=True)
class HolderHello:
    """Holder -> orchestrator on joining: its dataset's size and manifest (SHA-256 per piece),
    and the tokenizer its tokens were made with ("" for a dataset of raw bytes)."""

    holder: str
    dataset_bytes: int
    piece_bytes: int
    manifest: tuple[bytes, ...]
    tokenizer: str


@message("travel.welcome")
@dataclass(frozen=True)
class Welcome:
    cohort: str


@message("travel.request")
@dataclass(frozen=True)
class TravelRequest:
    """Orchestrator -> holder: the GPU is switched to you; fill ``buffer`` from ``offset``."""

    travel_id: int
    buffer_offset: int
    buffer_bytes: int
    dataset_offset: int
    context: bytes = field(repr=False)  # context blob: keys inside, never printed


@message("travel.chunk")
@dataclass(frozen=True)
class ChunkInfo:
    dataset_offset: int
    nbytes: int
    digest: bytes  # SHA-256 over the SHA-256 of each piece of the chunk


@message("travel.result")
@dataclass(frozen=True)
class TravelResult:
    travel_id: int
    context: bytes = field(repr=False)  # context blob: keys inside, never printed
    chunk: ChunkInfo
    steps_ns: dict[str, int]  # dh_import, dh_copy, dh_export, o_switch, handler
    #: Non-zero bytes the holder found in the buffer on arrival (-1: not checked). A holder
    #: may read the buffer back before copying to audit that the previous chunk was scrubbed.
    nonzero_on_arrival: int


@message("travel.refused")
@dataclass(frozen=True)
class TravelRefused:
    """The holder could not copy; it still sent the GPU home and returned the context."""

    travel_id: int
    context: bytes = field(repr=False)  # context blob: keys inside, never printed
    reason: str
    steps_ns: dict[str, int]


@message("travel.bye")
@dataclass(frozen=True)
class Bye:
    reason: str
