"""Orders the red team's driver gives its adversaries, and what they report back.

The malicious host is ordered over a Unix socket in its work directory; the malicious holder
over the control link the supervisor already has to it. None of this crosses a trust
boundary of the threat model: it is how the attackers coordinate (collusion, paper 6.3).
Reports never carry plaintext or keys, only what happened; what an attacker read goes to its
loot files, which the driver scans.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..wire import message


@message("redteam.mark_row")
@dataclass(frozen=True)
class MarkRow:
    """From now on, put what you read in the loot of this attack."""

    row: str


# ----------------------------------------------------------------------------- host orders
@message("redteam.host.tamper")
@dataclass(frozen=True)
class ArmTamper:
    """During ``victim``'s next travel (pushes counted from 0 from the switch to it):

    - ``flip``: when it submits user push ``user_push``, flip a bit of the record in
      ``staging_slot`` before relaying the doorbell (the doorbell of the push before is held
      back, so the device hears of both at once);
    - ``replay``: when it asks for the GPU to go back, write its push ``user_push`` (captured
      earlier in the travel) back as a new entry and ring the doorbell."""

    victim: str
    kind: str  # "flip" | "replay"
    user_push: int
    staging_slot: int


@message("redteam.host.drop")
@dataclass(frozen=True)
class ArmDrop:
    """Once ``after_return_of`` has asked for the GPU to go back to the orchestrator (at once
    if it is empty), drop every doorbell until ``kernel_rings`` doorbells of the orchestrator
    that announced kernel-channel work have been dropped."""

    after_return_of: str
    kernel_rings: int


@message("redteam.host.expose")
@dataclass(frozen=True)
class ArmExposePrefix:
    """On the orchestrator's next doorbell that announces kernel work, let the device see
    only the first ``entries`` pending kernel entries (BAR0 ``put`` rewritten)."""

    entries: int


@message("redteam.host.route")
@dataclass(frozen=True)
class ArmRoute:
    """The next switch to ``target`` that ``requester`` asks for maps ``dma``'s memory and
    routes ``irq``'s interrupt instead (the reply still says ``target``)."""

    requester: str
    target: str
    dma: str
    irq: str


@message("redteam.host.switch")
@dataclass(frozen=True)
class ForceSwitch:
    """Switch the GPU now, unasked. ``hide_kernel``: first make the device's pending
    kernel-channel work invisible (BAR0 put := get); switching without it restores it."""

    dma: str
    irq: str
    hide_kernel: bool


@message("redteam.host.records")
@dataclass(frozen=True)
class ExportRecords:
    """Write every staging record and push captured from ``cvm`` so far to ``path``."""

    cvm: str
    path: str


@message("redteam.host.query")
@dataclass(frozen=True)
class HostQuery:
    pass


@message("redteam.host.news")
@dataclass(frozen=True)
class HostNews:
    events: tuple[str, ...]  # since the last report
    user_faults: int  # device fault flags the host saw raised in BAR0, since the last report
    kernel_faults: int
    error: str  # "" unless the order failed


# ----------------------------------------------------------------------------- holder orders
@message("redteam.holder.mode")
@dataclass(frozen=True)
class SetTravelMode:
    """How to behave on the next travel: honest, dump, work-after-return, stale-epoch,
    stale-counters, altered-keys, corrupted, never-return."""

    mode: str


@message("redteam.holder.kept")
@dataclass(frozen=True)
class UseKeptKeys:
    """With each context blob kept so far (newest first, at most ``blobs``), join the device's
    queues where they stand and read the dataset buffer, and ask an encrypted RPC."""

    blobs: int
    timeout: float


@message("redteam.holder.decrypt")
@dataclass(frozen=True)
class DecryptCaptured:
    """Try every kept key on the ciphertext the host captured (``path``, see ExportRecords)."""

    path: str


@message("redteam.holder.query")
@dataclass(frozen=True)
class HolderQuery:
    pass


@message("redteam.holder.news")
@dataclass(frozen=True)
class HolderNews:
    events: tuple[str, ...]  # since the last report
    errors: tuple[str, ...]  # the typed errors its attempts ended in (class names)
    bytes_read: int  # bytes it read back from the device (decrypted), any holder's
    nonzero_read: int  # how many of those were not zero
    decrypted: int  # ciphertexts it managed to decrypt with kept keys
    attempts: int
