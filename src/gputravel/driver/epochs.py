"""Who has had each key epoch's user keys (sans-IO): at most one party, since a holder that kept
them reads everything sent under them (docs/security.md, "Key epochs"). Only a device-confirmed
rotation or a new SPDM session moves it; the orchestrator's RPCs (nothing secret) are not counted."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from gputravel.errors import EpochSpent, TravelHalted


class EpochUse(Enum):
    FRESH = "fresh"  # installed, no party has moved data under it
    EXPORTED = "exported"  # its user keys left for one holder's travel
    ORCHESTRATOR = "used by the orchestrator"  # the orchestrator copied data under it


@dataclass
class EpochLedger:
    session: int = 0  # SPDM sessions opened; epochs restart with each (new secret, new keys)
    epoch: int = -1
    use: EpochUse = EpochUse.FRESH
    halted: str | None = None  # why no context may leave and no data may move

    def new_session(self) -> None:
        """A new secret, epoch 0, VRAM wiped by the device: clears a halt."""
        self.session += 1
        self.epoch, self.use, self.halted = 0, EpochUse.FRESH, None

    def rotated(self, epoch: int) -> None:
        """The device confirmed ``epoch`` under the new kernel key: keys no party had, ending a halt."""
        if epoch <= self.epoch:
            raise EpochSpent(f"key epoch {epoch} is not newer than epoch {self.epoch}")
        self.epoch, self.use, self.halted = epoch, EpochUse.FRESH, None

    def halt(self, why: str) -> None:
        if self.halted is None:
            self.halted = why

    def export(self) -> int:
        """Hand the current epoch to one holder; refused if any party had it before."""
        self._check_not_halted("export the context")
        if self.use is not EpochUse.FRESH:
            raise EpochSpent(f"key epoch {self.epoch} was already {self.use.value}: it cannot travel "
                             "(rotate the keys first)")
        self.use = EpochUse.EXPORTED
        return self.epoch

    def use_for_copy(self) -> None:
        """The orchestrator moves data under the current epoch; refused if a holder had it."""
        self._check_not_halted("copy data")
        if self.use is EpochUse.EXPORTED:
            raise EpochSpent(f"key epoch {self.epoch} was exported to a holder: the orchestrator does not copy "
                             "under it (rotate the keys first)")
        self.use = EpochUse.ORCHESTRATOR

    @property
    def fresh(self) -> bool:
        return self.halted is None and self.use is EpochUse.FRESH

    def _check_not_halted(self, action: str) -> None:
        if self.halted is not None:
            raise TravelHalted(f"cannot {action}: {self.halted}; until the device confirms a rotation or a new SPDM "
                                "session re-keys the GPU")
