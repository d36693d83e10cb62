"""Pacing one end of a TLS connection on token-bucket links: each party paces what it sends itself."""

from __future__ import annotations

from gputravel.errors import BadInput
from gputravel.net.bucket import TokenBucket


def pace(conn: object, pace_mbit: float | None) -> None:
    """Give one end of a TLS connection its own token bucket; nothing without a rate."""
    if pace_mbit is None:
        return
    if not hasattr(conn, "pace"):
        raise BadInput(f"{conn!r} cannot be paced: only stream transports can")
    conn.pace(TokenBucket.from_mbit(pace_mbit))
