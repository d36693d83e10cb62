"""Messages between the ranks of a data-parallel job while they set up their pairwise keys
(ddp/keys.py). They travel over torch.distributed as encoded bytes, never as pickles: a peer,
or whoever sits on the wire, must not be able to make a rank unpickle objects before it has
been attested."""

from __future__ import annotations

from gputravel.protocol.codec import Message


class KeyShare(Message, tag="ddp.key_share"):
    """A rank's ephemeral ECDH public key and its TEE's evidence binding that key (report data
    = ddp.keys.report_data(rank, world_size, public_key, context))."""

    rank: int
    world_size: int
    public_key: bytes  # P-384, uncompressed X9.62 point
    evidence: bytes


class KeyVerdict(Message, tag="ddp.key_verdict"):
    """Which peers a rank refused; every rank tells every other, so all stop together."""

    rank: int
    refused: tuple[int, ...]
