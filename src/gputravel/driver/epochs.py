"""Who has had each key epoch's user keys: the orchestrator driver's ledger (sans-IO, pure).

The invariant it enforces, where the keys live (docs/security.md, "Key epochs"):

    an epoch's user-channel keys reach at most one party: one data holder (by an export for
    its travel) or the orchestrator itself (by its own copy, as in the TLS baseline).

A holder that kept the keys of its travel, with the host's copy of every bounce buffer, reads
everything the device and anybody else ever encrypted under them. So an epoch is exported at
most once, never after the orchestrator copied data under it, and the orchestrator never
copies under an epoch it exported. The ledger moves to a new epoch only when the driver has
installed it after a rotation the device *confirmed* (a kernel semaphore under the new kernel
key) or after a new SPDM session; nothing the host can write moves it.

When a rotation cannot be shown to have happened, the ledger is *halted*: nothing is exported
and nothing copied until the device confirms a later rotation (proof that it is on an epoch no
party had: epochs only move forward, and their keys come from the session secret) or a new
SPDM session re-keys (and wipes) the GPU. Nothing else clears a halt.

What the ledger counts is data: the orchestrator's copies, and exports. The orchestrator's
encrypted RPCs (device info, buffer placement, attestation evidence: nothing secret) also run
under the user keys of the epoch it is about to export, so the holder of that epoch can read
them from the host's snapshots; they are deliberately not counted.
"""

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
        """A new SPDM session: a new secret, epoch 0, VRAM wiped by the device. Clears a halt."""
        self.session += 1
        self.epoch, self.use, self.halted = 0, EpochUse.FRESH, None

    def rotated(self, epoch: int) -> None:
        """The device confirmed its rotation to ``epoch`` under the new kernel key: it is on
        keys no party has had (epochs only move on), which also ends a halt."""
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


__all__ = ["EpochLedger", "EpochUse"]
