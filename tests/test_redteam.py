"""The red team (issue 6): every attack run for real against one live cohort, through the CLI.

`gputravel redteam --json` boots a cohort whose host is the malicious hypervisor and one of
whose holders (mallory) is malicious, runs every attack, and searches everything each
attacker read for the other holders' canaries. Each test below checks one row: the defence it
names was seen to act (the evidence) and the attacker got 0 bytes. With a defence switched off
the row fails (see docs/security.md, "Do the tests fail when a defence is off?").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gputravel.cli.app import app
from gputravel.holder.cvm import DataHolder
from gputravel.redteam.attacks import ATTACKS
from gputravel.redteam import collusion_rows, run as redteam_run
from gputravel.redteam.holder import MaliciousHolder
from gputravel.cohort import isolation
from gputravel.testing import TIMEOUT_SCALE

# What each row's evidence must show: the real defence acting, not just "no plaintext".
EXPECTED: dict[str, tuple[str, tuple[str, ...]]] = {
    "replay-push": ("host", ("back as a new entry", "raised the user channel's fault flag")),
    "flip-ciphertext": ("host", ("flipped one ciphertext bit", "raised the user channel's fault flag",
                                 "refused the travel (ChannelFaulted")),
    "wrong-cvm-during-travel": ("host", ("mapped bob's memory", "alice refused the travel",
                                         "then: travel to alice verified")),
    "split-dma-irq": ("host", ("routed bob's interrupt", "travel to alice verified")),
    "drop-rotation": ("host", ("dropped the orchestrator's doorbell", "failed: PeerTimeout",
                               "orchestrator: recovery rotation failed (PeerTimeout",
                               "re-keyed the GPU through a new SPDM session", "travel log: aborted alice",
                               "then: travel to bob verified")),
    "drop-scrub": ("host", ("failed: PeerTimeout", "the GPU never travelled to bob")),
    "kept-keys": ("holder", ("used the keys of epoch", "travel to bob verified")),
    "dump-vram": ("holder", ("inside the granted window: 0 not zero", "just past the granted window: ChannelFaulted",
                             "16 MiB past the granted window: ChannelFaulted")),
    "work-after-return": ("holder", ("read after returning the GPU:",)),
    "stale-context": ("holder", (("ContextRefused: holder 'mallory' lost during a travel: it returned a context that "
                                  "was refused: context blob is from key epoch"),
                                 "was refused: returned context blob is stale",
                                 "mallory: the orchestrator dropped the connection",
                                 "the GPU was recovered by the rotation under way",
                                 "mallory joined the cohort again", "then: travel to alice verified")),
    "altered-context": ("holder", ("was refused: returned context blob carries keys that were not exported",
                                   "was refused: context blob is corrupted",
                                   "mallory: the orchestrator dropped the connection",
                                   "the GPU was recovered by the rotation under way",
                                   "mallory joined the cohort again", "then: travel to alice verified")),
    "holder-pushes-counters-forward": ("holder", ("channel counter of its first sender moved forward",
                                                  "ContextBlobError", "a channel counter changed during the travel",
                                                  "mallory: the orchestrator dropped the connection",
                                                  "the GPU was recovered by the rotation under way",
                                                  "mallory joined the cohort again",
                                                  "then: travel to alice verified", "then: travel to bob verified")),
    "drop-rotation-then-read": ("host+holder", ("travel to mallory failed: PeerTimeout",
                                                "re-keyed the GPU through a new SPDM session",
                                                "switched the GPU to mallory unasked",
                                                "(rotations dropped): read with kept epoch-",
                                                "(after alice): read with kept epoch-",
                                                "travel to alice verified")),
    "confirmation-substitution": ("host+holder", ("travel to bob failed: PeerTimeout",
                                                  "re-keyed the GPU through a new SPDM session",
                                                  "nothing left to hold back",
                                                  "read 2097152 bytes inside the granted window: 0 not zero")),
    "switch-after-rotation": ("host+holder", ("switched the GPU to mallory unasked", "used the keys of epoch")),
    "decrypt-snooped": ("host+holder", (": 0 opened", "control on its own records")),
    "never-returns": ("holder", ("never switched back", "HolderLost", "then: travel to alice verified")),
    "host-forges-gpfifo-get": ("host+holder", ("forged BAR0's kernel GPFIFO get",
                                               "travel to mallory failed: PeerTimeout",
                                               "(waiting for GPFIFO space)",
                                               "orchestrator: recovery rotation failed",
                                               "re-keyed the GPU through a new SPDM session",
                                               "travel log: aborted mallory",
                                               "travel to alice verified", ": 0 opened", "control on its own records")),
    "collusion-after-failed-rotation": ("host+holder", ("[mallory: refuse]", "refused the travel on purpose",
                                                        "[mallory: vanish]", "never switched back",
                                                        "forged BAR0's kernel GPFIFO get",
                                                        "re-keyed the GPU through a new SPDM session",
                                                        "travel to alice verified", "handed over",
                                                        ": 0 opened", "control on its own records")),
    "baseline-then-travel": ("host+holder", ("baseline transfer of alice's chunk",
                                             "travel to mallory verified",
                                             "the epoch of the baseline copy, and mallory was given epoch",
                                             "staging records and", "of orchestrator", ": 0 opened",
                                             "control on its own records")),
    "holder-reads-peer-memory": ("holder", ("process isolation on: each party under its own uid",
                                            "0 read (0 bytes)", "probe peer alice's memory (",
                                            "probe peer orchestrator's descriptor", "(/memfd:gputravel-vram",
                                            "probe peer alice's TLS key: denied",
                                            "probe peer the device's firmware key: denied",
                                            "bytes of a dumpable fork of itself",
                                            "control: the same search finds")),
    "host-reads-cvm-memory": ("host", ("process isolation on: each party under its own uid", "0 read (0 bytes)",
                                       "probe peer mallory's memory (", "probe peer device's descriptor",
                                       "(/memfd:gputravel-vram", "probe peer orchestrator's TLS key: denied",
                                       "bytes of a dumpable fork of itself")),
    "orchestrator-self-quote": ("host+holder", (("host: asked the TDX module for a quote over its own report data: "
                                                 "QuotingRefused"),
                                                ("mallory: asked the TDX module for a quote over its own report data: "
                                                 "QuotingRefused"), "is not the CVM this module launched",
                                                "then: travel to alice verified")),
    "wrong-cvm-for-orchestrator": ("host", ("raised the kernel channel's fault flag",
                                            "travel to alice failed: ChannelFaulted",
                                            "re-keyed the GPU through a new SPDM session",
                                            "travel log: aborted alice", "then: travel to bob verified")),
    "host-carries-allreduce": ("host", ("encrypted: the host carried", "encrypted-naive: the host carried",
                                        "0 bytes of the canary gradient found", "control: the host carried",
                                        "flip: host: flipped bit", "replay: host: delivered the record before",
                                        "drop: host: dropped record", "rank 1's step stopped: IntegrityError",
                                        "its parameters never moved", "rank 0's step completed with the right sum")),
    "snoop-everything": ("host", ("the TLS tap", "control: the same search finds")),
}


# The red team's waits at half their length for the suite: the device and holder timeouts, and
# the host's forged-GPFIFO holds, which are set against the device timeout (scaled with it, so
# each forged get still outlasts the rotation's tries and not the next scrub). Each dropped
# push, scrub or rotation and each holder that never hands the GPU back costs one of them
# (about half of the run's 70 s); a shorter wait changes no defence and no row's evidence, and
# leaves an honest push or travel (milliseconds here) ample room.
SUITE_WAITS = min(1.0, 0.5 * TIMEOUT_SCALE)  # a slower machine (GPUTRAVEL_TEST_TIMEOUT_SCALE) waits longer


# The whole red team runs in the first row's setup (about 70 s): the limit covers it, so a busy
# machine fails no row by the clock, while each row's verdict stays its own.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[int, str, dict]:
    out = tmp_path_factory.mktemp("redteam") / "redteam.json"
    with pytest.MonkeyPatch.context() as mp:
        for name in ("DEVICE_TIMEOUT", "HOLDER_TIMEOUT"):
            mp.setattr(redteam_run, name, getattr(redteam_run, name) * SUITE_WAITS)
        mp.setattr(collusion_rows, "FORGE_HOLD_S", {k: v * SUITE_WAITS for k, v in collusion_rows.FORGE_HOLD_S.items()})
        result = CliRunner().invoke(app, ["redteam", "--json", str(out)])
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
    row = _row(report, name)
    if name in ISOLATED and isolation.unavailable():
        assert row["outcome"] == "skipped", row
        pytest.skip("process isolation needs root: the row is not run")
    adversary, must_show = EXPECTED[name]
    assert row["adversary"] == adversary
    assert row["plaintext_bytes_obtained"] == 0, f"{name}: the attacker obtained plaintext"
    assert row["scanned_bytes"] > 0, f"{name}: nothing the attacker read was searched"
    evidence = "\n".join(row["evidence"])
    for text in must_show:
        assert text in evidence, f"{name}: expected {text!r} in:\n{evidence}"
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
