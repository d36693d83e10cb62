"""Typed errors, split into local (our own misuse or bad input) and remote (a peer misbehaved).

Error messages never carry key material, plaintext or context blobs: they name what failed
and what to fix.
"""

from __future__ import annotations


class GputravelError(Exception):
    """Base of every error gputravel raises on purpose."""


# ----------------------------------------------------------------------------- local errors
class LocalError(GputravelError):
    """Something on this side is wrong: bad input, bad configuration, misuse of an API."""


class Terminated(LocalError):
    """This process was asked to stop (SIGTERM) while it ran a deployment of processes."""


class BadInput(LocalError):
    """An argument or configuration value is invalid; the message says what to fix."""


class TravelLogMismatch(BadInput):
    """A job resumed from its checkpoint, but the travel log beside it is not the one that
    checkpoint was taken in (missing, empty, another job's, or without the entry it names): the
    orchestrator refuses to travel rather than start a log that leaves earlier travels out."""


def number_in(value: float, flag: str, low: float = 0.0, high: float = float("inf"), *,
              low_included: bool = False, unit: str = "") -> float:
    """`value` if it is a finite number above `low` (or equal to it, with `low_included`) and at
    most `high`; else BadInput naming `flag`. NaN and infinity are refused too (every comparison
    with NaN is false, so a range check alone would let it through)."""
    above = value >= low if low_included else value > low
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or value in (float("inf"), float("-inf")) or not above or value > high:
        bound = f"at least {low:g}" if low_included else ("positive" if low == 0 else f"above {low:g}")
        top = f" and at most {high:g}{unit}" if high != float("inf") else ""
        raise BadInput(f"{flag} must be a finite number, {bound}{top}, got {value!r}")
    return value


class IllegalTransition(LocalError):
    """A protocol state machine was asked to do something its current state does not allow."""

    def __init__(self, role: str, state: str, action: str) -> None:
        super().__init__(f"{role}: cannot {action} in state {state}")
        self.role = role
        self.state = state
        self.action = action


class EpochSpent(LocalError):
    """A key epoch's user keys already reached a party: they may not reach another
    (driver/epochs.py). The orchestrator must rotate before it exports or copies."""


class CounterExhausted(LocalError):
    """An IV counter would wrap: the channel must be re-keyed before it is used again."""


# ----------------------------------------------------------------------------- remote errors
class RemoteError(GputravelError):
    """A peer (process, device, holder, host) sent something wrong or failed to answer."""


class IntegrityError(RemoteError):
    """Authenticated decryption failed. Deliberately opaque: which byte or key is never said."""

    def __init__(self, what: str = "authenticated decryption failed") -> None:
        super().__init__(what)


class PeerAttestationError(RemoteError):
    """A rank of a data-parallel job refused another's evidence before any gradient moved: the
    evidence did not verify, or did not carry the key the rank offered (ddp/keys.py)."""

    def __init__(self, what: str, *, refused: tuple[tuple[int, int], ...] = ()) -> None:
        super().__init__(what)
        self.refused = refused  # (refusing rank, refused rank) pairs, as far as this rank knows


class ProtocolError(RemoteError):
    """A message or blob could not be decoded or is not valid in this protocol state."""


class ContextBlobError(ProtocolError):
    """A context blob is corrupted, of an unknown version, or from another key epoch."""


class ChannelFaulted(RemoteError):
    """The device faulted a channel after an integrity failure; the orchestrator must reset it."""


class DeviceError(RemoteError):
    """The device rejected a command (bad address, out-of-range copy, unmapped DMA)."""


class PeerTimeout(RemoteError):
    """A peer did not answer in time (a dropped push, a holder that never returns the GPU)."""


class TravelHalted(RemoteError):
    """Fail closed: the orchestrator cannot show that the GPU moved to keys no holder had (a
    rotation was not confirmed), so no context leaves and no data moves until a new SPDM
    session re-keys and wipes the GPU. If that fails too, the cohort stops with this error."""


class TransportClosed(RemoteError):
    """The peer closed the connection."""


class HolderLost(RemoteError):
    """A data holder died, hung or broke the protocol during a travel. The orchestrator has
    taken the GPU back and rotated the keys; the partial chunk is never used; the holder is
    offline until it joins again."""

    def __init__(self, holder: str, why: str, during: str = "a travel") -> None:
        super().__init__(f"holder {holder!r} lost during {during}: {why}")
        self.holder = holder


class ContextRefused(HolderLost, ContextBlobError):
    """A holder returned a context it could not have (keys, counters or positions it did not
    get or could not reach): it is dropped, as a lost holder is, and the GPU is recovered by
    the rotation under way, so training goes on without it."""

    def __init__(self, holder: str, why: str) -> None:
        super().__init__(holder, f"it returned a context that was refused: {why}")

