"""The red team's rows (paper 6.1 to 6.3 and issue 12's key-epoch rows) and :data:`ATTACKS`, in the order
they run: a row may use what an earlier one left, as mallory's kept keys. A row returns whether the defence it
names was seen to act and the cohort carried on; it checks nothing the system itself does not."""

from __future__ import annotations

from gputravel.protocol.parties import ORCHESTRATOR
from gputravel.redteam.allreduce import host_carries_allreduce
from gputravel.redteam.arena import ALICE, BOB, MALLORY, Arena, Attack, row
from gputravel.redteam.bus import (ArmDrop, ArmExposePrefix, ArmForgeGet, ArmRoute, ArmTamper, DecryptCaptured, Did,
                                   ExportRecords, ForceSwitch, HolderNews, HostNews, Query, SetTravelMode,
                                   UseKeptKeys, happened)
from gputravel.redteam.evidence import EpochSkipped, Recovered, Travel, Travelled
from gputravel.redteam.probes import holder_reads_peer_memory, host_reads_cvm_memory, orchestrator_self_quote

# How long the forged kernel get stays: past the orchestrator's last try at a rotation (each
# waits run.DEVICE_TIMEOUT = 2 s for room), not past the next travel's scrub (which waits 2 s too).
FORGE_HOLD_S = {"home": 5.0, "taken": 3.0}  # the holder came home (rotation, retry); it never did (retry only)
REKEY = ("re-keyed the GPU through a new SPDM session (VRAM and every channel wiped")
CONTROL = "(control: the same search opens mallory's own captures)"


def _armed(a: Arena, order: object, holder: str) -> tuple[Travel, HostNews]:
    """The host given ``order``, then a travel to ``holder``: how it ended, what the host reported."""
    a.host.order(order)
    out = a.travel(holder)
    return out, a.host.news()


def _mallory_travels(a: Arena, mode: str) -> tuple[Travel, HolderNews]:
    a.mallory.order(SetTravelMode(mode))
    out = a.travel(MALLORY)
    return out, a.mallory.order(Query())


def _got_nothing(news: HolderNews) -> bool:
    """Mallory tried (read, sent RPCs or decrypted) and got no byte back and opened no ciphertext."""
    return news.attempts > 0 and news.bytes_read == 0 and news.decrypted == 0


# ----------------------------------------------------------------------------- the host
@row("replay-push", "host", tried="captured alice's push for record 0 from her bounce buffer during her copy; when "
     "she asked for the GPU back, wrote it in again as a new GPFIFO entry and rang the doorbell (same epoch, same "
     "channel)", stopped_by="receiver-tracked IVs: the replayed push failed AES-GCM authentication at the IV the "
     "device expected next, so the device faulted the user channel and executed nothing; the orchestrator's "
     "rotation after the travel reset the channel")
def replay_push(a: Arena) -> bool:
    _, news = _armed(a, ArmTamper(ALICE, "replay", a.copy_push(0), 0), ALICE)
    ok = a.carry_on(ALICE)
    return bool(happened(news.events, Did.REPLAYED, party=ALICE)) and news.user_faults >= 1 and ok


@row("flip-ciphertext", "host", tried="mid-copy, flipped one ciphertext bit of bob's record 1 in its staging slot "
     "before the device read it", stopped_by="AES-GCM tag check on the record: the device decrypts into private "
     "scratch and writes VRAM only after the tag verifies, so the tampered record reached nothing; the user channel "
     "faulted, bob refused the travel, the orchestrator rotated and went on")
def flip_ciphertext(a: Arena) -> bool:
    # The device works while the CVM appends, so a flip can come too late (the device already
    # took the record, authentically): then the travel verifies and the host tries again.
    for _ in range(3):
        out, news = _armed(a, ArmTamper(BOB, "flip", a.copy_push(1), 1 % a.cohort.config.layout.staging_slots), BOB)
        if news.user_faults:
            break
    ok = a.carry_on(BOB)
    return news.user_faults >= 1 and not out.verified and ok


@row("wrong-cvm-during-travel", "host", tried="when the orchestrator sent the GPU to alice, mapped bob's bounce "
     "buffers and interrupt instead (and told the orchestrator it was alice)", stopped_by="the device only reaches "
     "the CVM the MUX maps, and bob's bounce buffers hold no push valid at the IV the device expects: alice's work "
     "faulted the user channel and she refused the travel; bob has no keys of this epoch and saw only ciphertext")
def wrong_cvm_during_travel(a: Arena) -> bool:
    out, news = _armed(a, ArmRoute(ORCHESTRATOR, ALICE, dma=BOB, irq=BOB), ALICE)
    ok = [a.carry_on(BOB), a.carry_on(ALICE)]  # both, in this order
    return bool(happened(news.events, Did.ROUTED, party=BOB)) and not out.verified and all(ok)


@row("split-dma-irq", "host", tried="during alice's travel, mapped alice's bounce buffers but routed the device's "
     "interrupts to bob", stopped_by="interrupts carry no data: bob got stray interrupts and ignored them; the device "
     "reached only alice's bounce buffers (ciphertext); alice's driver saw each release by polling its authenticated "
     "semaphore, so the travel still completed and verified")
def split_dma_irq(a: Arena) -> bool:
    _, news = _armed(a, ArmRoute(ORCHESTRATOR, ALICE, dma=ALICE, irq=BOB), ALICE)
    ok = a.carry_on(BOB)
    return bool(happened(news.events, Did.ROUTED, place=BOB)) and ok


@row("drop-rotation", "host", tried="after alice handed the GPU back, dropped every doorbell until the "
     "orchestrator's rotation push and its retry had both gone unheard", stopped_by="the orchestrator waits for the "
     "rotation's confirmation (a kernel semaphore under the new key) with a timeout: it failed the travel with "
     "PeerTimeout instead of going on; its recovery rotation went unheard too, so, unable to show the device had "
     f"left alice's epoch, it {REKEY}) before any other travel; the next travel verified under the new session's keys")
def drop_rotation(a: Arena) -> bool:
    out, news = _armed(a, ArmDrop(after_return_of=ALICE, kernel_rings=2), ALICE)
    rekeyed = a.rekeyed()
    ok = a.carry_on(BOB)
    dropped = len(happened(news.events, Did.DROPPED_KERNEL_RING))
    return dropped == 2 and "PeerTimeout" in out.kinds and "semaphore" in out.message and rekeyed and ok


@row("drop-scrub", "host", tried="dropped the doorbell of the orchestrator's scrub (an unanswered push) before a "
     "travel to bob", stopped_by="the orchestrator never exports keys before the scrub is confirmed: the unanswered "
     "push ended in PeerTimeout, the GPU never left it, and the recovery rotation ran after the scrub")
def drop_scrub(a: Arena) -> bool:
    out, news = _armed(a, ArmDrop(after_return_of="", kernel_rings=1), BOB)
    went = bool(happened(news.events, Did.SWITCH_ASKED, party=BOB, place=ORCHESTRATOR))
    a.keep(Travelled(holder=BOB, went=went))
    ok = a.carry_on(BOB)
    return "PeerTimeout" in out.kinds and not went and ok


@row("wrong-cvm-for-orchestrator", "host", tried="when alice handed the GPU back, mapped bob's bounce buffers "
     "instead of the orchestrator's, so the orchestrator's rotation went to the wrong CVM", stopped_by="only the "
     "orchestrator holds kernel-channel keys: the rotation push the device read from bob's memory failed "
     "authentication and faulted the kernel channel (ChannelFaulted), so the rotation was never confirmed; the "
     f"orchestrator halted travel and {REKEY}, the dataset buffer granted again); the next travel verified under "
     "the new session's keys")
def wrong_cvm_for_orchestrator(a: Arena) -> bool:
    out, news = _armed(a, ArmRoute(ALICE, ORCHESTRATOR, dma=BOB, irq=BOB), ALICE)
    rekeyed = a.rekeyed()
    ok = a.carry_on(BOB)
    routed = bool(happened(news.events, Did.ROUTED, party=BOB))
    return routed and "ChannelFaulted" in out.kinds and news.kernel_faults >= 1 and rekeyed and ok


@row("snoop-everything", "host", tried="read every CVM's bounce buffers (the snooper at boot, and a snapshot at every "
     "doorbell and every switch), every push it captured, and every TLS byte between holders and the orchestrator, "
     "throughout the run", stopped_by="AES-256-GCM on every byte in the bounce buffers (records, pushes, RPCs, "
     "semaphores); TLS 1.3 on every holder link (context blobs travel only inside it)")
def snoop_everything(a: Arena) -> bool:
    return True  # judged on the whole run's view once the cohort is down (run._watched)


# ----------------------------------------------------------------------------- mallory
@row("kept-keys", "holder", tried="mallory kept every context blob; after alice's chunk arrived it lined its kept "
     "contexts up with the device's queues (from BAR0) and tried to read the buffer and send encrypted RPCs",
     stopped_by="the GPU is not mapped to mallory, so the device never reads its pushes (its doorbell makes the "
     "device read the orchestrator's bounce buffers and fail authentication), and the keys it kept are of epochs "
     "the device has rotated away from")
def kept_keys(a: Arena) -> bool:
    victim = a.travel(ALICE)
    news = a.mallory.order(UseKeptKeys(blobs=2, timeout=1.0), timeout=60)
    ok = a.carry_on(BOB)
    return victim.verified and _got_nothing(news) and ok


@row("dump-vram", "holder", tried="while holding the GPU right after alice's travel, mallory read its whole granted "
     "buffer, then VRAM just past the window and 16 MiB beyond it", stopped_by="scrub before each travel: the buffer "
     "mallory was granted read back all zero; the granted VRAM window: reads outside it were refused by the device "
     "(user channel faulted), and nothing else of protected memory is reachable with user-channel keys")
def dump_vram(a: Arena) -> bool:
    victim = a.travel(ALICE)
    _, news = _mallory_travels(a, "dump")
    a.host.news()
    ok = a.carry_on(BOB)
    # Only the read inside the window may succeed (and find zeros); both reads outside must fail.
    inside_only = news.bytes_read == a.buffer_bytes and len(news.errors) == 2
    return victim.verified and inside_only and news.nonzero_read == 0 and ok


@row("work-after-return", "holder", tried="right after handing the GPU back, mallory submitted a read of the buffer "
     "with the keys it had just returned (before or while the orchestrator rotated)", stopped_by="once it handed the "
     "GPU back, the device maps the orchestrator's bounce buffers, not mallory's: its push was read from the wrong "
     "memory and failed authentication, and the rotation that followed made its keys useless")
def work_after_return(a: Arena) -> bool:
    out, news = _mallory_travels(a, "work-after-return")
    ok = a.carry_on(ALICE)
    return out.verified and _got_nothing(news) and bool(news.errors) and ok


def _bad_blobs(a: Arena, modes: tuple[str, ...], also: str = "") -> bool:
    """Each bad blob is refused and mallory is dropped; it joins again for the next one. The GPU
    is recovered by the rotation that started when it came home, not by a re-key."""
    refused = dropped = rotated = 0
    for mode in modes:
        out, _ = _mallory_travels(a, mode)
        entries = a.journal()
        refused += "ContextBlobError" in out.kinds
        if out.error and any(e.event == "aborted" and e.holder == MALLORY and e.epoch_after == e.epoch_before + 1
                             for e in entries):
            rotated += 1
            a.keep(Recovered(holder=MALLORY))
        if MALLORY in a.dropped:
            dropped += 1
            a.rejoin(MALLORY)
    rekeyed = a.rekeyed()
    ok = a.carry_on(ALICE)
    ok_also = a.carry_on(also) if also else True
    return refused == dropped == rotated == len(modes) and not rekeyed and ok and ok_also


BLOB_REFUSED = "it joined again, attesting afresh); the rotation under way recovered the GPU and the cohort went on"


@row("stale-context", "holder", tried="mallory returned the context blob of an earlier travel, then one with its "
     "counters rewound (checksum recomputed)", stopped_by="context blob validation: the orchestrator refused a blob "
     "from another key epoch and one whose counters went backwards (ContextBlobError), took back the state it had "
     f"exported and dropped mallory (its connection closed; {BLOB_REFUSED}")
def stale_context(a: Arena) -> bool:
    return _bad_blobs(a, ("stale-epoch", "stale-counters"))


@row("altered-context", "holder", tried="mallory returned a context blob with a channel key replaced (checksum "
     "recomputed), then one with a byte flipped", stopped_by="context blob validation: a blob carrying a key the "
     "orchestrator did not export, and one failing its checksum, were refused (ContextBlobError); the orchestrator "
     f"kept its own exported state and dropped mallory ({BLOB_REFUSED}")
def altered_context(a: Arena) -> bool:
    return _bad_blobs(a, ("altered-keys", "corrupted"))


@row("holder-pushes-counters-forward", "holder", tried="mallory returned a context blob whose first sender's channel "
     "counter it moved forward by one (checksum recomputed), to push the orchestrator's IVs out of step with the "
     "device", stopped_by="context blob validation: a channel counter changes only when keys are installed, never "
     "during a travel, so a returned blob with one moved (either way) was refused (ContextBlobError) before the "
     "orchestrator adopted any of it; mallory was dropped (it joined again, attesting afresh), the rotation under "
     "way recovered the GPU without a re-key, and alice's and bob's travels verified")
def holder_pushes_counters_forward(a: Arena) -> bool:
    stopped = _bad_blobs(a, ("counters-forward",), also=BOB)
    # The orchestrator's refusal names the check that fired: this row is about the counter one.
    moved = any(isinstance(r, Travel) and "a channel counter changed" in r.message for r in a.evidence)
    return stopped and moved


@row("never-returns", "holder", tried="mallory took a travel, read the buffer, and then never switched the GPU back "
     "nor replied", stopped_by="orchestrator timeout: it stopped waiting, took the GPU back, took back the state it "
     "had exported, rotated (mallory's keys died with the epoch) and marked mallory offline; while it held the GPU "
     "mallory could read only the scrubbed buffer")
def never_returns(a: Arena) -> bool:
    out, news = _mallory_travels(a, "never-return")
    ok = a.carry_on(ALICE)
    # HolderLost comes back over the control link under a base class, named in the message (cohort.client.error_from)
    return bool(out.error) and "HolderLost" in out.message and news.nonzero_read == 0 and ok


# ----------------------------------------------------------------------------- the host and mallory together
def _kept_keys_on_the_gpu(a: Arena, blobs: int, *, hide_kernel: bool = False) -> HolderNews:
    """The host switches the GPU to mallory unasked, mallory uses kept keys, the GPU goes home."""
    a.host.order(ForceSwitch(MALLORY, MALLORY, hide_kernel=hide_kernel))
    news = a.mallory.order(UseKeptKeys(blobs=blobs, timeout=1.0), timeout=60)
    a.host.order(ForceSwitch(ORCHESTRATOR, ORCHESTRATOR, hide_kernel=False))
    return news


@row("switch-after-rotation", "host+holder", tried="after alice's travel (and the rotation), the host switched the "
     "GPU to mallory unasked; mallory used its kept keys to read the buffer and send RPCs", stopped_by="key rotation "
     "with a secret the holder never had: the device is on the epoch after alice's travel, derived from the SPDM "
     "session secret; mallory's kept keys failed authentication (user channel faulted, RPCs dropped)")
def switch_after_rotation(a: Arena) -> bool:
    victim = a.travel(ALICE)
    news = _kept_keys_on_the_gpu(a, 2)
    a.host.news()
    ok = a.carry_on(BOB)
    return victim.verified and _got_nothing(news) and ok


@row("drop-rotation-then-read", "host+holder", tried="paper 6.3: the host dropped the rotation after mallory's "
     "travel, hid the pending kernel work and switched the GPU to mallory, which used its still-valid keys; after "
     "alice's travel the host switched to mallory again", stopped_by="the orchestrator did not go on without the "
     "rotation's confirmation (PeerTimeout); with the recovery rotation dropped too it could not show the device had "
     f"left mallory's epoch, so it {REKEY}) before the host could switch the GPU to mallory: mallory's "
     "still-unrotated keys belonged to a session the device no longer had and faulted; alice's chunk travelled "
     "under the new session's keys")
def drop_rotation_then_read(a: Arena) -> bool:
    a.host.order(ArmDrop(after_return_of=MALLORY, kernel_rings=2))
    own = a.travel(MALLORY)
    rekeyed = a.rekeyed()
    a.stage = "rotations dropped"
    first = _kept_keys_on_the_gpu(a, 1, hide_kernel=True)
    a.stage = ""
    # mallory's attempt faulted the user channel: alice may refuse once, until a rotation resets it
    verified = a.travel(ALICE).verified or a.travel(ALICE).verified
    a.stage = "after alice"
    second = _kept_keys_on_the_gpu(a, 1)
    a.stage = ""
    a.host.news()
    ok = a.carry_on(BOB)
    return ("PeerTimeout" in own.kinds and rekeyed and _got_nothing(first) and verified
            and _got_nothing(second) and ok)


@row("confirmation-substitution", "host+holder", tried="the host dropped the rotations after bob's travel, then let "
     "the device run only those pending rotations when the orchestrator rang for the next scrub, hoping a rotation's "
     "release would pass for the scrub's and bob's chunk would travel to mallory unscrubbed", stopped_by="fail-closed "
     "recovery: when neither the rotation after bob's travel nor its retry was confirmed, the orchestrator re-keyed "
     "the GPU through a new SPDM session (VRAM, bob's chunk included, and every channel wiped), so no pending "
     "rotation was left whose release could pass for the next scrub's; mallory's granted buffer read back all zero. "
     "(Every kernel push also waits for a release value never used before: tests/test_redteam.py, in process)")
def confirmation_substitution(a: Arena) -> bool:
    a.host.order(ArmDrop(after_return_of=BOB, kernel_rings=2))
    victim = a.travel(BOB)  # before issue 12, its chunk stayed in VRAM: the rotations after it never ran
    a.host.order(ArmExposePrefix(entries=2))
    a.mallory.order(SetTravelMode("dump"))
    out = a.travel(MALLORY)
    news = a.mallory.order(SetTravelMode("honest"))
    host = a.host.news()
    rekeyed = a.rekeyed()
    ok = a.carry_on(ALICE)
    # The pending rotations the attack needs are gone: the orchestrator re-keyed when the second
    # was not confirmed. Whatever then travelled to mallory, the buffer it was granted is zero.
    pre_empted = rekeyed and bool(happened(host.events, Did.NOTHING_TO_HOLD))
    return ("PeerTimeout" in victim.kinds and pre_empted and out.verified
            and news.bytes_read == a.buffer_bytes and news.nonzero_read == 0 and ok)


def _decrypt(a: Arena, cvm: str, tag: str, newest: int = 0) -> HolderNews:
    """The host hands mallory what it captured from ``cvm``; mallory tries every key it kept (or its
    ``newest`` blobs': the row's; earlier rows tried the rest) at every plausible IV."""
    path = a.cohort.child_path(a.cohort.loot_dir / a.row / f"captured-{cvm}-{tag}.frames")  # as the colluders name it
    a.host.order(ExportRecords(cvm, path))
    return a.mallory.order(DecryptCaptured(path, newest), timeout=300)


def _control(a: Arena) -> HolderNews:
    """The same search on mallory's own captures, which its keys must open."""
    a.stage = "control"
    news = _decrypt(a, MALLORY, "control")
    a.stage = ""
    return news


def _handed(news: HostNews, cvm: str) -> int:
    """How many staging records of ``cvm`` the host handed over."""
    return next((e.count for e in happened(news.events, Did.HANDED_OVER, party=cvm)), 0)


@row("decrypt-snooped", "host+holder", tried="the host handed mallory every staging record and push it captured from "
     "alice; mallory tried every key it kept at 32 IVs each", stopped_by="per-travel keys: alice's records were sealed "
     "under keys of her own travel's epoch, derived from the session secret mallory never had; no key it kept opens "
     "them (control: the same search opens mallory's own captured records)")
def decrypt_snooped(a: Arena) -> bool:
    news = _decrypt(a, ALICE, "victim")
    control = _control(a)
    return _got_nothing(news) and control.decrypted > 0


@row("host-forges-gpfifo-get", "host+holder", tried="when mallory handed the GPU back, the host forged BAR0's kernel "
     "GPFIFO get (put + 1) so the kernel ring looked full just as the orchestrator submitted the rotation; then alice "
     "travelled, and mallory tried the keys of its travel on the host's captures of her bounce buffers (before the "
     "fix the rotation was never submitted, recovery swallowed it, and alice's travel exported mallory's epoch "
     "again)", stopped_by="the epoch ledger (driver/epochs.py): the rotation after mallory's travel could not be "
     "submitted (no room in the forged ring: PeerTimeout), so travel halted instead of the epoch mallory kept "
     "travelling again; the recovery rotation met the same forged ring, so the orchestrator re-keyed the GPU through "
     "a new SPDM session (VRAM and every channel wiped, the forged get with them); alice's chunk then travelled under "
     f"keys mallory never had, and no key it kept opened the host's captures of her bounce buffers {CONTROL}")
def host_forges_gpfifo_get(a: Arena) -> bool:
    a.host.order(ArmForgeGet(MALLORY, hold_s=FORGE_HOLD_S["home"]))
    own = a.travel(MALLORY)  # mallory keeps the blob of this travel's epoch
    forged = bool(happened(a.host.news().events, Did.FORGED_GET))
    rekeyed = a.rekeyed()
    a.restore()
    victim = a.travel(ALICE)  # before the fix: under the very epoch mallory kept
    news = _decrypt(a, ALICE, "victim", newest=2)  # the blobs of mallory's travel
    control = _control(a)
    handed = _handed(a.host.news(), ALICE)
    ok = a.carry_on(BOB)
    return (forged and "PeerTimeout" in own.kinds and "GPFIFO space" in own.message and rekeyed
            and victim.verified and handed > 0 and _got_nothing(news) and control.decrypted > 0 and ok)


@row("collusion-after-failed-rotation", "host+holder", tried="mallory took a travel and refused it (then, a second "
     "time, never answered); each time the host forged the kernel get so the rotation after it and the recovery "
     "rotation could not be submitted; then alice travelled and mallory tried the keys of that travel on the host's "
     "captures of alice's bounce buffers (the issue's probe read 262,144 of 262,144 bytes this way before the fix)",
     stopped_by="the epoch ledger: whether mallory refused or never answered, the recovery rotation could not be "
     "submitted (the host's forged kernel get), so the orchestrator halted travel and re-keyed the GPU through a new "
     "SPDM session before alice's travel; alice's chunk travelled under the new session's keys, which mallory never "
     f"had: its kept keys opened none of the host's captures of alice's bounce buffers {CONTROL}")
def collusion_after_failed_rotation(a: Arena) -> bool:
    good = True
    for mode in ("refuse", "vanish"):  # quiet: the exported counters stay in step, so alice's travel would work
        a.stage = mode
        a.host.order(ArmForgeGet(MALLORY, hold_s=FORGE_HOLD_S["home" if mode == "refuse" else "taken"]))
        own, _ = _mallory_travels(a, mode)
        forged = bool(happened(a.host.news().events, Did.FORGED_GET))
        rekeyed = a.rekeyed()
        a.restore()
        victim = a.travel(ALICE)
        news = _decrypt(a, ALICE, mode, newest=2)  # the blobs of mallory's travel (given, and returned)
        handed = _handed(a.host.news(), ALICE)
        good = (good and bool(own.error) and forged and rekeyed and victim.verified and handed > 0
                and _got_nothing(news))
    a.stage = ""
    control = _control(a)
    ok = a.carry_on(BOB)
    return good and control.decrypted > 0 and ok


@row("baseline-then-travel", "host+holder", tried="alice's chunk went by the TLS baseline (the orchestrator's own copy "
     "through its bounce buffers, which the host captured), then mallory travelled and tried the keys of its travel "
     "on the host's captures of the orchestrator's bounce buffers", stopped_by="the epoch ledger: the orchestrator's "
     "own copy spent the epoch, which the driver then refuses to export (EpochSpent), so the orchestrator rotated to "
     "a fresh epoch before mallory's travel; no key mallory kept opened the host's captures of the orchestrator's "
     f"bounce buffers {CONTROL}")
def baseline_then_travel(a: Arena) -> bool:
    base = a.baseline(ALICE)  # the orchestrator's own copy through its bounce buffers
    own = a.travel(MALLORY)
    entries = a.journal()
    news = _decrypt(a, ORCHESTRATOR, "baseline", newest=2)  # the blobs of mallory's travel
    control = _control(a)
    handed = _handed(a.host.news(), ORCHESTRATOR)
    ok = a.carry_on(ALICE)
    # A travel moves one epoch (the rotation after it); two: the orchestrator rotated away from
    # the epoch of its own copy before it exported one to mallory.
    rotated = [e for e in entries if e.holder == MALLORY and e.epoch_after == e.epoch_before + 2]
    a.keep(*(EpochSkipped(holder=MALLORY, spent=e.epoch_before) for e in rotated))
    return (base and own.verified and bool(rotated) and handed > 0 and _got_nothing(news)
            and control.decrypted > 0 and ok)


ATTACKS: tuple[Attack, ...] = (
    replay_push, flip_ciphertext, wrong_cvm_during_travel, split_dma_irq, drop_rotation, drop_scrub, kept_keys,
    dump_vram, work_after_return, stale_context, altered_context, holder_pushes_counters_forward,
    drop_rotation_then_read, confirmation_substitution, switch_after_rotation, decrypt_snooped,
    host_forges_gpfifo_get, collusion_after_failed_rotation, baseline_then_travel, holder_reads_peer_memory,
    host_reads_cvm_memory, orchestrator_self_quote, never_returns, wrong_cvm_for_orchestrator,
    host_carries_allreduce, snoop_everything,
)
