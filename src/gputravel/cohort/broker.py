"""The launcher's side of the key broker (broker/, standing for Trustee/KBS): where it listens and
keeps its secret, and which orchestrator measurement it serves. It starts before the orchestrator,
told the measurement the launcher took, so only that code (with any job: the key is bound to the
job in RTMR[3]) is ever granted a key. Its identity key is made here first, before the orchestrator
is measured: the orchestrator's config carries the public half (`broker_key`) and takes keys only
from a broker that signs with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gputravel.broker.state import broker_public_key
from gputravel.errors import BadInput

if TYPE_CHECKING:
    from gputravel.cohort.placement import Placement

__all__ = ["KEY", "BrokerLaunch"]

KEY = "key-broker"  # the child's key and role in the supervisor


class BrokerLaunch:
    """A broker for one cohort. `state_dir` outlives the cohort where a run may resume from its
    sealed checkpoint; None keeps the secret in the cohort's directory, gone when it closes."""

    def __init__(self, place: Placement, directory: Path, roots: Path, state_dir: str | None) -> None:
        home = directory / "broker"
        home.mkdir(mode=0o711)
        place.own(home, KEY, 0o711)  # the broker binds here; others may only reach the socket
        self.socket = place.path(home / "broker.sock")
        state = Path(state_dir) if state_dir else home / "state"
        try:
            state.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise BadInput(f"cannot make the key broker's directory {state}: {exc.strerror}") from None
        # Made (or loaded: a resumed run keeps its broker) before the broker's uid is given the directory.
        self.public_key = broker_public_key(state)  # SubjectPublicKeyInfo DER, hex: the orchestrator's broker_key
        self._base = {"socket": self.socket, "state_dir": _given(place, state, outside=bool(state_dir)),
                      "trust_dir": place.path(roots)}

    def config(self, measurement: bytes) -> dict:
        """The broker's configuration, serving the orchestrator of this measurement only."""
        return {**self._base, "accepted_measurements": [measurement.hex()]}


def _given(place: Placement, state: Path, outside: bool) -> str:
    """The broker's state directory, its uid's, as the broker names it. One outside the cohort's
    directory (kept for a resume) is lent for the cohort's life, named through a descriptor."""
    if not outside:
        place.own(state, KEY)
        return place.path(state)
    place.lend_dir(KEY, str(state))
    return place.output(KEY, str(state))
