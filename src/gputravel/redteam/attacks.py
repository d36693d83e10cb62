"""The attacks, each driven against the live cohort, each judged by what was observed.

An attack returns a :class:`Verdict`: whether the defence it names was *seen* to act (a
typed error from the orchestrator, a fault flag the host read in BAR0, an attacker's read
that failed, a travel that never happened) and whether the cohort carried on. The bytes of
plaintext the attacker obtained are counted afterwards, by searching its loot
(:mod:`gputravel.redteam.run`). Nothing here checks anything the system itself does not:
the verdict only reports what the real defences did.
"""

from __future__ import annotations

from gputravel.errors import ChannelFaulted, ContextBlobError, PeerTimeout
from gputravel.redteam.messages import (
    ArmDrop,
    ArmExposePrefix,
    ArmForgeGet,
    ArmRoute,
    ArmTamper,
    DecryptCaptured,
    ExportRecords,
    ForceSwitch,
    HolderNews,
    HostNews,
    SetTravelMode,
    UseKeptKeys,
)
from gputravel.redteam.arena import (
    ALICE,
    BOB,
    MALLORY,
    ORCH,
    Arena,
    Attack,
    Verdict,
    _entry,
    _events,
    _rekeyed,
    _said,
)
from gputravel.redteam.isolation_rows import (
    holder_reads_peer_memory,
    host_reads_cvm_memory,
    orchestrator_self_quote,
)

# How long the forged kernel get stays: past the orchestrator's last try at a rotation (each
# waits run.DEVICE_TIMEOUT = 2 s for room), not past the next travel's scrub (which waits 2 s too).
FORGE_HOLD_S = {"home": 5.0, "taken": 3.0}  # the holder came home (rotation, retry); it never did (retry only)


# ----------------------------------------------------------------------------- malicious host
def replay_push(a: Arena) -> Verdict:
    a.host.order(ArmTamper(ALICE, "replay", a.copy_push(0), 0))
    out = a.travel(ALICE)
    news = a.host.news()
    ok, after = a.carry_on(ALICE)
    replayed = _said(news, "back as a new entry")
    stopped = replayed and news.user_faults >= 1 and ok
    return Verdict(stopped, "receiver-tracked IVs: the replayed push failed AES-GCM authentication at the IV the "
                   "device expected next, so the device faulted the user channel and executed nothing; the "
                   "orchestrator's rotation after the travel reset the channel",
                   (*_events(news, "host"), out.describe(), after))


def flip_ciphertext(a: Arena) -> Verdict:
    """The device works while the CVM appends, so a flip can come too late (the device already
    took the record, authentically): then the travel verifies and the host tries again."""
    evidence: list[str] = []
    for _ in range(3):
        a.host.order(ArmTamper(BOB, "flip", a.copy_push(1), 1 % a.slots))
        out = a.travel(BOB)
        news = a.host.news()
        evidence += [*_events(news, "host"), out.describe()]
        if news.user_faults:
            break
    ok, after = a.carry_on(BOB)
    stopped = news.user_faults >= 1 and not out.verified and ok
    return Verdict(stopped, "AES-GCM tag check on the record: the device decrypts into private scratch and writes "
                   "VRAM only after the tag verifies, so the tampered record reached nothing; the user channel "
                   "faulted, bob refused the travel, the orchestrator rotated and went on", (*evidence, after))


def wrong_cvm_during_travel(a: Arena) -> Verdict:
    a.host.order(ArmRoute(ORCH, ALICE, dma=BOB, irq=BOB))
    out = a.travel(ALICE)
    news = a.host.news()
    ok_b, after_b = a.carry_on(BOB)
    ok_a, after_a = a.carry_on(ALICE)
    stopped = _said(news, "mapped bob's memory") and not out.verified and ok_a and ok_b
    return Verdict(stopped, "the device only reaches the CVM the MUX maps, and bob's bounce buffers hold no push "
                   "valid at the IV the device expects: alice's work faulted the user channel and she refused the "
                   "travel; bob has no keys of this epoch and saw only ciphertext",
                   (*_events(news, "host"), out.describe(), after_b, after_a))


def split_dma_irq(a: Arena) -> Verdict:
    a.host.order(ArmRoute(ORCH, ALICE, dma=ALICE, irq=BOB))
    out = a.travel(ALICE)
    news = a.host.news()
    ok, after = a.carry_on(BOB)
    stopped = _said(news, "routed bob's interrupt") and ok
    return Verdict(stopped, "interrupts carry no data: bob got stray interrupts and ignored them; the device reached "
                   "only alice's bounce buffers (ciphertext); alice's driver saw each release by polling its "
                   "authenticated semaphore, so the travel still completed and verified",
                   (*_events(news, "host"), out.describe(), after))


def drop_rotation(a: Arena) -> Verdict:
    a.host.order(ArmDrop(after_return_of=ALICE, kernel_rings=2))
    out = a.travel(ALICE)
    news = a.host.news()
    said, journal = a.orchestrator_said(), a.journal()
    ok, after = a.carry_on(BOB)
    dropped = sum("dropped the orchestrator's doorbell" in e for e in news.events)
    stopped = (dropped == 2 and out.failed_with(PeerTimeout) and "semaphore" in str(out.error)
               and _rekeyed(said) and ok)
    return Verdict(stopped, "the orchestrator waits for the rotation's confirmation (a kernel semaphore under the new "
                   "key) with a timeout: it failed the travel with PeerTimeout instead of going on; its recovery "
                   "rotation went unheard too, so, unable to show the device had left alice's epoch, it re-keyed "
                   "the GPU through a new SPDM session (VRAM and every channel wiped) before any other travel; "
                   "the next travel verified under the new session's keys",
                   (*_events(news, "host"), out.describe(), *said, *journal, after))


def drop_scrub(a: Arena) -> Verdict:
    a.host.order(ArmDrop(after_return_of="", kernel_rings=1))
    out = a.travel(BOB)
    news = a.host.news()
    ok, after = a.carry_on(BOB)
    travelled = _said(news, "orchestrator asked for the GPU to go to bob")
    stopped = out.failed_with(PeerTimeout) and not travelled and ok
    return Verdict(stopped, "the orchestrator never exports keys before the scrub is confirmed: the unanswered push "
                   "ended in PeerTimeout, the GPU never left it, and the recovery rotation ran after the scrub",
                   (*_events(news, "host"), out.describe(), "the GPU never travelled to bob" if not travelled
                    else "the GPU travelled to bob", after))


def wrong_cvm_for_orchestrator(a: Arena) -> Verdict:
    a.host.order(ArmRoute(ALICE, ORCH, dma=BOB, irq=BOB))
    out = a.travel(ALICE)
    news = a.host.news()
    said, journal = a.orchestrator_said(), a.journal()
    ok, after = a.carry_on(BOB)
    stopped = (_said(news, "mapped bob's memory") and out.failed_with(ChannelFaulted) and news.kernel_faults >= 1
               and _rekeyed(said) and ok)
    return Verdict(stopped, "only the orchestrator holds kernel-channel keys: the rotation push the device read from "
                   "bob's memory failed authentication and faulted the kernel channel (ChannelFaulted), so the "
                   "rotation was never confirmed; the orchestrator halted travel and re-keyed the GPU through a new "
                   "SPDM session (VRAM and every channel wiped, the dataset buffer granted again); the next travel "
                   "verified under the new session's keys",
                   (*_events(news, "host"), out.describe(), *said, *journal, after))


# ----------------------------------------------------------------------------- malicious holder
def kept_keys(a: Arena) -> Verdict:
    victim = a.travel(ALICE)
    news = a.mallory.order(UseKeptKeys(blobs=2, timeout=1.0), timeout=60)
    ok, after = a.carry_on(BOB)
    stopped = victim.verified and news.attempts > 0 and news.bytes_read == 0 and ok
    return Verdict(stopped, "the GPU is not mapped to mallory, so the device never reads its pushes (its doorbell "
                   "makes the device read the orchestrator's bounce buffers and fail authentication), and the keys "
                   "it kept are of epochs the device has rotated away from",
                   (victim.describe(), *_events(news, "mallory"), after))


def dump_vram(a: Arena) -> Verdict:
    victim = a.travel(ALICE)
    a.mallory.order(SetTravelMode("dump"))
    out = a.travel(MALLORY)
    news = a.mallory.news()
    host = a.host.news()
    ok, after = a.carry_on(BOB)
    # Only the read inside the window may succeed (and find zeros); both reads outside must fail.
    inside_only = news.bytes_read == a.buffer_bytes and len(news.errors) == 2
    stopped = victim.verified and inside_only and news.nonzero_read == 0 and ok
    return Verdict(stopped, "scrub before each travel: the buffer mallory was granted read back all zero; the granted "
                   "VRAM window: reads outside it were refused by the device (user channel faulted), and nothing else "
                   "of protected memory is reachable with user-channel keys",
                   (victim.describe(), *_events(news, "mallory"), *_events(host, "host"), out.describe(), after))


def work_after_return(a: Arena) -> Verdict:
    a.mallory.order(SetTravelMode("work-after-return"))
    out = a.travel(MALLORY)
    news = a.mallory.news()
    ok, after = a.carry_on(ALICE)
    stopped = out.verified and news.attempts > 0 and news.bytes_read == 0 and bool(news.errors) and ok
    return Verdict(stopped, "once it handed the GPU back, the device maps the orchestrator's bounce buffers, not "
                   "mallory's: its push was read from the wrong memory and failed authentication, and the rotation "
                   "that followed made its keys useless",
                   (*_events(news, "mallory"), out.describe(), after))


def stale_context(a: Arena) -> Verdict:
    return _bad_blob(a, ("stale-epoch", "stale-counters"), "context blob validation: the orchestrator refused a blob "
                     "from another key epoch and one whose counters went backwards (ContextBlobError), took back the "
                     "state it had exported and dropped mallory (its connection closed; it joined again, attesting "
                     "afresh); the rotation under way recovered the GPU and the cohort went on")


def altered_context(a: Arena) -> Verdict:
    return _bad_blob(a, ("altered-keys", "corrupted"), "context blob validation: a blob carrying a key the orchestrator "
                     "did not export, and one failing its checksum, were refused (ContextBlobError); the orchestrator "
                     "kept its own exported state and dropped mallory (it joined again, attesting afresh); the "
                     "rotation under way recovered the GPU and the cohort went on")


def holder_pushes_counters_forward(a: Arena) -> Verdict:
    verdict = _bad_blob(a, ("counters-forward",), "context blob validation: a channel counter changes only when keys "
                        "are installed, never during a travel, so a returned blob with one moved (either way) was "
                        "refused (ContextBlobError) before the orchestrator adopted any of it; mallory was dropped "
                        "(it joined again, attesting afresh), the rotation under way recovered the GPU without a "
                        "re-key, and alice's and bob's travels verified", also=BOB)
    moved = "a channel counter changed" in "\n".join(verdict.evidence)
    return Verdict(verdict.stopped and moved, verdict.stopped_by, verdict.evidence)


def _bad_blob(a: Arena, modes: tuple[str, ...], why: str, also: str = "") -> Verdict:
    """Each bad blob is refused and mallory is dropped; it joins again for the next one. The GPU
    is recovered by the rotation that started when it came home, not by a re-key."""
    evidence, refused, dropped, rotated = [], 0, 0, 0
    for mode in modes:
        a.mallory.order(SetTravelMode(mode))
        out = a.travel(MALLORY)
        news = a.mallory.news()
        entries = a.journal_entries()
        evidence += [*_events(news, "mallory"), out.describe(), *map(_entry, entries)]
        refused += out.failed_with(ContextBlobError)
        if out.error is not None and any(e.event.value == "aborted" and e.chunk.holder == MALLORY
                                         and e.epoch_after == e.epoch_before + 1 for e in entries):
            rotated += 1
            evidence.append("the GPU was recovered by the rotation under way (a confirmed rotation, no re-key)")
        if MALLORY in a.dropped:
            dropped += 1
            evidence.append(a.rejoin(MALLORY))
    said = a.orchestrator_said()
    ok, after = a.carry_on(ALICE)
    ok_b, after_b = a.carry_on(also) if also else (True, "")
    stopped = (refused == dropped == rotated == len(modes) and not _rekeyed(said) and ok and ok_b)
    return Verdict(stopped, why, (*evidence, *said, after, *([after_b] if also else [])))


def never_returns(a: Arena) -> Verdict:
    a.mallory.order(SetTravelMode("never-return"))
    out = a.travel(MALLORY)
    news = a.mallory.news()
    ok, after = a.carry_on(ALICE)
    stopped = out.error is not None and "HolderLost" in str(out.error) and news.nonzero_read == 0 and ok
    return Verdict(stopped, "orchestrator timeout: it stopped waiting, took the GPU back, took back the state it "
                   "had exported, rotated (mallory's keys died with the epoch) and marked mallory offline; while it "
                   "held the GPU mallory could read only the scrubbed buffer",
                   (*_events(news, "mallory"), out.describe(), after))


# ----------------------------------------------------------------------------- collusion (paper 6.3)
def switch_after_rotation(a: Arena) -> Verdict:
    victim = a.travel(ALICE)
    a.host.order(ForceSwitch(MALLORY, MALLORY, hide_kernel=False))
    news = a.mallory.order(UseKeptKeys(blobs=2, timeout=1.0), timeout=60)
    a.host.order(ForceSwitch(ORCH, ORCH, hide_kernel=False))
    host = a.host.news()
    ok, after = a.carry_on(BOB)
    stopped = victim.verified and news.attempts > 0 and news.bytes_read == 0 and ok
    return Verdict(stopped, "key rotation with a secret the holder never had: the device is on the epoch after "
                   "alice's travel, derived from the SPDM session secret; mallory's kept keys failed authentication "
                   "(user channel faulted, RPCs dropped)",
                   (victim.describe(), *_events(host, "host"), *_events(news, "mallory"), after))


def drop_rotation_then_read(a: Arena) -> Verdict:
    a.host.order(ArmDrop(after_return_of=MALLORY, kernel_rings=2))
    own = a.travel(MALLORY)
    said, journal = a.orchestrator_said(), a.journal()
    a.host.order(ForceSwitch(MALLORY, MALLORY, hide_kernel=True))
    first = a.mallory.order(UseKeptKeys(blobs=1, timeout=1.0), timeout=60)
    a.host.order(ForceSwitch(ORCH, ORCH, hide_kernel=False))
    # mallory's attempt faulted the user channel: alice may refuse once, until a rotation resets it
    victim = a.travel(ALICE)
    victims = [victim] if victim.verified else [victim, a.travel(ALICE)]
    a.host.order(ForceSwitch(MALLORY, MALLORY, hide_kernel=False))
    second = a.mallory.order(UseKeptKeys(blobs=1, timeout=1.0), timeout=60)
    a.host.order(ForceSwitch(ORCH, ORCH, hide_kernel=False))
    host = a.host.news()
    ok, after = a.carry_on(BOB)
    stopped = (own.failed_with(PeerTimeout) and _rekeyed(said) and first.attempts > 0 and first.bytes_read == 0
               and victims[-1].verified and second.attempts > 0 and second.bytes_read == 0 and ok)
    return Verdict(stopped, "the orchestrator did not go on without the rotation's confirmation (PeerTimeout); with "
                   "the recovery rotation dropped too it could not show the device had left mallory's epoch, so it "
                   "re-keyed the GPU through a new SPDM session (VRAM and every channel wiped) before the host could "
                   "switch the GPU to mallory: mallory's still-unrotated keys belonged to a session the device no "
                   "longer had and faulted; alice's chunk travelled under the new session's keys",
                   (own.describe(), *said, *journal, *_events(first, "mallory (rotations dropped)"),
                    *(v.describe() for v in victims), *_events(second, "mallory (after alice)"),
                    *_events(host, "host"), after))


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
    pre_empted = _rekeyed(said) and _said(host, "nothing left to hold back")
    stopped = (victim.failed_with(PeerTimeout) and pre_empted and out.verified
               and news.bytes_read == a.buffer_bytes and news.nonzero_read == 0 and ok)
    return Verdict(stopped, "fail-closed recovery: when neither the rotation after bob's travel nor its retry was "
                   "confirmed, the orchestrator re-keyed the GPU through a new SPDM session (VRAM, bob's chunk "
                   "included, and every channel wiped), so no pending rotation was left whose release could pass for "
                   "the next scrub's; mallory's granted buffer read back all zero. (Every kernel push also waits for "
                   "a release value never used before: tests/test_redteam.py, in process)",
                   (victim.describe(), *said, *_events(host, "host"), out.describe(), *_events(news, "mallory"),
                    after))


def decrypt_snooped(a: Arena) -> Verdict:
    theirs = a.cohort.loot_dir / "decrypt-snooped" / "captured-alice.frames"
    ours = a.cohort.loot_dir / "decrypt-snooped" / "captured-mallory.frames"
    theirs, ours = a.cohort.child_path(theirs), a.cohort.child_path(ours)  # named as the colluders see them
    a.host.order(ExportRecords(ALICE, theirs))
    a.host.order(ExportRecords(MALLORY, ours))
    news = a.mallory.order(DecryptCaptured(theirs), timeout=300)
    control = a.mallory.order(DecryptCaptured(ours), timeout=300)
    stopped = news.attempts > 0 and news.decrypted == 0 and control.decrypted > 0
    return Verdict(stopped, "per-travel keys: alice's records were sealed under keys of her own travel's epoch, "
                   "derived from the session secret mallory never had; no key it kept opens them (control: the "
                   "same search opens mallory's own captured records)",
                   (*_events(news, "mallory"), *_events(control, "mallory, control on its own records")))


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
    forged = _said(host, "forged BAR0's kernel GPFIFO get")
    stopped = (forged and own.failed_with(PeerTimeout) and "GPFIFO space" in str(own.error) and _rekeyed(said)
               and victim.verified and _handed(handed, ALICE) > 0 and news.attempts > 0 and news.decrypted == 0
               and control.decrypted > 0 and ok)
    return Verdict(stopped, "the epoch ledger (driver/epochs.py): the rotation after mallory's travel could not be "
                   "submitted (no room in the forged ring: PeerTimeout), so travel halted instead of the epoch "
                   "mallory kept travelling again; the recovery rotation met the same forged ring, so the "
                   "orchestrator re-keyed the GPU through a new SPDM session (VRAM and every channel wiped, the "
                   "forged get with them); alice's chunk then travelled under keys mallory never had, and no key it "
                   "kept opened the host's captures of her bounce buffers (control: the same search opens mallory's "
                   "own captures)",
                   (*_events(host, "host"), own.describe(), *said, *journal, *restored, victim.describe(),
                    *_events(handed, "host"), *_events(news, "mallory"),
                    *_events(control, "mallory, control on its own records"), after))


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
        evidence += [f"[mallory: {mode}]", *_events(mine, "mallory"), *_events(host, "host"), own.describe(),
                     *said, *journal, *restored, victim.describe(), *_events(handed, "host"),
                     *_events(news, "mallory")]
        good = (good and own.error is not None and _said(host, "forged BAR0's kernel GPFIFO get") and _rekeyed(said)
                and victim.verified and _handed(handed, ALICE) > 0 and news.attempts > 0 and news.decrypted == 0)
    control = _decrypt(a, row, MALLORY, "control")
    ok, after = a.carry_on(BOB)
    stopped = good and control.decrypted > 0 and ok
    return Verdict(stopped, "the epoch ledger: whether mallory refused or never answered, the recovery rotation could "
                   "not be submitted (the host's forged kernel get), so the orchestrator halted travel and re-keyed "
                   "the GPU through a new SPDM session before alice's travel; alice's chunk travelled under the new "
                   "session's keys, which mallory never had: its kept keys opened none of the host's captures of "
                   "alice's bounce buffers (control: the same search opens mallory's own captures)",
                   (*evidence, *_events(control, "mallory, control on its own records"), after))


def baseline_then_travel(a: Arena) -> Verdict:
    base, base_said = a.baseline(ALICE)  # the orchestrator's own copy through its bounce buffers
    own = a.travel(MALLORY)
    entries = a.journal_entries()
    news = _decrypt(a, "baseline-then-travel", ORCH, "baseline", newest=2)  # the blobs of mallory's travel
    control = _decrypt(a, "baseline-then-travel", MALLORY, "control")
    handed = a.host.news()
    ok, after = a.carry_on(ALICE)
    # A travel moves one epoch (the rotation after it); two: the orchestrator rotated away from
    # the epoch of its own copy before it exported one to mallory.
    rotated = [e for e in entries if e.chunk.holder == MALLORY and e.epoch_after == e.epoch_before + 2]
    said = [f"the travel log shows mallory's travel began on key epoch {e.epoch_before}, the epoch of the "
            f"baseline copy, and mallory was given epoch {e.epoch_before + 1}" for e in rotated]
    stopped = (base is not None and own.verified and bool(rotated) and _handed(handed, ORCH) > 0
               and news.attempts > 0 and news.decrypted == 0 and control.decrypted > 0 and ok)
    return Verdict(stopped, "the epoch ledger: the orchestrator's own copy spent the epoch, which the driver then "
                   "refuses to export (EpochSpent), so the orchestrator rotated to a fresh epoch before mallory's "
                   "travel; no key mallory kept opened the host's captures of the orchestrator's bounce buffers "
                   "(control: the same search opens mallory's own captures)",
                   (base_said, own.describe(), *map(_entry, entries), *said, *_events(handed, "host"),
                    *_events(news, "mallory"), *_events(control, "mallory, control on its own records"), after))


def snoop_everything(a: Arena) -> Verdict:
    return Verdict(True, "AES-256-GCM on every byte in the bounce buffers (records, pushes, RPCs, semaphores); "
                   "TLS 1.3 on every holder link (context blobs travel only inside it)", ())


ATTACKS: tuple[Attack, ...] = (
    Attack("replay-push", "host", "captured alice's push for record 0 from her bounce buffer during her copy; when she "
           "asked for the GPU back, wrote it in again as a new GPFIFO entry and rang the doorbell (same epoch, same "
           "channel)", replay_push),
    Attack("flip-ciphertext", "host", "mid-copy, flipped one ciphertext bit of bob's record 1 in its staging slot "
           "before the device read it", flip_ciphertext),
    Attack("wrong-cvm-during-travel", "host", "when the orchestrator sent the GPU to alice, mapped bob's bounce "
           "buffers and interrupt instead (and told the orchestrator it was alice)", wrong_cvm_during_travel),
    Attack("split-dma-irq", "host", "during alice's travel, mapped alice's bounce buffers but routed the device's "
           "interrupts to bob", split_dma_irq),
    Attack("drop-rotation", "host", "after alice handed the GPU back, dropped every doorbell until the orchestrator's "
           "rotation push and its retry had both gone unheard", drop_rotation),
    Attack("drop-scrub", "host", "dropped the doorbell of the orchestrator's scrub (an unanswered push) before a travel "
           "to bob", drop_scrub),
    Attack("kept-keys", "holder", "mallory kept every context blob; after alice's chunk arrived it lined its kept "
           "contexts up with the device's queues (from BAR0) and tried to read the buffer and send encrypted RPCs",
           kept_keys),
    Attack("dump-vram", "holder", "while holding the GPU right after alice's travel, mallory read its whole granted "
           "buffer, then VRAM just past the window and 16 MiB beyond it", dump_vram),
    Attack("work-after-return", "holder", "right after handing the GPU back, mallory submitted a read of the buffer "
           "with the keys it had just returned (before or while the orchestrator rotated)", work_after_return),
    Attack("stale-context", "holder", "mallory returned the context blob of an earlier travel, then one with its "
           "counters rewound (checksum recomputed)", stale_context),
    Attack("altered-context", "holder", "mallory returned a context blob with a channel key replaced (checksum "
           "recomputed), then one with a byte flipped", altered_context),
    Attack("holder-pushes-counters-forward", "holder", "mallory returned a context blob whose first sender's channel "
           "counter it moved forward by one (checksum recomputed), to push the orchestrator's IVs out of step with "
           "the device", holder_pushes_counters_forward),
    Attack("drop-rotation-then-read", "host+holder", "paper 6.3: the host dropped the rotation after mallory's travel, "
           "hid the pending kernel work and switched the GPU to mallory, which used its still-valid keys; after "
           "alice's travel the host switched to mallory again", drop_rotation_then_read),
    Attack("confirmation-substitution", "host+holder", "the host dropped the rotations after bob's travel, then let "
           "the device run only those pending rotations when the orchestrator rang for the next scrub, hoping a "
           "rotation's release would pass for the scrub's and bob's chunk would travel to mallory unscrubbed",
           confirmation_substitution),
    Attack("switch-after-rotation", "host+holder", "after alice's travel (and the rotation), the host switched the GPU "
           "to mallory unasked; mallory used its kept keys to read the buffer and send RPCs", switch_after_rotation),
    Attack("decrypt-snooped", "host+holder", "the host handed mallory every staging record and push it captured from "
           "alice; mallory tried every key it kept at 32 IVs each", decrypt_snooped),
    Attack("host-forges-gpfifo-get", "host+holder", "when mallory handed the GPU back, the host forged BAR0's kernel "
           "GPFIFO get (put + 1) so the kernel ring looked full just as the orchestrator submitted the rotation; "
           "then alice travelled, and mallory tried the keys of its travel on the host's captures of her bounce "
           "buffers (before the fix the rotation was never submitted, recovery swallowed it, and alice's travel "
           "exported mallory's epoch again)", host_forges_gpfifo_get),
    Attack("collusion-after-failed-rotation", "host+holder", "mallory took a travel and refused it (then, a second "
           "time, never answered); each time the host forged the kernel get so the rotation after it and the "
           "recovery rotation could not be submitted; then alice travelled and mallory tried the keys of that "
           "travel on the host's captures of alice's bounce buffers (the issue's probe read 262,144 of 262,144 bytes this "
           "way before the fix)", collusion_after_failed_rotation),
    Attack("baseline-then-travel", "host+holder", "alice's chunk went by the TLS baseline (the orchestrator's own "
           "copy through its bounce buffers, which the host captured), then mallory travelled and tried the keys of "
           "its travel on the host's captures of the orchestrator's bounce buffers",
           baseline_then_travel),
    Attack("holder-reads-peer-memory", "holder", "from its own process, mallory tried to read the memory "
           "(/proc/PID/mem at the mappings that hold datasets, bounce buffers and VRAM), maps, environment and "
           "descriptors (the VRAM memfd included) of alice, bob, the orchestrator, the device, the host and the TDX "
           "module, and their key files and datasets (told where to look by the launcher)", holder_reads_peer_memory,
           needs_isolation=True),
    Attack("host-reads-cvm-memory", "host", "from the host process, the host tried the same on alice, bob, mallory, "
           "the orchestrator, the device and the TDX module", host_reads_cvm_memory, needs_isolation=True),
    Attack("orchestrator-self-quote", "host+holder", "the host and mallory each asked the TDX module for a quote over "
           "report data of their own (binding a TLS key of theirs, to pass for the orchestrator), and mallory tried "
           "to read the module's memory and descriptors, where its quoting key lives", orchestrator_self_quote),
    Attack("never-returns", "holder", "mallory took a travel, read the buffer, and then never switched the GPU back "
           "nor replied", never_returns),
    Attack("wrong-cvm-for-orchestrator", "host", "when alice handed the GPU back, mapped bob's bounce buffers instead "
           "of the orchestrator's, so the orchestrator's rotation went to the wrong CVM", wrong_cvm_for_orchestrator),
    Attack("snoop-everything", "host", "read every CVM's bounce buffers (the snooper at boot, and a snapshot at every "
           "doorbell and every switch), every push it captured, and every TLS byte between holders and the "
           "orchestrator, throughout the run", snoop_everything),
)
