"""The travel machines' own rules (protocol/machine.py), and the shells that drive them.

- the transition table is the whole truth: every (phase, event) pair not in it is refused;
- any exception inside a machine leaves it in its error phase until ``abort()``;
- ``abort()`` returns either machine to idle from every phase;
- deadlines come from the configured budgets, and fire through ``on_timeout(now)`` on a fake clock;
- the shells (orchestrator/cvm.py, holder/cvm.py) carry out every action type the machines
  return, in the machines' order, with the machines' deadlines as IO timeouts.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gputravel.errors import IllegalTransition, PeerTimeout, ProtocolError
from gputravel.holder import cvm as holder_cvm
from gputravel.holder import steps as hs
from gputravel.holder.machine import Deadlines, HolderPhase, HolderTravel
from gputravel.orchestrator import machine as om
from gputravel.orchestrator.cvm import Orchestrator, OrchestratorConfig
from gputravel.orchestrator.machine import Buffer, OrchestratorTravel, Phase
from gputravel.protocol.layout import Layout
from gputravel.protocol.machine import TimedOut
from gputravel.protocol.manifest import chunk_digest, piece_digests
from gputravel.protocol.travel import (
    ChunkInfo,
    HolderHello,
    TravelRefused,
    TravelRequest,
    TravelResult,
    Welcome,
)
from gputravel.protocol.travel import Bye

PIECE = 4096
LAYOUT = Layout(record_bytes=PIECE)  # a holder's manifest pieces are one record at most
BUFFER = Buffer(offset=0x2000, nbytes=4 * PIECE)
BLOB = b"\x01context-blob\xfe" * 4
DATASET = bytes((i * 31 + 7) % 256 for i in range(10 * PIECE))
DIGEST = chunk_digest(DATASET[: BUFFER.nbytes], PIECE)
REQUEST = TravelRequest(1, BUFFER.offset, BUFFER.nbytes, 0, BLOB)
RESULT = TravelResult(1, BLOB, ChunkInfo(0, BUFFER.nbytes, DIGEST), {}, -1)


def orchestrator(deadlines: om.Deadlines = om.Deadlines()) -> OrchestratorTravel:
    o = OrchestratorTravel(BUFFER, deadlines)
    o.enrol(HolderHello("alice", len(DATASET), PIECE, piece_digests(DATASET, PIECE), "", "", 0, 0, True, bytes(32)))
    return o


def holder(deadlines: Deadlines = Deadlines(), audit: bool = True) -> HolderTravel:
    return HolderTravel("alice", len(DATASET), piece_digests(DATASET, PIECE), PIECE, deadlines, audit)


# One event of each type each machine takes (TimedOut comes from on_timeout, or is refused).
O_EVENTS = {type(e): e for e in (
    om.Start("alice", 0), om.ScrubStarted(7), om.Exported(BLOB), om.Scrubbed(), om.SwitchAsked(), om.RequestSent(),
    om.Switched(), om.Replied(RESULT), om.Home(), om.RotationStarted(), om.Imported(), om.Rotated(),
    om.Verified(DIGEST), TimedOut(1.0))}
H_EVENTS = {type(e): e for e in (
    hs.Attest(joining=True), hs.Attested(1e9), hs.HelloAnswered(Welcome("orchestrator")),
    hs.Request(REQUEST), hs.BaselineAsked(), hs.Imported(), hs.Attached(), hs.Audited(0),
    hs.Granted(BUFFER.nbytes), hs.Copied(BUFFER.nbytes), hs.StepFailed("boom"), hs.SwitchAsked(),
    hs.Exported(b"\x02back"), hs.Replied(), hs.SwitchedHome(), TimedOut(1.0))}

# A whole travel, event by event (the holder's: joining first, auditing on arrival), visiting every phase.
def o_travel(travel_id: int = 1) -> list:
    events = [O_EVENTS[t] for t in (om.Start, om.ScrubStarted, om.Exported, om.Scrubbed, om.SwitchAsked,
                                    om.RequestSent, om.Switched, om.Replied, om.Home, om.RotationStarted,
                                    om.Imported, om.Rotated, om.Verified)]
    events[7] = om.Replied(TravelResult(travel_id, BLOB, RESULT.chunk, {}, -1))  # the reply to this travel
    return events


def h_travel(travel_id: int = 1) -> list:
    return [H_EVENTS[t] for t in (hs.Attest, hs.Attested, hs.HelloAnswered, hs.Request, hs.Imported, hs.Attached,
                                  hs.Audited, hs.Granted, hs.Copied, hs.SwitchAsked, hs.Exported, hs.Replied,
                                  hs.SwitchedHome)]


O_TRAVEL, H_TRAVEL = o_travel(), h_travel()
MACHINES = {
    "orchestrator": (orchestrator, Phase, O_EVENTS, o_travel),
    "holder": (holder, HolderPhase, H_EVENTS, h_travel),
}


# ============================================================================ the table
@pytest.mark.parametrize("which", MACHINES)
def test_the_samples_cover_every_event_the_machine_handles(which) -> None:
    make, phases, events, _ = MACHINES[which]
    m = make()
    assert set(m.HANDLERS) | {TimedOut} == set(events)
    assert {e for _, e in m.TABLE} <= set(m.HANDLERS)  # every event in the table has a handler
    assert {p for p, _ in m.TABLE} | {q for qs in m.TABLE.values() for q in qs} <= set(phases)


@pytest.mark.parametrize("which", MACHINES)
def test_the_table_refuses_every_pair_not_in_it(which) -> None:
    make, phases, events, _ = MACHINES[which]
    refused = 0
    for phase in phases:
        for etype, event in events.items():
            if (phase, etype) in make().TABLE:
                continue
            m = make()
            m._phase = phase  # put there directly: this is about the table, not the way there
            with pytest.raises(IllegalTransition) as err:
                m.handle(event, 1.0)
            assert err.value.state == phase.value, (phase, etype)
            assert m.phase is phases.ERROR and m.next_deadline() is None, (phase, etype)
            refused += 1
    assert refused == len(phases) * len(events) - len(make().TABLE)


@pytest.mark.parametrize("which", MACHINES)
def test_a_whole_travel_visits_every_phase_and_ends_idle(which) -> None:
    make, phases, _, travel = MACHINES[which]
    m, seen = make(), set()
    for n, event in enumerate(travel()):
        m.handle(event, float(n))
        seen.add(m.phase)
    assert m.phase is phases.IDLE
    assert seen | {phases.ERROR} == set(phases)


# ============================================================================ the error phase
def test_an_exception_in_the_orchestrator_machine_is_sticky() -> None:
    o = orchestrator()
    for n, event in enumerate(O_TRAVEL[:7]):
        o.handle(event, float(n))
    stale = TravelResult(9, BLOB, RESULT.chunk, {}, -1)
    with pytest.raises(ProtocolError, match="travel 9, expected 1"):
        o.handle(om.Replied(stale), 7.0)
    assert o.phase is Phase.ERROR
    for event in O_EVENTS.values():  # nothing moves it now, not even the right reply
        with pytest.raises(IllegalTransition) as err:
            o.handle(event, 8.0)
        assert err.value.state == "error"
    assert o.next_deadline() is None and o.on_timeout(1e9) is None and o.phase is Phase.ERROR
    o.abort()
    assert o.handle(om.Start("alice", 0), 9.0) == om.StartScrub(BUFFER.offset, BUFFER.nbytes)


def test_an_exception_in_the_holder_machine_is_sticky() -> None:
    h = holder()
    h.handle(hs.Attest(joining=False), 0.0)
    h.handle(hs.Attested(10.0), 0.0)
    from gputravel.attest import AttestationError

    with pytest.raises(AttestationError, match="11 s old"):  # past its policy's age limit: no context touched
        h.handle(hs.Request(REQUEST), 11.0)
    assert h.phase is HolderPhase.ERROR
    for event in H_EVENTS.values():
        with pytest.raises(IllegalTransition):
            h.handle(event, 12.0)
    h.abort()
    h.handle(hs.Attest(joining=False), 13.0)
    h.handle(hs.Attested(10.0), 13.0)
    assert h.handle(hs.Request(REQUEST), 14.0) == hs.ImportBlob(BLOB)


def test_a_bug_in_a_handler_leaves_the_machine_in_error(monkeypatch) -> None:
    def broken(self, ev, now):
        raise RuntimeError("a bug")

    monkeypatch.setitem(OrchestratorTravel.HANDLERS, om.ScrubStarted, broken)
    o = orchestrator()
    o.handle(om.Start("alice", 0), 0.0)
    with pytest.raises(RuntimeError):
        o.handle(om.ScrubStarted(7), 0.1)
    assert o.phase is Phase.ERROR


def test_a_handler_that_disagrees_with_the_table_is_refused(monkeypatch) -> None:
    monkeypatch.setitem(OrchestratorTravel.HANDLERS, om.Start, lambda self, ev, now: (Phase.AWAY, None))
    o = orchestrator()
    with pytest.raises(IllegalTransition, match="go to away on Start"):
        o.handle(om.Start("alice", 0), 0.0)
    assert o.phase is Phase.ERROR


def test_the_phase_cannot_be_set_only_aborted() -> None:
    """A runtime moves a machine only by events, or back to idle by abort() (redteam/holder.py
    resets a travel it walked away from so): the phase itself is read-only."""
    h = holder()
    h.handle(hs.Attest(joining=True), 0.0)
    for phase in (HolderPhase.COPY, HolderPhase.IDLE):
        with pytest.raises(AttributeError):
            h.phase = phase
    assert h.phase is HolderPhase.ATTEST
    h.abort()
    assert h.phase is HolderPhase.IDLE and h.next_deadline() is None


# ============================================================================ abort
@pytest.mark.parametrize("which", MACHINES)
def test_abort_from_every_phase(which) -> None:
    make, phases, _, travel = MACHINES[which]
    aborted = set()
    for steps in range(len(travel()) + 1):
        m = make()
        for n, event in enumerate(travel()[:steps]):
            m.handle(event, float(n))
        aborted.add(m.phase)
        m.abort()
        assert m.phase is phases.IDLE and m.next_deadline() is None
        for n, event in enumerate(travel(2 if steps else 1)):  # and a whole travel goes through afterwards
            m.handle(event, 100.0 + n)
        assert m.phase is phases.IDLE
    m = make()
    with pytest.raises(IllegalTransition):
        m.handle(travel()[1], 0.0)  # out of order: the error phase
    aborted.add(m.phase)
    m.abort()
    assert m.phase is phases.IDLE
    assert aborted == set(phases)


# ============================================================================ deadlines
def test_orchestrator_deadlines_come_from_its_budgets_and_fire_on_timeout() -> None:
    o = orchestrator(om.Deadlines(device=2.0, holder=5.0))
    assert o.next_deadline() is None  # idle: nothing to wait for
    o.handle(om.Start("alice", 0), 10.0)
    assert o.next_deadline() == 12.0 and o.time_left(11.5) == 0.5  # submitting the scrub: the device's budget
    o.handle(om.ScrubStarted(7), 10.5)
    assert o.next_deadline() is None and o.time_left(10.5) is None  # exporting is local: no deadline
    for n, event in enumerate(O_TRAVEL[2:7]):
        o.handle(event, 11.0 + n)
    assert o.phase is Phase.AWAY and o.next_deadline() == 15.0 + 5.0  # the holder's budget
    assert o.on_timeout(19.9) is None and o.phase is Phase.AWAY  # before the deadline: nothing happens
    assert o.on_timeout(20.0) is None and o.phase is Phase.ERROR  # past it: the travel is given up
    assert o.next_deadline() is None


@pytest.mark.parametrize("phase, walk", [("attach", 5), ("audit", 6), ("grant", 7), ("copy", 8)])
def test_a_holder_step_past_its_deadline_is_a_refusal(phase: str, walk: int) -> None:
    h = holder(Deadlines(device=3.0, orchestrator=7.0))
    for event in H_TRAVEL[:walk]:
        h.handle(event, 0.0)
    assert h.phase.value == phase and h.next_deadline() == 3.0
    assert h.on_timeout(2.5) is None and h.phase.value == phase
    assert h.on_timeout(3.0) == hs.SwitchBack()  # the GPU and the context still go home
    assert h.handle(hs.SwitchAsked(), 3.0) == hs.ExportBlob()
    refused = h.handle(hs.Exported(b"\x02back"), 3.25).message
    assert isinstance(refused, TravelRefused) and refused.context == b"\x02back"
    assert f"PeerTimeout: the {phase} step took over 3 s" in refused.reason
    assert refused.reason.startswith("the GPU never came") == (phase == "attach")


@pytest.mark.parametrize("walk, budget", [(1, 7.0), (2, 7.0), (12, 3.0)], ids=["attest", "welcome", "homeward"])
def test_a_holder_wait_it_cannot_refuse_gives_up_past_its_deadline(walk: int, budget: float) -> None:
    h = holder(Deadlines(device=3.0, orchestrator=7.0))
    for event in H_TRAVEL[:walk]:
        h.handle(event, 100.0)
    assert h.next_deadline() == 100.0 + budget
    assert h.on_timeout(100.0 + budget) is None and h.phase is HolderPhase.ERROR


# ============================================================================ the shells
class Clock:
    """A fake clock: each read moves it on by a step (so every IO step takes ``step`` seconds)."""

    def __init__(self, step: float = 0.125) -> None:
        self.now, self.step = 1000.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


class FakeHolderLink:
    """The orchestrator's end of a holder's link: a real holder machine answers each request."""

    def __init__(self) -> None:
        self.h = holder(audit=False)
        self.h.handle(hs.Attest(joining=False), 0.0)
        self.h.handle(hs.Attested(1e9), 0.0)
        self.sent, self.timeouts, self.closed = [], [], False

    def send(self, msg) -> None:
        self.sent.append(msg)

    def recv(self, timeout, expect=None):
        self.timeouts.append(timeout)
        h, req = self.h, self.sent[-1]
        h.handle(hs.Request(req), 1.0)
        h.handle(hs.Imported(), 1.0)
        h.handle(hs.Attached(), 1.0)
        h.handle(hs.Granted(req.buffer_bytes), 1.0)
        h.handle(hs.Copied(min(req.buffer_bytes, len(DATASET) - req.dataset_offset)), 1.0)
        h.handle(hs.SwitchAsked(), 1.0)
        reply = h.handle(hs.Exported(req.context), 1.0).message
        h.handle(hs.Replied(), 1.0)
        h.handle(hs.SwitchedHome(), 1.0)
        return SimpleNamespace(message=reply)

    def close(self) -> None:
        self.closed = True


class Calls:
    """Records every method called on it; answers from ``answers`` (callables get the arguments).
    ``values``: plain attributes (a driver's ``epoch_fresh``, say)."""

    def __init__(self, values: dict | None = None, **answers) -> None:
        self.__dict__.update(values or {})
        self.calls, self._answers = [], answers

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            answer = self._answers.get(name)
            return answer(*args, **kwargs) if callable(answer) else answer
        return call


def orchestrator_shell(clock: Clock, **mux) -> Orchestrator:
    """The engine without a host, device or TLS: fakes record what it asks of them."""
    config = OrchestratorConfig(host_socket="", pki_dir="", layout=LAYOUT, buffer_bytes=BUFFER.nbytes,
                                device_timeout=2.0, holder_timeout=5.0)
    orch = Orchestrator(config, host=Calls(), device=Calls(), listener=Calls(), log_key=b"",
                        driver=Calls({"epoch_fresh": True, "epoch": 0, "rotating": False}, start_scrub=7,
                                     export_for_travel=BLOB),
                        mux=Calls(switch=SimpleNamespace(elapsed_ns=0), **mux))
    orch.travel_sm = orchestrator(om.Deadlines(device=2.0, holder=5.0))  # as boot leaves it, with alice enrolled
    vram = bytearray(BUFFER.offset + BUFFER.nbytes)
    vram[BUFFER.offset :] = DATASET[: BUFFER.nbytes]  # what the holder copied
    orch.vram, orch.holders = vram, {"alice": FakeHolderLink()}
    orch.attester = Calls(refresh=False, reattest_if_due=False)
    orch._clock = clock
    return orch


def test_the_orchestrator_shell_carries_out_every_action_in_the_machines_order(monkeypatch) -> None:
    assert set(Orchestrator.ACTIONS) == set(om.ACTIONS)
    done = []
    for action, step in list(Orchestrator.ACTIONS.items()):
        def spy(self, act, timeout, step=step):
            done.append((type(act), timeout))
            return step(self, act, timeout)
        monkeypatch.setitem(Orchestrator.ACTIONS, action, spy)
    orch = orchestrator_shell(Clock())
    report = orch.travel("alice", 0)
    assert report.chunk.digest == DIGEST and report.refused is None and orch.travel_sm.phase is Phase.IDLE
    assert [a for a, _ in done] == list(om.ACTIONS)  # no action dropped, none reordered
    # Each wait was given the machine's deadline, from the configured budgets; local steps none.
    assert dict(done) == {om.StartScrub: 2.0, om.ExportContext: None, om.AwaitScrub: 2.0, om.SwitchTo: None,
                          om.SendRequest: None, om.AwaitSwitch: 2.0, om.AwaitReply: 5.0, om.AwaitGpu: 2.0,
                          om.StartRotation: 2.0, om.ImportContext: None, om.AwaitRotation: 2.0,
                          om.VerifyChunk: None}
    assert orch.holders["alice"].timeouts == [5.0]
    names = [c[0] for c in orch.driver.calls]
    assert names == ["start_scrub", "export_for_travel", "finish_scrub", "start_rotation", "import_returned",
                     "finish_rotation"]
    assert report.steps_ms["o_export"] == 250.0  # the fake clock moves 125 ms a read: two reads after start


def test_the_orchestrator_shell_hands_a_timeout_to_the_machine_then_recovers(monkeypatch) -> None:
    clock = Clock()

    def attached(timeout):
        clock.now += timeout  # the wait ran its whole budget
        raise PeerTimeout("host did not answer in time (waiting for the GPU to be switched to us)")

    orch = orchestrator_shell(clock, attached=attached)
    seen = []
    real = OrchestratorTravel.on_timeout
    monkeypatch.setattr(OrchestratorTravel, "on_timeout", lambda self, now: seen.append(self.phase) or real(self, now))
    with pytest.raises(PeerTimeout, match="waiting for the GPU"):  # the host's own words go up
        orch.travel("alice", 0)
    assert seen == [Phase.HOMECOMING]
    assert orch.travel_sm.phase is Phase.IDLE  # aborted once the GPU was recovered
    assert ("switch", ("orchestrator", 2.0), {}) in orch.mux.calls  # recovery: the GPU taken back
    assert "rotate" in [c[0] for c in orch.driver.calls]  # and rotated


def holder_shell(clock: Clock, monkeypatch, link: Calls | None = None, **mux) -> holder_cvm.DataHolder:
    """The holder without a host, device or TLS: fakes record what it asks of them. ``link``:
    the orchestrator's end as a join connects it (by default one that welcomes the holder)."""
    link = link if link is not None else Calls(recv=SimpleNamespace(message=Welcome("orchestrator")))
    config = holder_cvm.HolderConfig(name="alice", dataset_path="", host_socket="", pki_dir="pki", layout=LAYOUT,
                                     device_timeout=3.0, orchestrator_timeout=7.0, audit_arrival=True,
                                     trust_dir="trust")
    h = holder_cvm.DataHolder(
        config, dataset=SimpleNamespace(view=memoryview(DATASET), size=len(DATASET), tokenizer="", schema=None,
                                        train_records=0, eval_records=0, held_base=0), host=Calls(),
        driver=Calls(copy_from_vram=lambda off, n, timeout: bytes(n),
                     query_buffer=SimpleNamespace(nbytes=BUFFER.nbytes), export_context=b"\x02back"),
        mux=Calls(**mux), log_key=bytes(32), connect=lambda host, port: link,
        policy=lambda: SimpleNamespace(policy=SimpleNamespace(max_evidence_age_s=600)),
        challenge=lambda conn, material, timeout: ("attested", timeout))
    assert h.piece_bytes == PIECE and h.sm.manifest == holder(Deadlines(3.0, 7.0), audit=True).manifest
    h.probed, h._clock = True, clock
    return h


def test_the_holder_shell_carries_out_every_action_in_the_machines_order(monkeypatch) -> None:
    assert set(holder_cvm.DataHolder.ACTIONS) == set(hs.ACTIONS)
    done = []
    for action, step in list(holder_cvm.DataHolder.ACTIONS.items()):
        def spy(self, act, timeout, step=step):
            done.append((type(act), timeout))
            return step(self, act, timeout)
        monkeypatch.setitem(holder_cvm.DataHolder.ACTIONS, action, spy)
    h = holder_shell(Clock(), monkeypatch)
    assert h.join("127.0.0.1", 4433) == ("attested", 7.0)  # the attestation exchange had the machine's deadline
    h.serve_travel(REQUEST)
    h.reattest()
    order = [a for a, _ in done]
    assert order == [hs.Challenge, hs.Introduce, hs.ImportBlob, hs.AwaitGpu, hs.AuditArrival, hs.CheckBuffer,
                     hs.CopyChunk, hs.SwitchBack, hs.ExportBlob, hs.Reply, hs.AwaitSwitchHome, hs.Challenge]
    assert set(order) == set(hs.ACTIONS)  # no action dropped
    assert dict(done)[hs.AwaitGpu] == 3.0 and dict(done)[hs.Introduce] == 7.0 and dict(done)[hs.ImportBlob] is None
    sent = [c[1][0] for c in h.orchestrator.calls if c[0] == "send"]
    result = sent[-1]
    assert isinstance(result, TravelResult) and result.chunk.digest == DIGEST and result.context == b"\x02back"
    assert result.nonzero_on_arrival == 0
    assert [c[0] for c in h.mux.calls] == ["attached", "request", "switched"]
    assert h.sm.phase is HolderPhase.IDLE


def test_the_holder_shell_refuses_a_travel_whose_gpu_never_comes_in_time(monkeypatch) -> None:
    clock = Clock()

    def attached(timeout):
        clock.now += timeout
        raise PeerTimeout("host did not answer in time (waiting for the GPU to be switched to us)")

    h = holder_shell(clock, monkeypatch, attached=attached)
    h.join("127.0.0.1", 4433)
    h.serve_travel(REQUEST)
    refused = [c[1][0] for c in h.orchestrator.calls if c[0] == "send"][-1]
    assert isinstance(refused, TravelRefused) and refused.context == b"\x02back"  # imported, so exported again
    assert refused.reason == "the GPU never came: PeerTimeout: the attach step took over 3 s"
    assert [c[0] for c in h.mux.calls] == ["attached", "request", "switched"]  # and the GPU still went home
    assert h.sm.phase is HolderPhase.IDLE


def test_the_holder_shell_refuses_a_failed_copy_with_the_error_it_got(monkeypatch) -> None:
    h = holder_shell(Clock(), monkeypatch)
    h.join("127.0.0.1", 4433)

    def faulted(*args, **kwargs):
        raise ProtocolError("user channel faulted")

    h.driver._answers["copy_to_vram"] = faulted
    h.serve_travel(REQUEST)
    refused = [c[1][0] for c in h.orchestrator.calls if c[0] == "send"][-1]
    assert isinstance(refused, TravelRefused) and refused.reason == "ProtocolError: user channel faulted"
    assert h.sm.phase is HolderPhase.IDLE


def test_a_failed_join_leaves_the_holder_out_and_idle(monkeypatch) -> None:
    link = Calls(recv=SimpleNamespace(message=Bye(reason="not today")))
    h = holder_shell(Clock(), monkeypatch, link)
    with pytest.raises(ProtocolError, match="did not welcome us: not today"):
        h.join("127.0.0.1", 4433)
    assert h.orchestrator is None and h.sm.phase is HolderPhase.IDLE and ("close", (), {}) in link.calls
