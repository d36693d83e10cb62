"""Red-team rows where the host and mallory collude (paper 6.3): the host switches the GPU
to mallory unasked, hides or drops the orchestrator's kernel work, forges BAR0's kernel get,
and hands mallory what it captured to decrypt with the keys it kept; and the key-epoch rows
of issue 12 (the epoch ledger, driver/epochs.py).
"""

from __future__ import annotations

from gputravel.errors import PeerTimeout
from gputravel.protocol.parties import ORCHESTRATOR
from gputravel.redteam.arena import ALICE, BOB, MALLORY, Arena, Verdict, host_said, log_line, news_lines, rekeyed
from gputravel.redteam.messages import (
    ArmDrop,
    ArmExposePrefix,
    ArmForgeGet,
    DecryptCaptured,
    ExportRecords,
    ForceSwitch,
    HolderNews,
    HostNews,
    SetTravelMode,
    UseKeptKeys,
)


# How long the forged kernel get stays: past the orchestrator's last try at a rotation (each
# waits run.DEVICE_TIMEOUT = 2 s for room), not past the next travel's scrub (which waits 2 s too).
FORGE_HOLD_S = {"home": 5.0, "taken": 3.0}  # the holder came home (rotation, retry); it never did (retry only)


def switch_after_rotation(a: Arena) -> Verdict:
    victim = a.travel(ALICE)
    a.host.order(ForceSwitch(MALLORY, MALLORY, hide_kernel=False))
    news = a.mallory.order(UseKeptKeys(blobs=2, timeout=1.0), timeout=60)
    a.host.order(ForceSwitch(ORCHESTRATOR, ORCHESTRATOR, hide_kernel=False))
    host = a.host.news()
    ok, after = a.carry_on(BOB)
    stopped = victim.verified and news.attempts > 0 and news.bytes_read == 0 and ok
    return Verdict(stopped, "key rotation with a secret the holder never had: the device is on the epoch after "
                   "alice's travel, derived from the SPDM session secret; mallory's kept keys failed authentication "
                   "(user channel faulted, RPCs dropped)",
                   (victim.describe(), *news_lines(host, "host"), *news_lines(news, "mallory"), after))


def drop_rotation_then_read(a: Arena) -> Verdict:
    a.host.order(ArmDrop(after_return_of=MALLORY, kernel_rings=2))
    own = a.travel(MALLORY)
    said, journal = a.orchestrator_said(), a.journal()
    a.host.order(ForceSwitch(MALLORY, MALLORY, hide_kernel=True))
    first = a.mallory.order(UseKeptKeys(blobs=1, timeout=1.0), timeout=60)
    a.host.order(ForceSwitch(ORCHESTRATOR, ORCHESTRATOR, hide_kernel=False))
    # mallory's attempt faulted the user channel: alice may refuse once, until a rotation resets it
    victim = a.travel(ALICE)
    victims = [victim] if victim.verified else [victim, a.travel(ALICE)]
    a.host.order(ForceSwitch(MALLORY, MALLORY, hide_kernel=False))
    second = a.mallory.order(UseKeptKeys(blobs=1, timeout=1.0), timeout=60)
    a.host.order(ForceSwitch(ORCHESTRATOR, ORCHESTRATOR, hide_kernel=False))
    host = a.host.news()
    ok, after = a.carry_on(BOB)
    stopped = (own.failed_with(PeerTimeout) and rekeyed(said) and first.attempts > 0 and first.bytes_read == 0
               and victims[-1].verified and second.attempts > 0 and second.bytes_read == 0 and ok)
    return Verdict(stopped, "the orchestrator did not go on without the rotation's confirmation (PeerTimeout); with "
                   "the recovery rotation dropped too it could not show the device had left mallory's epoch, so it "
                   "re-keyed the GPU through a new SPDM session (VRAM and every channel wiped) before the host could "
                   "switch the GPU to mallory: mallory's still-unrotated keys belonged to a session the device no "
                   "longer had and faulted; alice's chunk travelled under the new session's keys",
                   (own.describe(), *said, *journal, *news_lines(first, "mallory (rotations dropped)"),
                    *(v.describe() for v in victims), *news_lines(second, "mallory (after alice)"),
                    *news_lines(host, "host"), after))


def confirmation_substitution(a: Arena) -> Verdict:
    a.host.order(ArmDrop(after_return_of=BOB, kernel_rings=2))
    victim = a.travel(BOB)  # before issue 12, its chunk stayed in VRAM: the rotations after it never ran
    a.host.order(ArmExposePrefix(entries=2))
    a.mallory.order(SetTravelMode("dump"))
    out = a.travel(MALLORY)
    news = a.mallory.order(SetTravelMode("honest"))
    host = a.host.news()
    said = a.orchestrator_said()
    ok, after = a.carry_on(ALICE)
    # The pending rotations the attack needs are gone: the orchestrator re-keyed when the second
    # was not confirmed. Whatever then travelled to mallory, the buffer it was granted is zero.
    pre_empted = rekeyed(said) and host_said(host, "nothing left to hold back")
    stopped = (victim.failed_with(PeerTimeout) and pre_empted and out.verified
               and news.bytes_read == a.buffer_bytes and news.nonzero_read == 0 and ok)
    return Verdict(stopped, "fail-closed recovery: when neither the rotation after bob's travel nor its retry was "
                   "confirmed, the orchestrator re-keyed the GPU through a new SPDM session (VRAM, bob's chunk "
                   "included, and every channel wiped), so no pending rotation was left whose release could pass for "
                   "the next scrub's; mallory's granted buffer read back all zero. (Every kernel push also waits for "
                   "a release value never used before: tests/test_redteam.py, in process)",
                   (victim.describe(), *said, *news_lines(host, "host"), out.describe(), *news_lines(news, "mallory"),
                    after))


def decrypt_snooped(a: Arena) -> Verdict:
    theirs = a.cohort.loot_dir / "decrypt-snooped" / "captured-alice.frames"
    ours = a.cohort.loot_dir / "decrypt-snooped" / "captured-mallory.frames"
    theirs, ours = a.cohort.child_path(theirs), a.cohort.child_path(ours)  # named as the colluders see them
    a.host.order(ExportRecords(ALICE, theirs))
    a.host.order(ExportRecords(MALLORY, ours))
    news = a.mallory.order(DecryptCaptured(theirs, 0), timeout=300)
    control = a.mallory.order(DecryptCaptured(ours, 0), timeout=300)
    stopped = news.attempts > 0 and news.decrypted == 0 and control.decrypted > 0
    return Verdict(stopped, "per-travel keys: alice's records were sealed under keys of her own travel's epoch, "
                   "derived from the session secret mallory never had; no key it kept opens them (control: the "
                   "same search opens mallory's own captured records)",
                   (*news_lines(news, "mallory"), *news_lines(control, "mallory, control on its own records")))


def _decrypt(a: Arena, row: str, cvm: str, tag: str, newest: int = 0) -> HolderNews:
    """The host hands mallory every staging record and push it captured from ``cvm``; mallory
    tries every key it kept on each (or those of its ``newest`` blobs: the ones the row is
    about; earlier rows tried the rest), at every plausible IV."""
    path = a.cohort.child_path(a.cohort.loot_dir / row / f"captured-{cvm}-{tag}.frames")  # as the colluders name it
    a.host.order(ExportRecords(cvm, path))
    return a.mallory.order(DecryptCaptured(path, newest), timeout=300)


def _handed(news: HostNews, cvm: str) -> int:
    """How many staging records of ``cvm`` the host handed over (from its report)."""
    for e in news.events:
        if e.startswith("handed over ") and e.endswith(f" of {cvm}"):
            return int(e.split()[2])
    return 0


# ----------------------------------------------------------------------------- key epochs (issue 12)
def host_forges_gpfifo_get(a: Arena) -> Verdict:
    a.host.order(ArmForgeGet(MALLORY, hold_s=FORGE_HOLD_S["home"]))
    own = a.travel(MALLORY)  # mallory keeps the blob of this travel's epoch
    host = a.host.news()
    said, journal = a.orchestrator_said(), a.journal()
    restored = a.restore()
    victim = a.travel(ALICE)  # before the fix: under the very epoch mallory kept
    news = _decrypt(a, "host-forges-gpfifo-get", ALICE, "victim", newest=2)  # the blobs of mallory's travel
    control = _decrypt(a, "host-forges-gpfifo-get", MALLORY, "control")
    handed = a.host.news()
    ok, after = a.carry_on(BOB)
    forged = host_said(host, "forged BAR0's kernel GPFIFO get")
    stopped = (forged and own.failed_with(PeerTimeout) and "GPFIFO space" in str(own.error) and rekeyed(said)
               and victim.verified and _handed(handed, ALICE) > 0 and news.attempts > 0 and news.decrypted == 0
               and control.decrypted > 0 and ok)
    return Verdict(stopped, "the epoch ledger (driver/epochs.py): the rotation after mallory's travel could not be "
                   "submitted (no room in the forged ring: PeerTimeout), so travel halted instead of the epoch "
                   "mallory kept travelling again; the recovery rotation met the same forged ring, so the "
                   "orchestrator re-keyed the GPU through a new SPDM session (VRAM and every channel wiped, the "
                   "forged get with them); alice's chunk then travelled under keys mallory never had, and no key it "
                   "kept opened the host's captures of her bounce buffers (control: the same search opens mallory's "
                   "own captures)",
                   (*news_lines(host, "host"), own.describe(), *said, *journal, *restored, victim.describe(),
                    *news_lines(handed, "host"), *news_lines(news, "mallory"),
                    *news_lines(control, "mallory, control on its own records"), after))


def collusion_after_failed_rotation(a: Arena) -> Verdict:
    """Paper 6.3 with issue 12's finding: the host makes the recovery rotation fail after
    mallory's travel, hoping alice's chunk then travels under the epoch mallory kept."""
    row, evidence, good = "collusion-after-failed-rotation", [], True
    for mode in ("refuse", "vanish"):  # quiet: the exported counters stay in step, so alice's travel would work
        a.host.order(ArmForgeGet(MALLORY, hold_s=FORGE_HOLD_S["home" if mode == "refuse" else "taken"]))
        a.mallory.order(SetTravelMode(mode))
        own = a.travel(MALLORY)
        mine = a.mallory.news()
        host = a.host.news()
        said, journal = a.orchestrator_said(), a.journal()
        restored = a.restore()
        victim = a.travel(ALICE)
        news = _decrypt(a, row, ALICE, mode, newest=2)  # the blobs of mallory's travel (given, and returned)
        handed = a.host.news()
        evidence += [f"[mallory: {mode}]", *news_lines(mine, "mallory"), *news_lines(host, "host"), own.describe(),
                     *said, *journal, *restored, victim.describe(), *news_lines(handed, "host"),
                     *news_lines(news, "mallory")]
        good = (good and own.error is not None and host_said(host, "forged BAR0's kernel GPFIFO get") and rekeyed(said)
                and victim.verified and _handed(handed, ALICE) > 0 and news.attempts > 0 and news.decrypted == 0)
    control = _decrypt(a, row, MALLORY, "control")
    ok, after = a.carry_on(BOB)
    stopped = good and control.decrypted > 0 and ok
    return Verdict(stopped, "the epoch ledger: whether mallory refused or never answered, the recovery rotation could "
                   "not be submitted (the host's forged kernel get), so the orchestrator halted travel and re-keyed "
                   "the GPU through a new SPDM session before alice's travel; alice's chunk travelled under the new "
                   "session's keys, which mallory never had: its kept keys opened none of the host's captures of "
                   "alice's bounce buffers (control: the same search opens mallory's own captures)",
                   (*evidence, *news_lines(control, "mallory, control on its own records"), after))


def baseline_then_travel(a: Arena) -> Verdict:
    base, base_said = a.baseline(ALICE)  # the orchestrator's own copy through its bounce buffers
    own = a.travel(MALLORY)
    entries = a.journal_entries()
    news = _decrypt(a, "baseline-then-travel", ORCHESTRATOR, "baseline", newest=2)  # the blobs of mallory's travel
    control = _decrypt(a, "baseline-then-travel", MALLORY, "control")
    handed = a.host.news()
    ok, after = a.carry_on(ALICE)
    # A travel moves one epoch (the rotation after it); two: the orchestrator rotated away from
    # the epoch of its own copy before it exported one to mallory.
    rotated = [e for e in entries if e.chunk.holder == MALLORY and e.epoch_after == e.epoch_before + 2]
    said = [f"the travel log shows mallory's travel began on key epoch {e.epoch_before}, the epoch of the "
            f"baseline copy, and mallory was given epoch {e.epoch_before + 1}" for e in rotated]
    stopped = (base is not None and own.verified and bool(rotated) and _handed(handed, ORCHESTRATOR) > 0
               and news.attempts > 0 and news.decrypted == 0 and control.decrypted > 0 and ok)
    return Verdict(stopped, "the epoch ledger: the orchestrator's own copy spent the epoch, which the driver then "
                   "refuses to export (EpochSpent), so the orchestrator rotated to a fresh epoch before mallory's "
                   "travel; no key mallory kept opened the host's captures of the orchestrator's bounce buffers "
                   "(control: the same search opens mallory's own captures)",
                   (base_said, own.describe(), *map(log_line, entries), *said, *news_lines(handed, "host"),
                    *news_lines(news, "mallory"), *news_lines(control, "mallory, control on its own records"), after))
