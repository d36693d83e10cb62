"""Pacing one end of a TLS connection on token-bucket links (the fallback where network
namespaces are unavailable): each party paces what it sends itself, so this sits below them."""

from __future__ import annotations

from gputravel.errors import BadInput
from gputravel.net.bucket import TokenBucket


def pace(conn: object, pace_mbit: float | None) -> None:
    """Give one end of a TLS connection its own token bucket (one per direction, as a duplex
    link has); nothing when there is no rate to keep."""
    if pace_mbit is None:
        return
    if not hasattr(conn, "pace"):
        raise BadInput(f"{conn!r} cannot be paced: only stream transports can")
    conn.pace(TokenBucket.from_mbit(pace_mbit))
