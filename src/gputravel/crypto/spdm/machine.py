"""What the requester and responder state machines share: state, transcript, secret."""

from __future__ import annotations

from gputravel.crypto.spdm.p384 import Rng
from gputravel.crypto.spdm.transcript import Transcript
from gputravel.errors import BadInput, IllegalTransition


class Machine:
    _role = "spdm"

    def __init__(self, rng: Rng) -> None:
        if not callable(rng):
            raise BadInput("rng must be callable")
        self._rng = rng
        self._state = "idle"
        self._transcript = Transcript()
        self._secret: bytes | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(state={self._state!r})"

    @property
    def state(self) -> str:
        return self._state

    @property
    def transcript(self) -> bytes:
        """The canonical transcript so far (public data: no secrets)."""
        return self._transcript.bytes()

    @property
    def session_secret(self) -> bytes:
        """The 48-byte export master secret; only once the session is established."""
        if self._secret is None:
            raise IllegalTransition(self._role, self._state, "read the session secret")
        return self._secret

    def _expect(self, state: str, action: str) -> None:
        if self._state != state:
            raise IllegalTransition(self._role, self._state, action)

    def _fail(self, exc: Exception) -> Exception:
        # After an authentication failure the session is dead: no retry on the same state.
        self._state = "failed"
        return exc
