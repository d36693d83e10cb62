"""The client of a running cohort: it sends the orchestrator and the holders commands over their
control links and reads their replies; a Failed one comes back as the typed error it names.
"""

from __future__ import annotations

import json
import selectors
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gputravel import errors
from gputravel.cohort.config import CohortConfig
from gputravel.attest.material import attestation_error_from
from gputravel.errors import GputravelError, PeerTimeout, ProtocolError, RemoteError, Terminated, TransportClosed
from gputravel.protocol.parties import ORCHESTRATOR
from gputravel.protocol.control import (
    AwaitDeparture, AwaitHolders, BaselineReport, DoBaseline, DoTravel, Failed, Holders, JoinCohort, Joined, Leave,
    Left, LendGpu, ProbeGpu, Probed, ReclaimGpu, Train, TrainDone, TrainStep, TravelReport,
)
from gputravel.transport.stream import StreamTransport


@dataclass(frozen=True)
class RankPlace:
    """An orchestrator's place in a data-parallel job (`context`: what the ranks' pair keys bind to)."""

    rank: int = 0
    world_size: int = 1
    master: str = ""
    ifname: str = ""  # the interface the ranks reach one another on (a server's link); "": any
    shares: tuple[tuple[str, ...], ...] = ()  # every rank's holders, by rank
    context: bytes = b""


class Parties(Protocol):
    """What the client needs of the supervisor (it starts and stops nothing itself)."""

    def control(self, name: str) -> StreamTransport: ...

    def log_tail(self, name: str) -> str: ...

    def join_address(self) -> tuple[str, int]: ...


class CohortClient:
    def __init__(self, config: CohortConfig, parties: Parties) -> None:
        self.config = config
        self.parties = parties
        self.dataset_bytes: dict[str, int] = {}  # of every holder that joined and has not left
        self.attestations: dict[str, Joined] = {}  # what each holder verified when it last joined
        # Answers each link still owes: one given up on (a refused join, a timeout) is read and
        # dropped before its party's next command (`_settle`). A restarted party's new link owes none.
        self._owed: dict[StreamTransport, int] = {}

    # ------------------------------------------------------------------ membership
    def join(self, names: tuple[str, ...]) -> dict[str, int]:
        """Holders attest the orchestrator and join; each joined holder's dataset size."""
        timeout = self.config.boot_timeout
        host, port = self.parties.join_address()
        for name in names:
            self._send(name, JoinCohort(host=host, port=port))
        control = self._send(ORCHESTRATOR, AwaitHolders(names=names, timeout=timeout))
        # A holder that refuses says so at once; the orchestrator only sees a connection break off.
        deadline = time.monotonic() + timeout + 5
        early = self._holders_answer(names, timeout + 5, until=control)
        if isinstance(early, GputravelError):
            raise early
        try:
            reply = self._reply(max(0.1, deadline - time.monotonic()))  # one deadline for the whole join
        except (TransportClosed, PeerTimeout, ProtocolError) as exc:
            # The holder knows why it hung up (the claim it refused); the orchestrator's own refusal
            # (another error type) propagates as is.
            refused = self._holders_answer(tuple(n for n in names if n not in early), 5.0)
            if isinstance(refused, GputravelError):
                raise refused from None
            raise exc
        assert isinstance(reply, Holders)
        for name in names:
            answer = early.pop(name, None) or self.from_holder(name, Joined)
            if not isinstance(answer, Joined):
                raise RemoteError(f"{name} sent {type(answer).__name__} instead of Joined")
            self.attestations[name] = answer
        joined = dict(reply.dataset_bytes)
        self.dataset_bytes.update(joined)
        return joined

    def _holders_answer(self, names: tuple[str, ...], timeout: float,
                        until: StreamTransport | None = None) -> dict[str, object] | GputravelError:
        """The holders' first refusal, or their answers by holder, within `timeout` or until `until` answers."""
        answers: dict[str, object] = {}
        pending = {self.parties.control(n).fileno(): n for n in names}
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            for fd in pending if until is None else [until.fileno(), *pending]:
                sel.register(fd, selectors.EVENT_READ)
            while (pending or until is not None) and deadline > time.monotonic():
                ready = {key.fd for key, _ in sel.select(deadline - time.monotonic())}
                if until is not None and until.fileno() in ready:
                    return answers
                for fd in ready:
                    name = pending.pop(fd)
                    sel.unregister(fd)
                    try:
                        msg = self._recv(name, 1)
                    except Terminated:
                        raise
                    except GputravelError:
                        continue  # a holder gone quiet: the orchestrator's answer says who is missing
                    if isinstance(msg, Failed):
                        return error_from(msg, f"{name} did not join")
                    answers[name] = msg
        return answers

    def admit(self, name: str) -> int:
        """Paper 4.5: a booted holder probes the GPU lent to it, attests the orchestrator, joins; its size."""
        wait = self.config.boot_timeout + 5
        self.ask(LendGpu(holder=name), wait)
        try:
            self.from_holder(name, Probed, ProbeGpu())
        finally:
            self.ask(ReclaimGpu(), wait)  # whatever the probe did, the orchestrator takes the GPU back
        self.join((name,))
        return self.dataset_bytes[name]

    def leave(self, name: str, reason: str = "leaving the cohort") -> None:
        """Paper 4.5: the holder says goodbye; travels to it fail (HolderLost) until it rejoins."""
        self.from_holder(name, Left, Leave(reason=reason))
        self.ask(AwaitDeparture(holder=name, timeout=self.config.boot_timeout), self.config.boot_timeout + 5)
        self.dataset_bytes.pop(name, None)
        self.attestations.pop(name, None)

    def rejoin(self, name: str) -> int:
        self.join((name,))
        return self.dataset_bytes[name]

    def from_holder(self, name: str, expect: type, cmd: object | None = None) -> object:
        """Send a holder ``cmd`` (if any); its reply, which must be an ``expect``."""
        if cmd is not None:
            self._send(name, cmd)
        msg = self._read(name, self.config.boot_timeout)
        if isinstance(msg, Failed):
            raise error_from(msg, name)
        if not isinstance(msg, expect):
            raise RemoteError(f"{name} sent {type(msg).__name__} instead of {expect.__name__}")
        return msg

    # ------------------------------------------------------------------ commands
    def ask(self, cmd: object, timeout: float) -> object:
        """Send the orchestrator ``cmd``; its reply (a Failed one raised as its error)."""
        self._send(ORCHESTRATOR, cmd)
        return self._reply(timeout)

    def _reply(self, timeout: float) -> object:
        msg = self._read(ORCHESTRATOR, timeout, passes=(PeerTimeout, Terminated))
        if isinstance(msg, Failed):
            raise error_from(msg, "orchestrator")
        return msg

    def _read(self, name: str, timeout: float, during: str = "",
              passes: tuple[type[GputravelError], ...] = (Terminated,)) -> object:
        """`name`'s next answer; a broken link or silence is a RemoteError with its log's tail. What
        `passes` goes on as is: Terminated says the launcher is being stopped, not that `name` is silent."""
        try:
            return self._recv(name, timeout)
        except passes:
            raise
        except GputravelError as exc:
            raise RemoteError(f"{name} stopped answering{during}: {exc}{self.parties.log_tail(name)}") from None

    def _send(self, name: str, cmd: object) -> StreamTransport:
        """Send `name` a command that it answers once, after every answer it still owed."""
        control = self._settle(name)
        control.send(cmd)
        self._owed[control] = self._owed.get(control, 0) + 1
        return control

    def _recv(self, name: str, timeout: float) -> object:
        control = self.parties.control(name)
        msg = control.recv(timeout=timeout).message
        if self._owed.get(control, 0) > 0:
            self._owed[control] -= 1
        return msg

    def _settle(self, name: str) -> StreamTransport:
        """`name`'s control link, once the answers to commands given up on are read (and dropped)."""
        control = self.parties.control(name)
        while self._owed.get(control, 0) > 0:
            self._read(name, self.config.boot_timeout + 5)
        return control

    def baseline(self, holder: str, dataset_offset: int = 0) -> BaselineReport:
        """Fill the dataset buffer the centralised TLS way (paper 7.2, orchestrator/baseline.py)."""
        bw = self.config.bandwidth_mbit
        on_link = 3 * self.config.buffer_bytes * 8 / (bw * 1e6) if bw else 0.0  # generous: 3x size/rate
        reply = self.ask(DoBaseline(holder=holder, dataset_offset=dataset_offset),
                         self.config.travel_timeout + 30 + on_link)
        if not isinstance(reply, BaselineReport):
            raise RemoteError(f"orchestrator answered a baseline transfer with {type(reply).__name__}")
        return reply

    def travel(self, holder: str, dataset_offset: int = 0) -> TravelReport:
        reply = self.ask(DoTravel(holder=holder, dataset_offset=dataset_offset), self.config.travel_timeout + 30)
        if not isinstance(reply, TravelReport):
            raise RemoteError(f"orchestrator answered a travel with {type(reply).__name__}")
        return reply

    def train(self, config_json: str, run_dir: str = "", resume_checkpoint: str = "",
              on_step: Callable[[TrainStep], None] | None = None, rank: RankPlace | None = None) -> dict:
        """Run a training job in the orchestrator CVM, the paths as its process names them; its report."""
        control = self._settle(ORCHESTRATOR)
        place = rank if rank is not None else RankPlace()
        control.send(Train(config_json=config_json, run_dir=run_dir, resume_checkpoint=resume_checkpoint,
                           rank=place.rank, world_size=place.world_size, master=place.master,
                           ifname=place.ifname, shares=place.shares, ranks_context=place.context))
        while True:
            msg = self._read(ORCHESTRATOR, self.config.travel_timeout + 30, " during training")
            if isinstance(msg, TrainStep):
                if on_step is not None:
                    on_step(msg)
            elif isinstance(msg, TrainDone):
                return json.loads(msg.report_json)
            elif isinstance(msg, Failed):
                raise error_from(msg, "training")
            else:
                raise RemoteError(f"orchestrator sent {type(msg).__name__} during training")


def error_from(msg: Failed, where: str) -> GputravelError:
    """The error a party's Failed reply names, raised here with ``where`` it happened."""
    refused = attestation_error_from(msg.kind, msg.reason, where)  # keeps the failing claim
    if refused is not None:
        return refused
    cls = getattr(errors, msg.kind, None)
    if not (isinstance(cls, type) and issubclass(cls, GputravelError)) or cls is errors.IllegalTransition:
        cls = RemoteError
    try:
        return cls(f"{where}: {msg.reason}")
    except TypeError:  # a constructor that wants more than a message (HolderLost): the nearest
        for base in cls.__mro__[1:]:  # type that takes one, with the kind named in the message
            if issubclass(base, GputravelError) and base not in (errors.IllegalTransition, errors.HolderLost):
                return base(f"{where}: {msg.kind}: {msg.reason}")
        return RemoteError(f"{where}: {msg.kind}: {msg.reason}")
