"""What the malicious holder does offline with context blobs and keys it kept: forge a blob
to hand back in place of the one it exported, and try kept keys on ciphertext at guessed IVs.
(redteam/holder.py uses these; the checks they meet are the orchestrator's and the device's.)
"""

from __future__ import annotations

import os

from msgspec import structs

from gputravel.crypto.channel import Receiver
from gputravel.driver.context import DriverContext, unpack_context
from gputravel.errors import GputravelError


def rewound(ctx: DriverContext) -> DriverContext:
    """Every message counter and the semaphore back to zero: the IVs of this epoch used again."""
    senders = tuple(structs.replace(s, message_counter=0) for s in ctx.senders)
    return structs.replace(ctx, senders=senders, semaphore=0)


def pushed_forward(ctx: DriverContext) -> DriverContext:
    """Everything forward, as a travel may move it, except that one channel counter moves too:
    the orchestrator's next IVs on that channel would no longer be the device's."""
    first, *rest = ctx.senders
    return structs.replace(ctx, senders=(structs.replace(first, channel_counter=first.channel_counter + 1),
                                             *rest))


def rekeyed(ctx: DriverContext) -> DriverContext:
    """The first sender's key replaced by one of mallory's own."""
    first, *rest = ctx.senders
    return structs.replace(ctx, senders=(structs.replace(first, key=os.urandom(32)), *rest))


def kept_states(blobs: list[bytes], layout: str) -> list:
    """Every sender and receiver state in the kept blobs: the keys worth trying."""
    out = []
    for blob in blobs:
        ctx = unpack_context(blob, layout=layout)
        out.extend(ctx.senders + ctx.receivers)
    return out


def try_open(state, message: int, ct: bytes) -> bytes | None:
    """The plaintext if ``ct`` opens as message ``message`` on ``state``'s key and channel; else None."""
    try:
        rx = Receiver.from_state(structs.replace(state, message_counter=0))
        return rx.accept_at(message, state.channel_counter, ct)
    except GputravelError:
        return None


#: The forged blobs a travel mode hands back, and how the news says what was forged.
FORGERIES = {
    "stale-counters": (rewound, "counters rewound"),
    "counters-forward": (pushed_forward, "the channel counter of its first sender moved forward by one"),
    "altered-keys": (rekeyed, "a key replaced"),
}
