"""The attacks, each driven against the live cohort, each judged by what was observed.

An attack returns a :class:`Verdict`: whether the defence it names was *seen* to act (a
typed error from the orchestrator, a fault flag the host read in BAR0, an attacker's read
that failed, a travel that never happened) and whether the cohort carried on. The bytes of
plaintext the attacker obtained are counted afterwards, by searching its loot
(:mod:`gputravel.redteam.run`). Nothing here checks anything the system itself does not:
the verdict only reports what the real defences did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ChannelFaulted, ContextBlobError, GputravelError, PeerTimeout
from ..roles.orchestrator import TravelReport
from .cohort import HolderLink, HostLink, RedTeamCohort
from .messages import (
    ArmDrop,
    ArmExposePrefix,
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

ORCH = "orchestrator"
ALICE, BOB, MALLORY = "alice", "bob", "mallory"


@dataclass(frozen=True)
class Verdict:
    stopped: bool
    stopped_by: str
    evidence: tuple[str, ...]


@dataclass(frozen=True)
class Attack:
    name: str
    adversary: str  # "host", "holder" or "host+holder"
    tried: str
    run: Callable[[Arena], Verdict]


@dataclass(frozen=True)
class Outcome:
    holder: str
    report: TravelReport | None
    error: GputravelError | None

    @property
    def verified(self) -> bool:
        return self.report is not None and self.report.chunk is not None

    def failed_with(self, *kinds: type) -> bool:
        return isinstance(self.error, kinds)

    def describe(self) -> str:
        if self.error is not None:
            return f"travel to {self.holder} failed: {type(self.error).__name__}: {self.error}"
        assert self.report is not None
        if self.report.refused:
            return f"{self.holder} refused the travel ({self.report.refused})"
        audit = self.report.nonzero_on_arrival
        seen = f"; its arrival audit found {audit} non-zero bytes" if audit >= 0 else ""
        return f"travel to {self.holder} verified (digest of VRAM = manifest){seen}"


class Arena:
    """The live cohort and the attackers' links, as the attacks use them."""

    def __init__(self, cohort: RedTeamCohort, host: HostLink, mallory: HolderLink, buffer_bytes: int,
                 audit: bool) -> None:
        self.cohort, self.host, self.mallory = cohort, host, mallory
        self.buffer_bytes = buffer_bytes
        self.records = buffer_bytes // cohort.config.layout.record_bytes
        self.slots = cohort.config.layout.staging_slots
        self.audit = audit
        self._offset = {h.name: 0 for h in cohort.config.holders}

    def travel(self, holder: str) -> Outcome:
        size = self.cohort.dataset_bytes[holder]
        offset = self._offset[holder]
        self._offset[holder] = (offset + self.buffer_bytes) % max(size - size % self.buffer_bytes, self.buffer_bytes)
        try:
            return Outcome(holder, self.cohort.travel(holder, offset), None)
        except GputravelError as exc:
            return Outcome(holder, None, exc)

    def carry_on(self, holder: str) -> tuple[bool, str]:
        """Does the cohort go on? A fault an attack left may cost one refused travel (DoS)."""
        first = self.travel(holder)
        if first.verified:
            return True, "then: " + first.describe()
        second = self.travel(holder)
        return second.verified, f"then: {first.describe()}; then: {second.describe()}"

    def copy_push(self, record: int) -> int:
        """Index, within a holder's travel, of the user push that copies ``record``."""
        return record + (self.records if self.audit else 0)


def _events(news: HostNews | HolderNews, prefix: str) -> list[str]:
    return [f"{prefix}: {e}" for e in news.events if not e.startswith("switch:")]


def _said(news: HostNews, text: str) -> bool:
    return any(text in e for e in news.events)


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
    ok, after = a.carry_on(BOB)
    dropped = sum("dropped the orchestrator's doorbell" in e for e in news.events)
    stopped = dropped == 2 and out.failed_with(PeerTimeout) and "semaphore" in str(out.error) and ok
    return Verdict(stopped, "the orchestrator waits for the rotation's confirmation (a kernel semaphore under the new "
                   "key) with a timeout: it failed the travel with PeerTimeout instead of going on, tried to rotate "
                   "again, and the next travel's scrub could only be confirmed after the device ran the pending "
                   "rotations in order (the kernel channel's receiver-tracked IVs)",
                   (*_events(news, "host"), out.describe(), after))


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
    later = a.travel(BOB)
    news = a.host.news()
    stopped = (_said(news, "mapped bob's memory") and out.failed_with(ChannelFaulted) and news.kernel_faults >= 1
               and not later.verified)
    return Verdict(stopped, "only the orchestrator holds kernel-channel keys: the rotation push the device read from "
                   "bob's memory failed authentication and faulted the kernel channel; the orchestrator stopped "
                   "(ChannelFaulted) and, by design, travels no more until a new session (denial of service, out of "
                   "the threat model)", (*_events(news, "host"), out.describe(), "then: " + later.describe()))


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
                     "state it had exported, rotated, and went on")


def altered_context(a: Arena) -> Verdict:
    return _bad_blob(a, ("altered-keys", "corrupted"), "context blob validation: a blob carrying a key the orchestrator "
                     "did not export, and one failing its checksum, were refused (ContextBlobError); the orchestrator "
                     "kept its own exported state, rotated, and went on")


def _bad_blob(a: Arena, modes: tuple[str, ...], why: str) -> Verdict:
    evidence, refused = [], 0
    for mode in modes:
        a.mallory.order(SetTravelMode(mode))
        out = a.travel(MALLORY)
        news = a.mallory.news()
        evidence += [*_events(news, "mallory"), out.describe()]
        refused += out.failed_with(ContextBlobError)
    ok, after = a.carry_on(ALICE)
    return Verdict(refused == len(modes) and ok, why, (*evidence, after))


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
    a.host.order(ForceSwitch(MALLORY, MALLORY, hide_kernel=True))
    first = a.mallory.order(UseKeptKeys(blobs=1, timeout=1.0), timeout=60)
    a.host.order(ForceSwitch(ORCH, ORCH, hide_kernel=False))
    victim = a.travel(ALICE)
    a.host.order(ForceSwitch(MALLORY, MALLORY, hide_kernel=False))
    second = a.mallory.order(UseKeptKeys(blobs=1, timeout=1.0), timeout=60)
    a.host.order(ForceSwitch(ORCH, ORCH, hide_kernel=False))
    host = a.host.news()
    ok, after = a.carry_on(BOB)
    stopped = own.failed_with(PeerTimeout) and victim.verified and second.bytes_read == 0 and ok
    return Verdict(stopped, "the orchestrator did not go on without the rotation's confirmation (PeerTimeout); with the "
                   "rotation suppressed mallory could read only its own chunk (scrub before its travel); alice's "
                   "travel needed a confirmed scrub, which the in-order kernel channel gives only after the pending "
                   "rotations ran, so alice's data was under keys mallory never had",
                   (own.describe(), *_events(first, "mallory (rotation suppressed)"), victim.describe(),
                    *_events(second, "mallory (after alice)"), *_events(host, "host"), after))


def confirmation_substitution(a: Arena) -> Verdict:
    a.host.order(ArmDrop(after_return_of=BOB, kernel_rings=2))
    victim = a.travel(BOB)  # its chunk stays in VRAM: the rotations after it never ran
    a.host.order(ArmExposePrefix(entries=2))
    a.mallory.order(SetTravelMode("dump"))
    out = a.travel(MALLORY)
    news = a.mallory.order(SetTravelMode("honest"))
    host = a.host.news()
    ok, after = a.carry_on(ALICE)
    travelled = _said(host, "orchestrator asked for the GPU to go to mallory")
    stopped = victim.failed_with(PeerTimeout) and not travelled and out.failed_with(PeerTimeout) and ok
    return Verdict(stopped, "every kernel push waits for a release value never used before, so the confirmation "
                   "of a pending rotation cannot stand in for the scrub's: the scrub was not confirmed, the "
                   "orchestrator failed with PeerTimeout and never exported keys to mallory",
                   (victim.describe(), *_events(host, "host"), out.describe(), *_events(news, "mallory"), after))


def decrypt_snooped(a: Arena) -> Verdict:
    theirs = a.cohort.loot_dir / "decrypt-snooped" / "captured-alice.frames"
    ours = a.cohort.loot_dir / "decrypt-snooped" / "captured-mallory.frames"
    a.host.order(ExportRecords(ALICE, str(theirs)))
    a.host.order(ExportRecords(MALLORY, str(ours)))
    news = a.mallory.order(DecryptCaptured(str(theirs)), timeout=300)
    control = a.mallory.order(DecryptCaptured(str(ours)), timeout=300)
    stopped = news.attempts > 0 and news.decrypted == 0 and control.decrypted > 0
    return Verdict(stopped, "per-travel keys: alice's records were sealed under keys of her own travel's epoch, "
                   "derived from the session secret mallory never had; no key it kept opens them (control: the "
                   "same search opens mallory's own captured records)",
                   (*_events(news, "mallory"), *_events(control, "mallory, control on its own records")))


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
    Attack("never-returns", "holder", "mallory took a travel, read the buffer, and then never switched the GPU back "
           "nor replied", never_returns),
    Attack("wrong-cvm-for-orchestrator", "host", "when alice handed the GPU back, mapped bob's bounce buffers instead "
           "of the orchestrator's, so the orchestrator's rotation went to the wrong CVM (runs last: it stops the "
           "cohort)", wrong_cvm_for_orchestrator),
    Attack("snoop-everything", "host", "read every CVM's bounce buffers (the snooper at boot, and a snapshot at every "
           "doorbell and every switch), every push it captured, and every TLS byte between holders and the "
           "orchestrator, throughout the run", snoop_everything),
)
