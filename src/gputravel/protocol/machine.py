"""What the two travel machines share (holder/machine.py, orchestrator/machine.py), sans IO.

A machine is a table ``{(phase, event type): phases it may go to}``. ``handle(event, now)``
looks the pair up, lets the machine's handler for that event check it and pick the next phase
and action, and moves there: a travel's order is written once, in the table, and checked
here. Any exception on the way (an event out of order, a peer's bad answer, a bug) leaves the
machine in its error phase, where every event is refused until ``abort()``: a runtime cannot
carry on from a half-done step by mistake (h11's rule).

Time comes in as ``now`` (seconds on the runtime's monotonic clock), as in aioquic. A phase
that waits on a peer has a time budget: ``next_deadline()`` says when the pending action must
be done, ``time_left(now)`` how long the runtime may block on it, and ``on_timeout(now)``,
past the deadline, hands the machine a ``TimedOut`` event where its table takes one (a
holder refusing the travel, say); anywhere else the machine gives up (error phase).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

from gputravel.errors import IllegalTransition


@dataclass(frozen=True)
class TimedOut:
    """The pending action was not done by its deadline (made by ``on_timeout``)."""

    waited_s: float


#: A machine's handler for one event type: (machine, event, now) -> (next phase, action).
Handler = Callable[[Any, Any, float], tuple[Enum, object]]


class TravelMachine:
    IDLE: ClassVar[Enum]
    ERROR: ClassVar[Enum]
    TABLE: ClassVar[Mapping[tuple[Enum, type], tuple[Enum, ...]]]
    HANDLERS: ClassVar[Mapping[type, Handler]]

    def __init__(self, role: str, budgets: Mapping[Enum, float]) -> None:
        self.role = role  # how errors name this party
        self._budgets = budgets  # seconds each waiting phase may take
        self._phase = self.IDLE
        self._deadline: float | None = None

    @property
    def phase(self) -> Enum:
        return self._phase

    def handle(self, event: object, now: float) -> Any:
        """Take one event; returns the action for the runtime to carry out (None: nothing)."""
        allowed = self.TABLE.get((self._phase, type(event)))
        was = self._phase
        if allowed is None:
            self._phase, self._deadline = self.ERROR, None
            raise IllegalTransition(self.role, was.value, f"take {type(event).__name__}")
        try:
            phase, action = self.HANDLERS[type(event)](self, event, now)
            if phase not in allowed:  # a handler that disagrees with the table is a bug here
                raise IllegalTransition(self.role, was.value, f"go to {phase.value} on {type(event).__name__}")
        except BaseException:
            self._phase, self._deadline = self.ERROR, None
            raise
        self._phase = phase
        budget = self._budgets.get(phase)
        self._deadline = None if budget is None else now + budget
        return action

    def accepts(self, event_type: type) -> bool:
        return (self._phase, event_type) in self.TABLE

    def abort(self) -> None:
        """Forget the travel (or exchange) under way, whatever its phase, error included: the
        runtime has dealt with what it left (the orchestrator recovered the GPU, say)."""
        self._phase, self._deadline = self.IDLE, None
        self._forget()

    def _forget(self) -> None:
        """What a machine drops on abort, beyond its phase."""

    # ------------------------------------------------------------------ time
    def next_deadline(self) -> float | None:
        return self._deadline

    def time_left(self, now: float) -> float | None:
        """How long the runtime may wait for the pending action (None: it does not wait)."""
        return None if self._deadline is None else max(self._deadline - now, 0.0)

    def on_timeout(self, now: float) -> Any:
        """The runtime's wait ended at ``now`` without the pending action done. Before the
        deadline: nothing changes (None). Past it: the machine's ``TimedOut`` transition if its
        table has one (its action is returned), else the error phase (None)."""
        if self._deadline is None or now < self._deadline:
            return None
        if self.accepts(TimedOut):
            return self.handle(TimedOut(self._budgets[self._phase]), now)
        self._phase, self._deadline = self.ERROR, None
        return None
