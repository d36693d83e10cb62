"""Red-team rows of the malicious data holder (paper 6.1): mallory keeps every key it is
given, dumps VRAM, works after handing the GPU back, returns stale or altered context blobs,
or never returns the GPU (:mod:`gputravel.redteam.holder`).
"""

from __future__ import annotations

from gputravel.errors import ContextBlobError
from gputravel.redteam.arena import ALICE, BOB, MALLORY, Arena, Verdict, log_line, news_lines, rekeyed
from gputravel.redteam.messages import SetTravelMode, UseKeptKeys


def kept_keys(a: Arena) -> Verdict:
    victim = a.travel(ALICE)
    news = a.mallory.order(UseKeptKeys(blobs=2, timeout=1.0), timeout=60)
    ok, after = a.carry_on(BOB)
    stopped = victim.verified and news.attempts > 0 and news.bytes_read == 0 and ok
    return Verdict(stopped, "the GPU is not mapped to mallory, so the device never reads its pushes (its doorbell "
                   "makes the device read the orchestrator's bounce buffers and fail authentication), and the keys "
                   "it kept are of epochs the device has rotated away from",
                   (victim.describe(), *news_lines(news, "mallory"), after))


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
                   (victim.describe(), *news_lines(news, "mallory"), *news_lines(host, "host"), out.describe(), after))


def work_after_return(a: Arena) -> Verdict:
    a.mallory.order(SetTravelMode("work-after-return"))
    out = a.travel(MALLORY)
    news = a.mallory.news()
    ok, after = a.carry_on(ALICE)
    stopped = out.verified and news.attempts > 0 and news.bytes_read == 0 and bool(news.errors) and ok
    return Verdict(stopped, "once it handed the GPU back, the device maps the orchestrator's bounce buffers, not "
                   "mallory's: its push was read from the wrong memory and failed authentication, and the rotation "
                   "that followed made its keys useless",
                   (*news_lines(news, "mallory"), out.describe(), after))


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
        evidence += [*news_lines(news, "mallory"), out.describe(), *map(log_line, entries)]
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
    stopped = (refused == dropped == rotated == len(modes) and not rekeyed(said) and ok and ok_b)
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
                   (*news_lines(news, "mallory"), out.describe(), after))
