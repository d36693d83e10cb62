"""The red team (issue 6): every attack run for real against one live cohort, through the CLI.

`gputravel redteam --json` boots a cohort whose host is the malicious hypervisor and one of
whose holders (mallory) is malicious, runs every attack, and searches everything each
attacker read for the other holders' canaries. Each test below checks one row: the defence it
names was seen to act (the evidence) and the attacker got 0 bytes. With a defence switched off
the row fails (see docs/security.md, "Do the tests fail when a defence is off?").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gputravel.cli.app import app
from gputravel.holder.cvm import DataHolder
from gputravel.redteam import rows, run as redteam_run
from gputravel.redteam.bus import Did
from gputravel.redteam.evidence import (
    Acted,
    Baseline,
    Carried,
    Control,
    EpochSkipped,
    Journal,
    Logged,
    Probed,
    RankStep,
    Recovered,
    Rejoined,
    Searched,
    Tampered,
    Travel,
    Travelled,
    load,
)
from gputravel.redteam.holder import MaliciousHolder
from gputravel.redteam.rows import ATTACKS
from gputravel.cohort import isolation
from gputravel.testing import TIMEOUT_SCALE

Check = Callable[[list], bool]


def has(kind: type, **want: object) -> Check:
    """A record of ``kind`` whose fields equal ``want`` (a callable tests its field instead)."""
    def check(records: list) -> bool:
        return any(isinstance(r, kind) and all(v(getattr(r, k)) if callable(v) else getattr(r, k) == v
                                               for k, v in want.items()) for r in records)
    check.__qualname__ = f"{kind.__name__}{want}"
    return check


def host(did: Did, **want: object) -> Check:
    return has(Acted, who="host", did=did, **want)


def mallory(did: Did, **want: object) -> Check:
    return has(Acted, who="mallory", did=did, **want)


def travel(holder: str, **want: object) -> Check:
    return has(Travel, holder=holder, **want)


def failed(holder: str, kind: str, words: str = "") -> Check:
    """A travel that failed with ``kind`` (or a class derived from it), its message naming ``words``."""
    return has(Travel, holder=holder, kinds=lambda k: kind in k, message=lambda m: words in m)


def then(holder: str) -> Check:
    """After the attack, a travel to ``holder`` verified: the cohort went on."""
    return has(Travel, holder=holder, verified=True, after=True)


def refused_blob(words: str) -> Check:
    """Mallory's travel failed with ContextRefused (a ContextBlobError, which the control link
    carries under that base class, naming it), the orchestrator naming the check that fired."""
    return has(Travel, holder="mallory", kinds=lambda k: "ContextBlobError" in k,
               message=lambda m: "ContextRefused" in m and words in m)


POSITIVE, NONE = (lambda n: n > 0), (lambda n: n == 0)
REKEYED = has(Logged, rekeyed=True)
DROPPED_AND_BACK = (mallory(Did.CONNECTION_DROPPED), has(Recovered, holder="mallory"),
                    has(Rejoined, holder="mallory"), then("alice"))
OPENED_NONE = (mallory(Did.DECRYPT, stage=lambda s: s != "control", count=0, nbytes=POSITIVE),
               mallory(Did.DECRYPT, stage="control", count=POSITIVE))


def kept_read(place: str) -> bool:
    return place.startswith("with kept epoch-")


def vram_fd(place: str) -> bool:
    return place.startswith("descriptor") and "(/memfd:gputravel-vram" in place


def probed_denied(attacker: str) -> Check:
    return has(Probed, attacker=attacker, isolation=True, denied=POSITIVE, read=0, nbytes=0)


# What each row's evidence must show, as typed records: the real defence acting, not just "no plaintext".
EXPECTED: dict[str, tuple[str, tuple[Check, ...]]] = {
    "replay-push": ("host", (host(Did.REPLAYED, party="alice"), host(Did.FAULT_FLAG, place="user"))),
    "flip-ciphertext": ("host", (host(Did.FLIPPED, party="bob"), host(Did.FAULT_FLAG, place="user"),
                                 travel("bob", refused=lambda r: r.startswith("ChannelFaulted")))),
    "wrong-cvm-during-travel": ("host", (host(Did.ROUTED, party="bob"), travel("alice", refused=bool),
                                         then("alice"))),
    "split-dma-irq": ("host", (host(Did.ROUTED, party="alice", place="bob"), travel("alice", verified=True))),
    "drop-rotation": ("host", (host(Did.DROPPED_KERNEL_RING), failed("alice", "PeerTimeout", "semaphore"),
                               has(Logged, recovery_failed="PeerTimeout"), REKEYED,
                               has(Journal, event="aborted", holder="alice"), then("bob"))),
    "drop-scrub": ("host", (failed("bob", "PeerTimeout"), has(Travelled, holder="bob", went=False))),
    "kept-keys": ("holder", (mallory(Did.USED_KEPT_KEYS), travel("bob", verified=True))),
    "dump-vram": ("holder", (mallory(Did.READ, place="inside the granted window", nbytes=POSITIVE, count=0),
                             mallory(Did.READ, place="just past the granted window", error="ChannelFaulted"),
                             mallory(Did.READ, place="16 MiB past the granted window", error="ChannelFaulted"))),
    "work-after-return": ("holder", (mallory(Did.READ, place="after returning the GPU", error=bool, nbytes=0),)),
    "stale-context": ("holder", (refused_blob("context blob is from key epoch"),
                                 refused_blob("returned context blob is stale"), *DROPPED_AND_BACK)),
    "altered-context": ("holder", (refused_blob("returned context blob carries keys that were not exported"),
                                   refused_blob("context blob is corrupted"), *DROPPED_AND_BACK)),
    "holder-pushes-counters-forward": ("holder", (mallory(Did.RETURNED_BLOB, place="counters-forward"),
                                                  refused_blob("a channel counter changed during the travel"),
                                                  *DROPPED_AND_BACK, then("bob"))),
    "drop-rotation-then-read": ("host+holder", (failed("mallory", "PeerTimeout"), REKEYED,
                                                host(Did.FORCED_SWITCH, party="mallory"),
                                                mallory(Did.READ, stage="rotations dropped", place=kept_read, nbytes=0),
                                                mallory(Did.READ, stage="after alice", place=kept_read, nbytes=0),
                                                travel("alice", verified=True))),
    "confirmation-substitution": ("host+holder", (failed("bob", "PeerTimeout"), REKEYED, host(Did.NOTHING_TO_HOLD),
                                                  mallory(Did.READ, place="inside the granted window",
                                                          nbytes=2097152, count=0))),
    "switch-after-rotation": ("host+holder", (host(Did.FORCED_SWITCH, party="mallory"),
                                              mallory(Did.USED_KEPT_KEYS))),
    "decrypt-snooped": ("host+holder", OPENED_NONE),
    "never-returns": ("holder", (mallory(Did.KEPT_GPU, place="never-return"), failed("mallory", "GputravelError",
                                                                                      "HolderLost"), then("alice"))),
    "host-forges-gpfifo-get": ("host+holder", (host(Did.FORGED_GET),
                                               failed("mallory", "PeerTimeout", "(waiting for GPFIFO space)"),
                                               has(Logged, recovery_failed=bool), REKEYED,
                                               has(Journal, event="aborted", holder="mallory"),
                                               travel("alice", verified=True), *OPENED_NONE)),
    "collusion-after-failed-rotation": ("host+holder", (mallory(Did.REFUSED, stage="refuse"),
                                                        mallory(Did.KEPT_GPU, stage="vanish", place="vanish"),
                                                        host(Did.FORGED_GET, stage="refuse"),
                                                        host(Did.FORGED_GET, stage="vanish"), REKEYED,
                                                        travel("alice", verified=True),
                                                        host(Did.HANDED_OVER, party="alice", count=POSITIVE),
                                                        *OPENED_NONE)),
    "baseline-then-travel": ("host+holder", (has(Baseline, holder="alice", error=""), travel("mallory", verified=True),
                                             has(EpochSkipped, holder="mallory"),
                                             host(Did.HANDED_OVER, party="orchestrator", count=POSITIVE),
                                             *OPENED_NONE)),
    "holder-reads-peer-memory": ("holder", (probed_denied("mallory"),
                                            mallory(Did.PROBED, party="alice", place=lambda p: p.startswith("memory ("),
                                                    error=bool),
                                            mallory(Did.PROBED, party="orchestrator", place=vram_fd, error=bool),
                                            mallory(Did.PROBED, party="alice", place="TLS key", error=bool),
                                            mallory(Did.PROBED, party="device", place="firmware key", error=bool),
                                            mallory(Did.FORK_CONTROL, stage="control", nbytes=POSITIVE),
                                            has(Control, nbytes=POSITIVE))),
    "host-reads-cvm-memory": ("host", (probed_denied("host"),
                                       host(Did.PROBED, party="mallory", place=lambda p: p.startswith("memory ("),
                                            error=bool),
                                       host(Did.PROBED, party="device", place=vram_fd, error=bool),
                                       host(Did.PROBED, party="orchestrator", place="TLS key", error=bool),
                                       host(Did.FORK_CONTROL, stage="control", nbytes=POSITIVE))),
    "orchestrator-self-quote": ("host+holder", (host(Did.QUOTE, error="QuotingRefused", nbytes=0,
                                                     place=lambda p: "is not the CVM this module launched" in p),
                                                mallory(Did.QUOTE, error="QuotingRefused", nbytes=0,
                                                        place=lambda p: "is not the CVM this module launched" in p),
                                                then("alice"))),
    "wrong-cvm-for-orchestrator": ("host", (host(Did.FAULT_FLAG, place="kernel"), failed("alice", "ChannelFaulted"),
                                            REKEYED, has(Journal, event="aborted", holder="alice"), then("bob"))),
    "host-carries-allreduce": ("host", (has(Carried, case="encrypted", nbytes=POSITIVE, found=0),
                                        has(Carried, case="encrypted-naive", nbytes=POSITIVE, found=0),
                                        has(Carried, case="plain-control", found=POSITIVE),
                                        has(Tampered, case="flip", fault="flip"),
                                        has(Tampered, case="replay", fault="replay"),
                                        has(Tampered, case="drop", fault="drop", delivered=-1),
                                        has(RankStep, case="flip", rank=1, completed=False, error="IntegrityError",
                                            untouched=True),
                                        has(RankStep, case="flip", rank=0, completed=True, sum_right=True))),
    "snoop-everything": ("host", (has(Searched, snoop_bytes=POSITIVE, tap_bytes=POSITIVE), has(Control, nbytes=POSITIVE))),
}


# The red team's waits at half their length for the suite: the device and holder timeouts, and
# the host's forged-GPFIFO holds, which are set against the device timeout (scaled with it, so
# each forged get still outlasts the rotation's tries and not the next scrub). Each dropped
# push, scrub or rotation and each holder that never hands the GPU back costs one of them
# (about half of the run's 47 s); a shorter wait changes no defence and no row's evidence, and
# leaves an honest push or travel (milliseconds here) ample room.
SUITE_WAITS = min(1.0, 0.5 * TIMEOUT_SCALE)  # a slower machine (GPUTRAVEL_TEST_TIMEOUT_SCALE) waits longer


# The whole red team runs in the first row's setup (about 50 s): the limit covers it, so a busy
# machine fails no row by the clock, while each row's verdict stays its own.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[int, str, dict]:
    # The arena's rows; the job rows' phase runs in tests/test_redteam_jobs.py (once in the suite).
    only = [arg for a in ATTACKS for arg in ("--only", a.name)]
    return run_redteam_cli(tmp_path_factory.mktemp("redteam") / "redteam.json", *only)


def run_redteam_cli(out, *args: str) -> tuple[int, str, dict]:
    """`gputravel redteam ARGS --json OUT` with the suite's waits: exit code, output, the JSON report."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("DEVICE_TIMEOUT", "HOLDER_TIMEOUT"):
            mp.setattr(redteam_run, name, getattr(redteam_run, name) * SUITE_WAITS)
        mp.setattr(rows, "FORGE_HOLD_S", {k: v * SUITE_WAITS for k, v in rows.FORGE_HOLD_S.items()})
        result = CliRunner().invoke(app, ["redteam", *args, "--json", str(out)])
    report = json.loads(out.read_text()) if out.exists() else {"attacks": []}
    return result.exit_code, result.output, report


def _row(report: dict, name: str) -> dict:
    rows = {r["name"]: r for r in report["attacks"]}
    assert name in rows, f"attack {name} did not run"
    return rows[name]


def test_every_attack_has_an_expectation() -> None:
    assert set(EXPECTED) == {a.name for a in ATTACKS}


ISOLATED = {a.name for a in ATTACKS if a.needs_isolation}


@pytest.mark.parametrize("name", [a.name for a in ATTACKS])
def test_attack_is_defeated(processes, run, name: str) -> None:
    _, _, report = run
    check_defeated(_row(report, name), name)


def check_defeated(row: dict, name: str) -> None:
    """A row's evidence as its expectation asks (tests/test_redteam_records.py checks its rows so too)."""
    if name in ISOLATED and isolation.unavailable():
        assert row["outcome"] == "skipped", row
        pytest.skip("process isolation needs root: the row is not run")
    adversary, must_show = EXPECTED[name]
    assert row["adversary"] == adversary
    assert row["plaintext_bytes_obtained"] == 0, f"{name}: the attacker obtained plaintext"
    assert row["scanned_bytes"] > 0, f"{name}: nothing the attacker read was searched"
    records, evidence = load(row["records"]), "\n".join(row["evidence"])
    for check in must_show:
        assert check(records), f"{name}: expected {check.__qualname__} in:\n{evidence}"
    assert row["outcome"] == "defeated", f"{name}:\n{evidence}"


def test_cli_prints_the_table_writes_json_and_exits_zero(processes, run) -> None:
    code, output, report = run
    assert code == 0, output
    assert "every attack defeated, 0 bytes of plaintext obtained" in output
    skipped = set(report["skipped"])
    assert skipped == (ISOLATED if isolation.unavailable() else set())
    assert report["failed"] == 0 and report["defeated"] == len(ATTACKS) - len(skipped)
    for row in report["attacks"]:
        assert {"name", "adversary", "tried", "stopped_by", "plaintext_bytes_obtained", "outcome"} <= set(row)
        assert row["adversary"] in ("host", "holder", "host+holder")
        assert isinstance(row["plaintext_bytes_obtained"], int) and row["tried"] and row["stopped_by"]
        assert len(load(row["records"])) == len(row["evidence"])  # each record, and in words


def test_cli_refuses_an_unknown_attack(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["redteam", "--only", "no-such-attack", "--json", str(tmp_path / "x.json")])
    assert result.exit_code == 1
    assert "unknown attack no-such-attack" in result.output
    assert not (tmp_path / "x.json").exists()


def test_a_pending_rotation_cannot_confirm_the_scrub_in_process() -> None:
    """The fast, in-process twin of the confirmation-substitution row (the bug the red team
    found): the host drops the rotation after bob's travel and its retry, then lets the
    device run only those two pending rotations when the orchestrator rings for the next
    scrub. The rotations' releases must not pass for the scrub's: the scrub times out, and
    bob's chunk is still in VRAM, so the orchestrator must not (and does not) go on."""
    import os

    from gputravel.errors import PeerTimeout
    from gputravel.protocol.layout import U32, Bar0, PushChannel
    from gputravel.testing import ORCHESTRATOR, TEST_LAYOUT, InProcessGpu

    gpu = InProcessGpu()
    orch, holders = gpu.boot("bob", "mallory")
    buf = orch.alloc_dataset_buffer(2 * TEST_LAYOUT.record_bytes)
    chunk = os.urandom(buf.nbytes)
    gpu.travel(holders["bob"], chunk, buf, rotate=False)
    link = gpu.links[ORCHESTRATOR]
    link.before_service = lambda _: False  # the host drops every doorbell
    for _ in range(2):
        with pytest.raises(PeerTimeout):
            orch.rotate(timeout=0.05)

    def expose_the_rotations_only(_) -> None:
        get = U32.unpack_from(gpu.bar, Bar0.get(PushChannel.KERNEL))[0]
        U32.pack_into(gpu.bar, Bar0.put(PushChannel.KERNEL), (get + 2) % TEST_LAYOUT.gpfifo_entries)
        link.before_service = None

    link.before_service = expose_the_rotations_only
    with pytest.raises(PeerTimeout):
        orch.scrub(buf.offset, buf.nbytes, timeout=0.05)
    assert gpu.core.epoch == 2  # the device did run the two rotations...
    assert gpu.vram_at(buf.offset, buf.nbytes) == chunk  # ...and not the scrub: going on would leak bob's chunk
    assert orch.rotate() == 3  # once the host relents, everything runs in order
    orch.scrub(buf.offset, buf.nbytes)
    assert gpu.vram_at(buf.offset, buf.nbytes) == bytes(buf.nbytes)


def test_the_malicious_holder_misbehaves_only_through_the_public_dispatch() -> None:
    """Issue 13: the red team uses public APIs only. Mallory's travels run the honest holder's
    machine and dispatch; it replaces some entries of ``ACTIONS`` and overrides no private
    method of DataHolder."""
    assert set(MaliciousHolder.ACTIONS) == set(DataHolder.ACTIONS)
    private = {n for n in vars(DataHolder) if n.startswith("_") and not n.startswith("__")}
    assert not private & set(vars(MaliciousHolder))
