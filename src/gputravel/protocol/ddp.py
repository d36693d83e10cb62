"""Messages between data-parallel ranks setting up their pair keys (ddp/keys.py): encoded bytes,
never pickles, so nobody can make a rank unpickle objects before it is attested."""

from __future__ import annotations

from gputravel.protocol.codec import Message


class KeyShare(Message, tag="ddp.key_share"):
    """A rank's ephemeral ECDH key and its TEE's evidence binding it (ddp.keys.report_data)."""

    rank: int
    world_size: int
    public_key: bytes  # P-384, uncompressed X9.62 point
    evidence: bytes


class KeyVerdict(Message, tag="ddp.key_verdict"):
    """Which peers a rank refused; every rank tells every other, so all stop together."""

    rank: int
    refused: tuple[int, ...]
