"""The orchestrator's engine while it trains (orchestrator/process.py Admitting): between
travels it admits at most one waiting holder per travel and reads goodbyes, so a stream of
connections delays each travel by one handshake at most and never starves the travels."""

from __future__ import annotations

import socket
from types import SimpleNamespace

from gputravel.errors import PeerTimeout
from gputravel.orchestrator.process import Admitting
from gputravel.protocol.travel import Bye
from gputravel.transport.stream import StreamTransport


class _Listener:
    """`waiting` connections at once (joiners, or strangers that stall): readable until each
    was taken."""

    def __init__(self, waiting: int) -> None:
        self._r, self._w = socket.socketpair()
        self._w.send(b"x" * waiting)

    def fileno(self) -> int:
        return self._r.fileno()

    def take(self) -> None:
        self._r.recv(1)


class _Orchestrator:
    def __init__(self, fail: bool) -> None:
        self.listener, self.fail = _Listener(3), fail
        self.holders: dict[str, StreamTransport] = {}
        self.config = SimpleNamespace(holder_timeout=0.1)
        self.accepted = self.travels = 0
        self.dropped: list[str] = []
        self.travel_sm = SimpleNamespace(holders={})

    def accept_holder(self, timeout: float, probe) -> str:
        self.accepted += 1
        self.listener.take()
        if self.fail:
            raise PeerTimeout("a stranger that never finished its handshake")
        return f"late-{self.accepted}"

    def travel(self, holder: str, offset: int) -> str:
        self.travels += 1
        return f"travelled to {holder}"

    def drop(self, name: str) -> None:
        self.dropped.append(name)
        del self.holders[name]


def test_one_admission_per_travel_however_many_wait_and_travels_go_on():
    for fail in (False, True):
        orch = _Orchestrator(fail)
        engine = Admitting(orch, SimpleNamespace(probe_over=None))
        for k in range(5):
            assert engine.travel("north", k) == "travelled to north"
            assert orch.accepted == min(k + 1, 3)  # three waited: one before each travel, never more
        assert orch.travels == 5


def test_a_holder_that_says_goodbye_between_travels_is_dropped():
    orch = _Orchestrator(fail=True)
    mine, theirs = socket.socketpair()
    orch.holders["south"] = StreamTransport(mine, "south")
    StreamTransport(theirs, "orchestrator").send(Bye(reason="leaving the cohort"))
    Admitting(orch, SimpleNamespace(probe_over=None)).travel("north", 0)
    assert orch.dropped == ["south"] and "south" not in orch.holders


def _hello(dataset_bytes: int, eval_records: int) -> SimpleNamespace:
    return SimpleNamespace(dataset_bytes=dataset_bytes, piece_bytes=4096, manifest=(b"m",), tokenizer="", schema="{}",
                           train_records=10, eval_records=eval_records)


def test_a_holder_that_rejoins_with_another_dataset_or_split_is_left_out_of_the_job():
    """The loader cut each holder's data by its hello at the job's start: read with the old cut, a
    new split would hand held-out records to training (the hostile review of issue 27)."""
    for then, now, kept in ((_hello(8192, 2), _hello(8192, 2), True), (_hello(8192, 2), _hello(8192, 3), False),
                            (_hello(8192, 2), _hello(12288, 2), False)):
        orch = _Orchestrator(fail=False)
        orch.travel_sm.holders["late-1"] = then
        engine = Admitting(orch, SimpleNamespace(probe_over=None))

        def rejoin(timeout: float, probe, orch=orch, now=now) -> str:
            orch.listener.take()
            orch.travel_sm.holders["late-1"] = now  # enrolled anew: its hello replaced
            orch.holders["late-1"] = SimpleNamespace(fileno=lambda: -1)
            return "late-1"

        orch.accept_holder = rejoin  # type: ignore[method-assign]
        engine.travel("north", 0)
        assert ("late-1" in orch.holders) == kept and (orch.dropped == []) == kept


def test_before_kept_records_train_again_goodbyes_are_read_and_nobody_is_admitted():
    """A kept visit asks TravelSource.departed, which reads goodbyes only: admitting a holder there
    would lend it the GPU between travels, which only a travel may (docs/security.md row 75)."""
    from gputravel.train.loader import TravelSource

    orch = _Orchestrator(fail=False)  # three connections wait on its listener
    mine, theirs = socket.socketpair()
    orch.holders["south"] = StreamTransport(mine, "south")
    north, still_here = socket.socketpair()  # its other end open: north says nothing
    orch.holders["north"] = StreamTransport(north, "north")
    StreamTransport(theirs, "orchestrator").send(Bye(reason="leaving the cohort"))
    engine = Admitting(orch, SimpleNamespace(probe_over=None))
    source = TravelSource(engine, {"south": 4096, "north": 4096})
    assert source.departed(["south", "north"]) == {"south"}
    assert orch.dropped == ["south"] and orch.accepted == 0 and orch.travels == 0
    still_here.close()


def test_the_baseline_reads_goodbyes_before_its_copy_and_admits_nobody():
    """The hostile review of the DP departure fix: built on the bare orchestrator, the TLS baseline's
    loader never read a goodbye waiting, so a DP job trained on a holder that had left (row 75)."""
    from gputravel.train.loader import BaselineSource

    orch = _Orchestrator(fail=False)  # three connections wait on its listener
    orch.baseline = lambda holder, offset: f"copied from {holder}"  # type: ignore[attr-defined]
    mine, theirs = socket.socketpair()
    orch.holders["south"] = StreamTransport(mine, "south")
    StreamTransport(theirs, "orchestrator").send(Bye(reason="leaving the cohort"))
    source = BaselineSource(Admitting(orch, SimpleNamespace(probe_over=None)), {"north": 4096})
    assert source.engine.baseline("north", 0) == "copied from north"
    assert orch.dropped == ["south"] and orch.accepted == 0 and orch.travels == 0
