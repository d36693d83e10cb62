"""The orchestrator shell when a travel goes wrong (orchestrator/cvm.py, paper Fig. 3 and 6.3).

tests/test_travel_machines.py shows that the shell carries out the travel machine's actions in
the machine's order. This file shows what the shell leaves behind when a travel fails, and
that a data holder cannot make it report a travel that did not happen. The real shell
(``Orchestrator.travel``, dispatching through ``Orchestrator.ACTIONS``, recovering through
``_recover``) drives the real OrchestratorDriver, device core and data-holder drivers
(gputravel.testing.InProcessGpu); only the PCIe MUX and the TLS links to the data holders are
fakes, and one data holder, mallory, misbehaves as each test chooses.

- A fault is injected at every action the machine returns, before or after the shell carries
  it out: IO errors (PeerTimeout, TransportClosed, ChannelFaulted), a protocol error, a
  refused context blob, and two bugs (RuntimeError, KeyError).
- Mallory replies early without touching the GPU, replies to the next travel id, returns an
  old context blob, never replies, replies twice, or twice with the next id; each three times
  on the same link, so a reply she queued is read by the next travel.

After every travel, failed or reported:

  I1  the travel machine is idle, the context blob is home, no rotation is pending, and the GPU
      is on a fresh key epoch: the orchestrator rotated (or re-keyed), so whatever a data
      holder kept is useless;
  I2  no (session, epoch) was exported twice, nor reached two data holders;
  I3  no travel request left before its scrub was confirmed, nor with anything but zeros in
      the dataset buffer;
  I4  a travel reported done was rotated and verified: VRAM holds the data holder's chunk;
  I5  the next honest travel works (the cohort recovered, not just "no exception").

Why here: the machine's own tests cannot see the driver's ledger, the scrub or the rotation,
and the epoch property test (test_epoch_invariants.py) mirrors the shell rather than running
it; these are the shell's promises. The whole file runs in about a second.
"""

from __future__ import annotations

import time
from collections import deque
from types import SimpleNamespace

import pytest

from gputravel.errors import ChannelFaulted, ContextBlobError, PeerTimeout, ProtocolError, TransportClosed
from gputravel.orchestrator import machine as om
from gputravel.orchestrator.cvm import Orchestrator, OrchestratorConfig
from gputravel.orchestrator.machine import Buffer, Deadlines, OrchestratorTravel, Phase
from gputravel.protocol.control import TravelReport
from gputravel.protocol.manifest import chunk_digest_from_manifest, piece_digests
from gputravel.protocol.travel import ChunkInfo, HolderHello, TravelRefused, TravelResult
from gputravel.testing import ORCHESTRATOR, TEST_LAYOUT, InProcessGpu

PIECE = TEST_LAYOUT.record_bytes
BUFFER = 2 * PIECE
DATASETS = {"alice": bytes([1]) * (4 * PIECE), "mallory": bytes([2]) * (4 * PIECE)}
DEVICE_S, HOLDER_S = 2.0, 5.0

# Each kind of fault, made afresh for each injection (an exception raised twice keeps its traceback).
FAULTS = (
    lambda: PeerTimeout("injected"),
    lambda: ProtocolError("injected"),
    lambda: ContextBlobError("injected"),
    lambda: TransportClosed("injected"),
    lambda: ChannelFaulted("injected"),
    lambda: RuntimeError("injected bug"),
    lambda: KeyError("injected bug"),
)


class Mux:
    """The host's PCIe MUX: switches the in-process GPU at once."""

    def __init__(self, gpu: InProcessGpu) -> None:
        self.gpu, self.asked = gpu, None

    def switch(self, target, timeout):
        self.gpu.switch(target)
        return SimpleNamespace(elapsed_ns=0)

    def request(self, target) -> None:
        self.asked = target

    def switched(self, timeout) -> None:
        self.gpu.switch(self.asked)

    def attached(self, timeout) -> None:
        pass  # the data holder's side switched the GPU home before it replied


class HolderLink:
    """The orchestrator's TLS link to a data holder; a real holder driver does the work.

    The travel request is served when the orchestrator waits for the reply (the GPU is the
    data holder's by then); replies queue up, so a second reply is read by the next travel.
    """

    def __init__(self, cohort: Cohort, name: str, behaviour: str = "honest") -> None:
        self.cohort, self.name, self.behaviour = cohort, name, behaviour
        self.replies: deque = deque()
        self.request = None
        self.closed = False

    def send(self, request) -> None:
        self.cohort.request_left(self.name, request)
        self.request = request

    def recv(self, timeout=None, expect=None):
        request, self.request = self.request, None
        if request is not None:
            self._serve(request)
        if not self.replies:
            raise PeerTimeout(f"{self.name}: no reply within {timeout}")
        return SimpleNamespace(message=self.replies.popleft())

    def close(self) -> None:
        self.closed = True

    def _serve(self, req) -> None:
        cohort, b = self.cohort, self.behaviour
        chunk = cohort.chunk_info(self.name, req.dataset_offset)
        steps = {"handler": 0}
        if b in ("early-untouched", "next-id"):  # a reply at once; the GPU is never touched
            travel_id = req.travel_id + (b == "next-id")
            self.replies.append(TravelResult(travel_id, req.context, chunk, steps, -1))
        elif b == "old-blob":  # refuses the travel, returning a context blob of an earlier one
            old = cohort.blobs_sent[self.name][-2]
            self.replies.append(TravelRefused(req.travel_id, old, "refused", steps))
        elif b != "never":
            back = cohort.copy_chunk(self.name, req)
            self.replies.append(TravelResult(req.travel_id, back, chunk, steps, -1))
            if b in ("double", "double-next"):
                self.replies.append(TravelResult(req.travel_id + (b == "double-next"), back, chunk, steps, -1))
        cohort.gpu.switch(ORCHESTRATOR)


class StepClock:
    """The orchestrator's clock: each read moves it 1 ms (every step takes time; no deadline is reached)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now


class Cohort:
    """An orchestrator and two data holders on one in-process GPU, with what the checks need:
    every export (session, epoch), who each epoch reached, and each travel request's departure."""

    def __init__(self) -> None:
        self.gpu = gpu = InProcessGpu(vram_bytes=8 << 20)
        self.holders = {name: gpu.holder(name) for name in DATASETS}  # data holders boot first
        self.driver = driver = gpu.orchestrator()
        self.buffer = driver.alloc_dataset_buffer(BUFFER)
        self.manifests = {name: piece_digests(data, PIECE) for name, data in DATASETS.items()}
        self.exports: list[tuple[int, int]] = []
        self.reached: dict[tuple[int, int], set[str]] = {}
        self.blobs_sent: dict[str, list[bytes]] = {name: [] for name in DATASETS}
        self.early: list[str] = []  # I3 breaches, seen as each request left
        self.scrubbed = False  # the scrub of the travel under way was confirmed
        self._spy_on_driver()
        self.orchestrator = self._shell()

    def _spy_on_driver(self) -> None:
        driver, export, finish_scrub = self.driver, self.driver.ledger.export, self.driver.finish_scrub

        def exported() -> int:
            epoch = export()
            self.exports.append((driver.ledger.session, epoch))
            self.scrubbed = False
            return epoch

        def scrub_confirmed(value, timeout=10.0):
            blob = finish_scrub(value, timeout)
            self.scrubbed = True
            return blob

        driver.ledger.export, driver.finish_scrub = exported, scrub_confirmed

    def _shell(self) -> Orchestrator:
        # The engine on the in-process GPU: its driver and MUX are the cohort's, and nothing
        # else (host, device link, listener) is used by travel(); boot's state is given here.
        config = OrchestratorConfig(host_socket="", pki_dir="", layout=TEST_LAYOUT, buffer_bytes=BUFFER,
                                    device_timeout=DEVICE_S, holder_timeout=HOLDER_S, verify=True)
        o = Orchestrator(config, host=None, driver=self.driver, mux=Mux(self.gpu), device=None, listener=None,
                         log_key=b"")
        o.vram = self.gpu.vram
        o.attester = SimpleNamespace(refresh=lambda *a: False, reattest_if_due=lambda *a: False,
                                     open_session=lambda driver, now, timeout: driver.establish_session())
        o._clock = StepClock()
        o.travel_sm = OrchestratorTravel(Buffer(self.buffer.offset, self.buffer.nbytes),
                                         Deadlines(DEVICE_S, HOLDER_S), verify=True)
        for name, data in DATASETS.items():
            o.travel_sm.enrol(HolderHello(name, len(data), PIECE, self.manifests[name], "", "", 0, 0, True, bytes(32)))
        o.holders = {name: HolderLink(self, name) for name in DATASETS}
        return o

    # ------------------------------------------------------------------ what the fakes need
    def connect(self, name: str, behaviour: str = "honest") -> HolderLink:
        link = self.orchestrator.holders[name] = HolderLink(self, name, behaviour)
        return link

    def chunk_info(self, name: str, offset: int) -> ChunkInfo:
        nbytes = min(BUFFER, len(DATASETS[name]) - offset)
        return ChunkInfo(offset, nbytes, chunk_digest_from_manifest(self.manifests[name], offset, nbytes, PIECE))

    def copy_chunk(self, name: str, req) -> bytes:
        """What an honest data holder does with the GPU: import, copy its chunk, export."""
        holder = self.holders[name]
        data = DATASETS[name][req.dataset_offset : req.dataset_offset + req.buffer_bytes]
        holder.import_context(req.context)
        holder.copy_to_vram(memoryview(data), req.buffer_offset, buffer_bytes=req.buffer_bytes)
        return holder.export_context()

    def request_left(self, name: str, request) -> None:
        """A travel request leaves for a data holder: note whom its epoch reached, and whether
        its scrub was confirmed (no assertion here: the shell would catch and recover it)."""
        ledger = self.driver.ledger
        self.reached.setdefault((ledger.session, ledger.epoch), set()).add(name)
        self.blobs_sent[name].append(request.context)
        if not self.scrubbed:
            self.early.append(f"to {name} before its scrub was confirmed")
        if any(self.vram_buffer()):
            self.early.append(f"to {name} with the dataset buffer not scrubbed")
        self.scrubbed = False

    def vram_buffer(self) -> bytes:
        return self.gpu.vram_at(self.buffer.offset, self.buffer.nbytes)

    # ------------------------------------------------------------------ travels and checks
    def travel(self, name: str) -> tuple[str, TravelReport | None]:
        """One travel from the start of ``name``'s dataset: ("reported", report) or (error, None)."""
        try:
            return "reported", self.orchestrator.travel(name, 0)
        except Exception as exc:  # a fault, a misbehaving data holder or an injected bug
            return type(exc).__name__, None

    def check(self, label: str, report: TravelReport | None = None) -> None:
        o, driver, ledger = self.orchestrator, self.driver, self.driver.ledger
        assert o.travel_sm.phase is Phase.IDLE, f"I1 ({label}): travel machine left in {o.travel_sm.phase}"
        assert not driver.away, f"I1 ({label}): the context blob is not home"
        assert not driver.rotating, f"I1 ({label}): a rotation is still pending"
        assert ledger.fresh, f"I1 ({label}): epoch {ledger.epoch} not fresh ({ledger.use}, halted={ledger.halted})"
        twice = sorted({e for e in self.exports if self.exports.count(e) > 1})
        assert not twice, f"I2 ({label}): (session, epoch) exported twice: {twice}"
        shared = {e: who for e, who in self.reached.items() if len(who) > 1}
        assert not shared, f"I2 ({label}): an epoch reached two data holders: {shared}"
        assert not self.early, f"I3 ({label}): a travel request left {self.early}"
        if report is not None:
            self.check_done(label, report)

    def check_done(self, label: str, report: TravelReport) -> None:
        ledger = self.driver.ledger
        assert (ledger.session, ledger.epoch) > self.exports[-1], \
            f"I4 ({label}): travel {report.travel_id} reported without a rotation after its export"
        if report.refused is None:
            want = DATASETS[report.holder][:BUFFER]
            assert report.chunk is not None and report.verify_ms > 0, \
                f"I4 ({label}): travel {report.travel_id} reported done without its VRAM verified"
            assert self.vram_buffer() == want, \
                f"I4 ({label}): travel {report.travel_id} reported done but VRAM does not hold the chunk"

    def honest_travel(self, label: str) -> None:
        """I5: after whatever happened, alice's next travel is reported done, and checks out."""
        self.connect("alice")
        outcome, report = self.travel("alice")
        assert outcome == "reported" and report.refused is None, f"I5 ({label}): the next honest travel: {outcome}"
        self.check(f"{label}, then alice", report)


@pytest.fixture
def cohort() -> Cohort:
    return Cohort()


# ============================================================================ faults at every action
@pytest.mark.parametrize("mode", ["before", "after"])
@pytest.mark.parametrize("action", om.ACTIONS, ids=lambda a: a.__name__)
def test_a_fault_at_any_action_leaves_the_gpu_recovered(cohort: Cohort, action: type, mode: str,
                                                        monkeypatch) -> None:
    """Each kind of fault in turn, on one cohort (what one fault left behind meets the next):
    the shell recovers the GPU before the fault goes on up, and alice's next travel works."""
    assert set(Orchestrator.ACTIONS) == set(om.ACTIONS)  # every action the machine returns is covered
    step = Orchestrator.ACTIONS[action]
    for make in FAULTS:
        fault = make()
        label = f"{type(fault).__name__} {mode} {action.__name__}"

        def faulty(self, act, timeout, fault=fault):
            if mode == "after":
                step(self, act, timeout)
            raise fault

        with monkeypatch.context() as m:
            m.setitem(Orchestrator.ACTIONS, action, faulty)
            outcome, report = cohort.travel("mallory")
        assert outcome == type(fault).__name__, \
            f"fault ({label}): the injected fault was swallowed or replaced: the travel ended {outcome}"
        cohort.check(label, report)
        if "mallory" not in cohort.orchestrator.holders:  # dropped: she joins again
            cohort.connect("mallory")
        cohort.honest_travel(label)


# ============================================================================ a misbehaving data holder
# What each of mallory's travels may end with, on the same link three times. A reply the
# machine refuses (another travel's id) drops her, since her link is out of step: after a
# second reply her next travel reads the stale one and fails, and she joins again afresh.
LATER = ("reported", "ProtocolError")
DROPPED_ON_REFUSED_REPLY = ("next-id", "double", "double-next")
MALLORY = {
    "early-untouched": [("ProtocolError",)] * 3,  # the verification finds the buffer scrubbed, not her chunk
    "next-id": [("ProtocolError",)] * 3,
    "old-blob": [("ContextRefused",)] * 3,
    "never": [("HolderLost",)] * 3,
    "double": [("reported",), LATER, LATER],
    "double-next": [("reported",), LATER, LATER],
    "honest": [("reported",)] * 3,
}


def broken(outcome: str, behaviour: str) -> str:
    """Which promise an unexpected outcome breaks: a travel she faked reported done (I4), an
    honest travel that failed (I5), or a refusal that names the wrong cause."""
    if outcome == "reported":
        return "I4"
    return "I5" if behaviour == "honest" else "refusal"


@pytest.mark.parametrize("behaviour", MALLORY)
def test_a_misbehaving_data_holder_cannot_fake_a_travel(cohort: Cohort, behaviour: str) -> None:
    """Mallory travels once honestly, then three times misbehaving on the same link (joining
    again when dropped); each travel, and alice's after it, keeps I1-I5."""
    outcome, report = cohort.travel("mallory")  # once honest: she has a context blob to return later
    assert outcome == "reported", f"I5 (mallory's first, honest travel): {outcome}"
    cohort.check("mallory's first, honest travel", report)
    link = cohort.connect("mallory", behaviour)
    for n, allowed in enumerate(MALLORY[behaviour]):
        label = f"mallory {behaviour} #{n}"
        if cohort.orchestrator.holders.get("mallory") is not link:  # dropped: she joins again, as before
            link = cohort.connect("mallory", behaviour)
        outcome, report = cohort.travel("mallory")
        assert outcome in allowed, f"{broken(outcome, behaviour)} ({label}): the travel ended {outcome}, not {allowed}"
        if outcome == "ProtocolError" and behaviour in DROPPED_ON_REFUSED_REPLY:
            assert "mallory" not in cohort.orchestrator.holders, f"refusal ({label}): an out-of-step link was kept"
        cohort.check(label, report)
        cohort.honest_travel(label)


# ============================================================================ waiting for holders
def _waiting_shell(joins: list) -> Orchestrator:
    """A bare shell whose accept_holder plays `joins` in turn: an exception to raise, or the
    name of a holder that joins."""
    o = Orchestrator(OrchestratorConfig(host_socket="", pki_dir="", layout=TEST_LAYOUT, buffer_bytes=BUFFER),
                     host=None, driver=None, mux=None, device=None, listener=None, log_key=b"")
    o.travel_sm = SimpleNamespace(holders={})

    def accept_holder(timeout, probe=None):
        step = joins.pop(0)
        if isinstance(step, Exception):
            raise step
        o.holders[step] = object()
        o.travel_sm.holders[step] = SimpleNamespace(dataset_bytes=len(step))
        return step

    o.accept_holder = accept_holder
    return o


def test_a_holder_whose_connection_breaks_off_mid_join_does_not_stop_the_wait() -> None:
    """Seen in the services' restart test: north's CVM went away while it joined a restarted
    orchestrator ('tls:north: peer closed'), and the whole wait for holders failed, though
    north's service was already booting another CVM to join again."""
    o = _waiting_shell(["south", TransportClosed("tls:north: peer closed"), "north"])
    assert o.await_holders(("north", "south"), timeout=5) == {"south": 5, "north": 5}


def test_a_refusal_still_stops_the_wait_and_a_timeout_says_what_broke_off() -> None:
    with pytest.raises(ProtocolError):
        _waiting_shell([ProtocolError("holder 'x' did not introduce itself correctly")]).await_holders(("x",), 5)
    o = _waiting_shell([TransportClosed("tls:north: peer closed")] + [PeerTimeout("no one came")] * 3)
    o.accept_holder = lambda timeout, probe=None, play=o.accept_holder: (time.sleep(0.05), play(timeout))[1]
    with pytest.raises(PeerTimeout, match=r"north \(the last connection that broke off: tls:north: peer closed\)"):
        o.await_holders(("north",), timeout=0.1)


# ============================================================================ opening the CVM's links
@pytest.mark.parametrize("failing", ["registration", "listener", "buffer"])
def test_from_config_closes_what_it_opened_when_a_later_step_fails(tmp_path, monkeypatch, failing: str) -> None:
    from gputravel.crypto.pki import CohortPki
    from gputravel.errors import BadInput
    from gputravel.orchestrator import cvm

    CohortPki.create(tmp_path / "pki", [ORCHESTRATOR])
    closed: list[str] = []
    host, link, listener = (SimpleNamespace(close=lambda name=name: closed.append(name))
                            for name in ("host", "link", "listener"))

    def fail(*args, **kwargs):
        raise ProtocolError(f"injected: {failing}")

    monkeypatch.setattr(cvm, "connect_unix", lambda path, name: host)
    monkeypatch.setattr(cvm, "register_with_host", fail if failing == "registration" else lambda *a: link)
    monkeypatch.setattr(cvm, "TlsListener", fail if failing == "listener" else lambda *a: listener)
    monkeypatch.setattr(cvm, "OrchestratorDriver", lambda link: SimpleNamespace(link=link))
    monkeypatch.setattr(cvm, "StreamTransport", lambda sock, name: SimpleNamespace(name=name))
    config = OrchestratorConfig(host_socket="host.sock", pki_dir=str(tmp_path / "pki"), layout=TEST_LAYOUT,
                                buffer_bytes=BUFFER + (1 if failing == "buffer" else 0))
    with pytest.raises(BadInput if failing == "buffer" else ProtocolError):
        Orchestrator.from_config(config, device_link=None)
    assert closed == {"registration": ["host"], "listener": ["link", "host"], "buffer": ["listener", "link", "host"]}[failing]
