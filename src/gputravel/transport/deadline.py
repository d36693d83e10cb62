"""Waiting on a socket against a deadline, in slices.

No wait lasts longer than :data:`WAKE_SLICE`: a thread blocked on a socket re-checks, between
slices, whether another thread closed it (``close`` never calls ``shutdown``, which would cut
the connection for every process holding a copy of the socket).
"""

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
