"""What the two travel machines share (holder/machine.py, orchestrator/machine.py), sans IO.

A machine is a table ``{(phase, event type): phases it may go to}``, so a travel's order is
written once and checked here. Any exception on the way leaves the machine in its error phase,
refusing every event until ``abort()``: no runtime carries on from a half-done step (h11's rule).
Time comes in as ``now``; a waiting phase has a budget, and past it ``on_timeout`` hands the
machine a ``TimedOut`` where its table takes one, else the error phase.
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
        """Forget the travel under way, whatever its phase: the runtime has dealt with what it left."""
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
        """The wait ended undone: before the deadline nothing changes (None); past it, the
        ``TimedOut`` transition's action if the table has one, else the error phase (None)."""
        if self._deadline is None or now < self._deadline:
            return None
        if self.accepts(TimedOut):
            return self.handle(TimedOut(self._budgets[self._phase]), now)
        self._phase, self._deadline = self.ERROR, None
        return None
