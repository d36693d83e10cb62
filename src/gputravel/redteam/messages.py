"""Orders the red team's driver gives its adversaries, and what they report back.

The malicious host is ordered over a Unix socket in its work directory; the malicious holder
over the control link the supervisor already has to it. None of this crosses a trust
boundary of the threat model: it is how the attackers coordinate (collusion, paper 6.3).
Reports never carry plaintext or keys, only what happened; what an attacker read goes to its
loot files, which the driver scans.
"""

from __future__ import annotations

from gputravel.protocol.codec import Message


class MarkRow(Message, tag="redteam.mark_row"):
    """From now on, put what you read in the loot of this attack."""

    row: str


# ----------------------------------------------------------------------------- host orders
class ArmTamper(Message, tag="redteam.host.tamper"):
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


class ArmDrop(Message, tag="redteam.host.drop"):
    """Once ``after_return_of`` has asked for the GPU to go back to the orchestrator (at once
    if it is empty), drop every doorbell until ``kernel_rings`` doorbells of the orchestrator
    that announced kernel-channel work have been dropped."""

    after_return_of: str
    kernel_rings: int


class ArmExposePrefix(Message, tag="redteam.host.expose"):
    """On the orchestrator's next doorbell that announces kernel work, let the device see
    only the first ``entries`` pending kernel entries (BAR0 ``put`` rewritten)."""

    entries: int


class ArmForgeGet(Message, tag="redteam.host.forge_get"):
    """Once the orchestrator has sent the GPU to ``victim``, at the next switch back to the
    orchestrator (asked by anyone), forge BAR0's kernel GPFIFO ``get`` to ``put + 1``: to the
    orchestrator, which reads ``get`` to find room, the kernel ring then looks full just as it
    submits the rotation after the travel. After ``hold_s`` seconds (once the orchestrator has
    given up on the rotation and its retry) the host writes the real ``get`` back, unless the
    device has written ``get`` since, so that the next travel finds room again."""

    victim: str
    hold_s: float


class ArmRoute(Message, tag="redteam.host.route"):
    """The next switch to ``target`` that ``requester`` asks for maps ``dma``'s memory and
    routes ``irq``'s interrupt instead (the reply still says ``target``)."""

    requester: str
    target: str
    dma: str
    irq: str


class ForceSwitch(Message, tag="redteam.host.switch"):
    """Switch the GPU now, unasked. ``hide_kernel``: first make the device's pending
    kernel-channel work invisible (BAR0 put := get); switching without it restores it."""

    dma: str
    irq: str
    hide_kernel: bool


class ExportRecords(Message, tag="redteam.host.records"):
    """Write every staging record and push captured from ``cvm`` so far to ``path``."""

    cvm: str
    path: str


class HostQuery(Message, tag="redteam.host.query"):
    pass


class HostNews(Message, tag="redteam.host.news"):
    events: tuple[str, ...]  # since the last report
    user_faults: int  # device fault flags the host saw raised in BAR0, since the last report
    kernel_faults: int
    error: str  # "" unless the order failed


# ----------------------------------------------------------------------------- holder orders
class SetTravelMode(Message, tag="redteam.holder.mode"):
    """How to behave on the next travel: honest, dump, work-after-return, stale-epoch,
    stale-counters, counters-forward, altered-keys, corrupted, refuse, never-return, vanish."""

    mode: str


class UseKeptKeys(Message, tag="redteam.holder.kept"):
    """With each context blob kept so far (newest first, at most ``blobs``), join the device's
    queues where they stand and read the dataset buffer, and ask an encrypted RPC."""

    blobs: int
    timeout: float


class DecryptCaptured(Message, tag="redteam.holder.decrypt"):
    """Try kept keys on the ciphertext the host captured (``path``, see ExportRecords): those
    of every blob kept, or (``newest`` > 0) of the newest ``newest`` blobs only."""

    path: str
    newest: int


class HolderQuery(Message, tag="redteam.holder.query"):
    pass


class HolderNews(Message, tag="redteam.holder.news"):
    events: tuple[str, ...]  # since the last report
    errors: tuple[str, ...]  # the typed errors its attempts ended in (class names)
    bytes_read: int  # bytes it read back from the device (decrypted), any holder's
    nonzero_read: int  # how many of those were not zero
    decrypted: int  # ciphertexts it managed to decrypt with kept keys
    attempts: int


# ----------------------------------------------------------------------------- both
class ProbeTarget(Message, tag="redteam.probe.target"):
    """Something of another party to try to read: ``how`` is "read" (open the path and read
    ``ranges``, each (offset, length); none: from the start) or "list" (list a directory)."""

    label: str
    path: str
    how: str
    ranges: tuple[tuple[int, int], ...]


class ProbePaths(Message, tag="redteam.probe"):
    """Host or holder: from your own process (your uid), try to read each target; keep what
    you get in your loot; report, for each, what you got (``probe LABEL: ...`` events)."""

    targets: tuple[ProbeTarget, ...]
    note: str  # what the row calls this batch, in the events


class AskQuote(Message, tag="redteam.quote"):
    """Host or holder: ask the TDX module at ``socket_path`` for a quote over ``report_data``
    (binding a TLS key of your own choosing); keep whatever comes back in your loot."""

    socket_path: str
    report_data: bytes
