"""Red-team rows of the malicious hypervisor (paper 6.2): it tampers with and replays what
CVMs put in their bounce buffers, maps the wrong CVM for the device, routes interrupts
elsewhere, drops doorbells, and watches everything (:mod:`gputravel.redteam.host`).
"""

from __future__ import annotations

from gputravel.errors import ChannelFaulted, PeerTimeout
from gputravel.protocol.parties import ORCHESTRATOR
from gputravel.redteam.arena import ALICE, BOB, Arena, Verdict, host_said, news_lines, rekeyed
from gputravel.redteam.messages import ArmDrop, ArmRoute, ArmTamper


def replay_push(a: Arena) -> Verdict:
    a.host.order(ArmTamper(ALICE, "replay", a.copy_push(0), 0))
    out = a.travel(ALICE)
    news = a.host.news()
    ok, after = a.carry_on(ALICE)
    replayed = host_said(news, "back as a new entry")
    stopped = replayed and news.user_faults >= 1 and ok
    return Verdict(stopped, "receiver-tracked IVs: the replayed push failed AES-GCM authentication at the IV the "
                   "device expected next, so the device faulted the user channel and executed nothing; the "
                   "orchestrator's rotation after the travel reset the channel",
                   (*news_lines(news, "host"), out.describe(), after))


def flip_ciphertext(a: Arena) -> Verdict:
    """The device works while the CVM appends, so a flip can come too late (the device already
    took the record, authentically): then the travel verifies and the host tries again."""
    evidence: list[str] = []
    for _ in range(3):
        a.host.order(ArmTamper(BOB, "flip", a.copy_push(1), 1 % a.slots))
        out = a.travel(BOB)
        news = a.host.news()
        evidence += [*news_lines(news, "host"), out.describe()]
        if news.user_faults:
            break
    ok, after = a.carry_on(BOB)
    stopped = news.user_faults >= 1 and not out.verified and ok
    return Verdict(stopped, "AES-GCM tag check on the record: the device decrypts into private scratch and writes "
                   "VRAM only after the tag verifies, so the tampered record reached nothing; the user channel "
                   "faulted, bob refused the travel, the orchestrator rotated and went on", (*evidence, after))


def wrong_cvm_during_travel(a: Arena) -> Verdict:
    a.host.order(ArmRoute(ORCHESTRATOR, ALICE, dma=BOB, irq=BOB))
    out = a.travel(ALICE)
    news = a.host.news()
    ok_b, after_b = a.carry_on(BOB)
    ok_a, after_a = a.carry_on(ALICE)
    stopped = host_said(news, "mapped bob's memory") and not out.verified and ok_a and ok_b
    return Verdict(stopped, "the device only reaches the CVM the MUX maps, and bob's bounce buffers hold no push "
                   "valid at the IV the device expects: alice's work faulted the user channel and she refused the "
                   "travel; bob has no keys of this epoch and saw only ciphertext",
                   (*news_lines(news, "host"), out.describe(), after_b, after_a))


def split_dma_irq(a: Arena) -> Verdict:
    a.host.order(ArmRoute(ORCHESTRATOR, ALICE, dma=ALICE, irq=BOB))
    out = a.travel(ALICE)
    news = a.host.news()
    ok, after = a.carry_on(BOB)
    stopped = host_said(news, "routed bob's interrupt") and ok
    return Verdict(stopped, "interrupts carry no data: bob got stray interrupts and ignored them; the device reached "
                   "only alice's bounce buffers (ciphertext); alice's driver saw each release by polling its "
                   "authenticated semaphore, so the travel still completed and verified",
                   (*news_lines(news, "host"), out.describe(), after))


def drop_rotation(a: Arena) -> Verdict:
    a.host.order(ArmDrop(after_return_of=ALICE, kernel_rings=2))
    out = a.travel(ALICE)
    news = a.host.news()
    said, journal = a.orchestrator_said(), a.journal()
    ok, after = a.carry_on(BOB)
    dropped = sum("dropped the orchestrator's doorbell" in e for e in news.events)
    stopped = (dropped == 2 and out.failed_with(PeerTimeout) and "semaphore" in str(out.error)
               and rekeyed(said) and ok)
    return Verdict(stopped, "the orchestrator waits for the rotation's confirmation (a kernel semaphore under the new "
                   "key) with a timeout: it failed the travel with PeerTimeout instead of going on; its recovery "
                   "rotation went unheard too, so, unable to show the device had left alice's epoch, it re-keyed "
                   "the GPU through a new SPDM session (VRAM and every channel wiped) before any other travel; "
                   "the next travel verified under the new session's keys",
                   (*news_lines(news, "host"), out.describe(), *said, *journal, after))


def drop_scrub(a: Arena) -> Verdict:
    a.host.order(ArmDrop(after_return_of="", kernel_rings=1))
    out = a.travel(BOB)
    news = a.host.news()
    ok, after = a.carry_on(BOB)
    travelled = host_said(news, "orchestrator asked for the GPU to go to bob")
    stopped = out.failed_with(PeerTimeout) and not travelled and ok
    return Verdict(stopped, "the orchestrator never exports keys before the scrub is confirmed: the unanswered push "
                   "ended in PeerTimeout, the GPU never left it, and the recovery rotation ran after the scrub",
                   (*news_lines(news, "host"), out.describe(), "the GPU never travelled to bob" if not travelled
                    else "the GPU travelled to bob", after))


def wrong_cvm_for_orchestrator(a: Arena) -> Verdict:
    a.host.order(ArmRoute(ALICE, ORCHESTRATOR, dma=BOB, irq=BOB))
    out = a.travel(ALICE)
    news = a.host.news()
    said, journal = a.orchestrator_said(), a.journal()
    ok, after = a.carry_on(BOB)
    stopped = (host_said(news, "mapped bob's memory") and out.failed_with(ChannelFaulted) and news.kernel_faults >= 1
               and rekeyed(said) and ok)
    return Verdict(stopped, "only the orchestrator holds kernel-channel keys: the rotation push the device read from "
                   "bob's memory failed authentication and faulted the kernel channel (ChannelFaulted), so the "
                   "rotation was never confirmed; the orchestrator halted travel and re-keyed the GPU through a new "
                   "SPDM session (VRAM and every channel wiped, the dataset buffer granted again); the next travel "
                   "verified under the new session's keys",
                   (*news_lines(news, "host"), out.describe(), *said, *journal, after))




def snoop_everything(a: Arena) -> Verdict:
    return Verdict(True, "AES-256-GCM on every byte in the bounce buffers (records, pushes, RPCs, semaphores); "
                   "TLS 1.3 on every holder link (context blobs travel only inside it)", ())
