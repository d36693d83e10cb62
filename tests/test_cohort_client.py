"""The cohort's client, against parties played over socket pairs (no process): a holder's
refusal ends a join at once, and the orchestrator's late answer never answers a later command."""

from __future__ import annotations

import socket

import pytest

from gputravel.errors import RemoteError
from gputravel.cohort.client import CohortClient
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.protocol.control import (AwaitHolders, Departed, DoTravel, Failed, Holders, JoinCohort, Joined, Leave, Left,
                                        TravelReport)
from gputravel.transport.stream import StreamTransport


class Parties:
    """Each party's control link, the client's end; `far[name]` is the party's end."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.near: dict[str, StreamTransport] = {}
        self.far: dict[str, StreamTransport] = {}
        for name in names:
            a, b = socket.socketpair()
            self.near[name], self.far[name] = StreamTransport(a, name), StreamTransport(b, name)

    def control(self, name: str) -> StreamTransport:
        return self.near[name]

    def log_tail(self, name: str) -> str:
        return ""

    def join_address(self) -> tuple[str, int]:
        return "127.0.0.1", 1


def test_a_refused_join_ends_at_once_and_the_late_answer_is_read_before_the_next_command(tmp_path) -> None:
    (tmp_path / "h1").write_bytes(b"x" * 4096)
    parties = Parties(("orchestrator", "h1"))
    client = CohortClient(CohortConfig(holders=(HolderSpec("h1", str(tmp_path / "h1")),), buffer_bytes=1 << 20,
                                       boot_timeout=30.0), parties)
    parties.far["h1"].send(Failed(kind="AttestationError", reason="claim measurement: not pinned"))
    with pytest.raises(RemoteError, match="h1 did not join"):
        client.join(("h1",))  # not the 30 s the orchestrator waits for a holder that never comes
    assert isinstance(parties.far["h1"].recv(timeout=1).message, JoinCohort)
    assert isinstance(parties.far["orchestrator"].recv(timeout=1).message, AwaitHolders)
    # The orchestrator answers the join late, then the travel: the travel gets the travel's answer.
    parties.far["orchestrator"].send(Holders(dataset_bytes={}))
    report = TravelReport(travel_id=1, holder="h1", chunk=None, steps_ms={}, total_ms=0.0, verify_ms=0.0,
                          refused="no", nonzero_on_arrival=-1)
    parties.far["orchestrator"].send(report)
    assert client.travel("h1") == report
    assert isinstance(parties.far["orchestrator"].recv(timeout=1).message, DoTravel)


def test_after_a_refused_join_each_party_answers_its_own_next_command(tmp_path) -> None:
    """h1 refuses at once; h2 joins meanwhile and says so late: its Joined, left on its link,
    answered the next command sent to h2 (the re-read of the change: "h2 sent Joined instead of
    Left"). Every party's late answer is read, and dropped, before its next command."""
    for n in ("h1", "h2"):
        (tmp_path / n).write_bytes(b"x" * 4096)
    parties = Parties(("orchestrator", "h1", "h2"))
    config = CohortConfig(holders=tuple(HolderSpec(n, str(tmp_path / n)) for n in ("h1", "h2")),
                          buffer_bytes=1 << 20, boot_timeout=30.0)
    client = CohortClient(config, parties)
    parties.far["h1"].send(Failed(kind="AttestationError", reason="claim measurement: not pinned"))
    with pytest.raises(RemoteError, match="h1 did not join"):
        client.join(("h1", "h2"))
    parties.far["h2"].send(Joined(holder="h2", measurement=b"m", gpu_serial="GPU-EMU-0", gpu_verified_at=0))  # late
    parties.far["h2"].send(Left(holder="h2"))  # the answer to the Leave below
    parties.far["orchestrator"].send(Holders(dataset_bytes={"h2": 4096}))  # the join's, late
    parties.far["orchestrator"].send(Departed(holder="h2", reason="left"))
    client.leave("h2")
    assert isinstance(parties.far["h2"].recv(timeout=1).message, JoinCohort)
    assert isinstance(parties.far["h2"].recv(timeout=1).message, Leave)
