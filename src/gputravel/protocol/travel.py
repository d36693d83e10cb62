"""Orchestrator <-> data holder, over attested TLS."""

from __future__ import annotations

from gputravel.protocol.codec import Message


class HolderHello(Message, tag="travel.hello", secret=("log_key",)):
    """Holder -> orchestrator on every join: its dataset's size and manifest (SHA-256 per
    piece), its tokenizer ("" for raw bytes or records), its records' schema and split, and its
    travel-log key."""

    holder: str
    dataset_bytes: int
    piece_bytes: int
    manifest: tuple[bytes, ...]
    tokenizer: str
    # A record dataset's schema, canonical JSON (data/records.py; "": tokens or raw bytes), and
    # how many training then held-out records it lays out (0, 0 for tokens or raw bytes).
    schema: str
    train_records: int
    eval_records: int
    # False: booted after the orchestrator, not probed the GPU yet (paper 4.1): lent it first.
    probed: bool
    # Keys the public travel log's chunk MACs (manifest.chunk_mac), never the guessable digest;
    # sent only here, inside the attested TLS channel.
    log_key: bytes


class Welcome(Message, tag="travel.welcome"):
    cohort: str


class ProbeNow(Message, tag="travel.probe_now"):
    """Orchestrator -> a late holder, between travels, no key exported: probe the GPU now."""


class ProbeDone(Message, tag="travel.probe_done"):
    holder: str


class TravelRequest(Message, tag="travel.request", secret=("context",)):
    """Orchestrator -> holder: the GPU is switched to you; fill ``buffer`` from ``offset``."""

    travel_id: int
    buffer_offset: int
    buffer_bytes: int
    dataset_offset: int
    context: bytes  # context blob: keys inside, never printed


class ChunkInfo(Message, tag="travel.chunk"):
    dataset_offset: int
    nbytes: int
    digest: bytes  # SHA-256 over the SHA-256 of each piece of the chunk


class TravelResult(Message, tag="travel.result", secret=("context",)):
    travel_id: int
    context: bytes  # context blob: keys inside, never printed
    chunk: ChunkInfo
    steps_ns: dict[str, int]  # dh_import, dh_copy, dh_export, o_switch, handler
    nonzero_on_arrival: int  # non-zero bytes found in the buffer before copying (-1: not audited)


class TravelRefused(Message, tag="travel.refused", secret=("context",)):
    """The holder could not copy; it still sent the GPU home and returned the context."""

    travel_id: int
    context: bytes  # context blob: keys inside, never printed
    reason: str
    steps_ns: dict[str, int]


class Bye(Message, tag="travel.bye"):
    reason: str


# The centralised TLS baseline (paper 7.2): the chunk itself crosses this link, in order.
class SendChunk(Message, tag="baseline.send_chunk"):
    """Orchestrator -> holder over TLS: send me these bytes of your dataset."""

    travel_id: int
    dataset_offset: int
    nbytes: int


class ChunkPiece(Message, tag="baseline.piece"):
    """Holder -> orchestrator: the next piece of the chunk, in order."""

    travel_id: int
    offset: int  # within the chunk
    data: bytes


class ChunkSent(Message, tag="baseline.sent"):
    """Holder -> orchestrator: the whole chunk has been sent."""

    travel_id: int
    nbytes: int
    read_ns: int  # time the holder spent reading its dataset


class ChunkRefused(Message, tag="baseline.refused"):
    travel_id: int
    reason: str


class JobResults(Message, tag="travel.job_results"):
    """Orchestrator -> holder when the job is done (issue 28): the held-out metrics, numbers only,
    per holder and over all; and the release the holders are asked to sign: the manifest they
    approved and the statement (release/statement.py, encoded) of exactly this model, job and
    recipients ("" and b"" where the manifest keeps the model sealed)."""

    metrics: dict[str, dict[str, float]]
    manifest_json: str
    statement: bytes


class ReleaseSigned(Message, tag="travel.release_signed"):
    signature: bytes  # an encoded release/statement.py ReleaseSignature


class ReleaseDeclined(Message, tag="travel.release_declined"):
    reason: str
