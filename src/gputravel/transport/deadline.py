"""Waiting on a socket against a deadline, in slices of at most :data:`WAKE_SLICE`, so a blocked
thread sees a close by another (``close`` never calls ``shutdown``: see :mod:`.stream`)."""

from __future__ import annotations

import math
import select
import time

from gputravel.errors import PeerTimeout

WAKE_SLICE = 0.05  # longest single poll: bounds how late a blocked thread sees close()


def wait_ready(poller: select.poll, deadline: float | None) -> bool:
    """Wait until ``poller`` fires (True) or the wait ends early (False, caller retries);
    raises PeerTimeout once ``deadline`` has passed."""
    if deadline is None:
        return bool(poller.poll(WAKE_SLICE * 1000))
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise PeerTimeout("deadline passed")
    # Round up: never spin on a sub-millisecond remainder.
    return bool(poller.poll(math.ceil(min(remaining, WAKE_SLICE) * 1000)))
