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
        # Made (or loaded: a resumed run keeps its broker) before own(): the broker's uid gets the file too.
        self.public_key = broker_public_key(state)  # SubjectPublicKeyInfo DER, hex: the orchestrator's broker_key
        place.own(state, KEY)
        self._base = {"socket": self.socket, "state_dir": place.path(state), "trust_dir": place.path(roots)}

    def config(self, measurement: bytes) -> dict:
        """The broker's configuration, serving the orchestrator of this measurement only."""
        return {**self._base, "accepted_measurements": [measurement.hex()]}
