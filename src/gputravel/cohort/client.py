"""The client of a running cohort: it sends commands (travel, train, baseline, membership) to
the orchestrator and the holders over their control links, and reads their replies.

It starts and stops nothing: the processes are the supervisor's (cohort/supervisor.py), and
it reaches them only through :class:`Parties`. A reply that says Failed comes back as the
typed error it names (an attestation refusal keeps the claim that failed).
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
    AwaitDeparture,
    AwaitHolders,
    BaselineReport,
    DoBaseline,
    DoTravel,
    Failed,
    Holders,
    JoinCohort,
    Joined,
    Leave,
    Left,
    LendGpu,
    ProbeGpu,
    Probed,
    ReclaimGpu,
    Train,
    TrainDone,
    TrainStep,
    TravelReport,
)
from gputravel.transport.stream import StreamTransport


@dataclass(frozen=True)
class RankPlace:
    """An orchestrator's place in a data-parallel job: its rank, how many there are, where
    rank 0 listens ("host:port") and the job's context the ranks' pair keys are bound to."""

    rank: int = 0
    world_size: int = 1
    master: str = ""
    ifname: str = ""  # the interface the ranks reach one another on (a server's link); "": any
    shares: tuple[tuple[str, ...], ...] = ()  # every rank's holders, by rank
    context: bytes = b""


class Parties(Protocol):
    """What the client needs of the supervisor: a party's control link, the tail of its log
    (for an error that says why it stopped answering), and where holders join."""

    def control(self, name: str) -> StreamTransport: ...

    def log_tail(self, name: str) -> str: ...

    def join_address(self) -> tuple[str, int]: ...


class CohortClient:
    def __init__(self, config: CohortConfig, parties: Parties) -> None:
        self.config = config
        self.parties = parties
        self.dataset_bytes: dict[str, int] = {}  # of every holder that joined and has not left
        self.attestations: dict[str, Joined] = {}  # what each holder verified when it last joined
        # Answers each party still owes, by party: sent by `_send`, read by `_recv`. A command
        # given up on early (a join a holder refused, a reply that timed out) leaves its answer
        # on the link; `_settle` reads it before the party's next command, so it answers no other.
        # Keyed by the link itself: a party started again comes with a new link that owes nothing.
        self._owed: dict[StreamTransport, int] = {}

    # ------------------------------------------------------------------ membership
    def join(self, names: tuple[str, ...]) -> dict[str, int]:
        """Holders attest the orchestrator and join; the dataset size of every joined holder."""
        timeout = self.config.boot_timeout
        host, port = self.parties.join_address()
        for name in names:
            self._send(name, JoinCohort(host=host, port=port))
        control = self._send(ORCHESTRATOR, AwaitHolders(names=names, timeout=timeout))
        # A holder that refuses says so at once; the orchestrator, which only sees a connection
        # break off (anyone's), waits out its deadline. Its late answer is read before the next command.
        deadline = time.monotonic() + timeout + 5
        early = self._holders_answer(names, control, timeout + 5)
        if isinstance(early, GputravelError):
            raise early
        try:
            reply = self._reply(max(0.1, deadline - time.monotonic()))  # one deadline for the whole join
        except (TransportClosed, PeerTimeout, ProtocolError) as exc:
            # The orchestrator only saw a holder hang up or go quiet; the holder knows why
            # (an attestation it refused, naming the claim). An orchestrator's own refusal
            # (another error type) says why itself and propagates as is.
            refused = self._holder_failure(tuple(n for n in names if n not in early))
            if refused is not None:
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

    def _holders_answer(self, names: tuple[str, ...], control: StreamTransport,
                        timeout: float) -> dict[str, object] | GputravelError:
        """What the holders said until the orchestrator's answer is there: the first refusal,
        or the answers read so far, by holder."""
        answers: dict[str, object] = {}
        pending = {self.parties.control(n).fileno(): n for n in names}
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(control.fileno(), selectors.EVENT_READ)
            for fd in pending:
                sel.register(fd, selectors.EVENT_READ)
            while deadline > time.monotonic():
                ready = {key.fd for key, _ in sel.select(deadline - time.monotonic())}
                if control.fileno() in ready:
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

    def _holder_failure(self, names: tuple[str, ...], grace: float = 5.0) -> GputravelError | None:
        """The first error a holder reports within `grace` seconds (only used after a failure)."""
        pending = {self.parties.control(n).fileno(): n for n in names}
        deadline = time.monotonic() + grace
        with selectors.DefaultSelector() as sel:
            for fd in pending:
                sel.register(fd, selectors.EVENT_READ)
            while pending and deadline > time.monotonic():
                for key, _ in sel.select(deadline - time.monotonic()):
                    name = pending.pop(key.fd)
                    sel.unregister(key.fd)
                    try:
                        msg = self._recv(name, 1)
                    except Terminated:
                        raise  # the launcher is being stopped (cohort/stopping.py): never swallowed
                    except GputravelError:
                        continue
                    if isinstance(msg, Failed):
                        return error_from(msg, f"{name} did not join")
        return None

    def admit(self, name: str) -> int:
        """Paper 4.5: a holder that just booted (late, or again) gets the GPU lent for its probe
        between travels, the orchestrator takes it back, then the holder attests the
        orchestrator and joins. Returns its dataset size."""
        wait = self.config.boot_timeout + 5
        self.ask(LendGpu(holder=name), wait)
        try:
            self.from_holder(name, Probed, ProbeGpu())
        finally:
            self.ask(ReclaimGpu(), wait)  # whatever the probe did, the orchestrator takes the GPU back
        self.join((name,))
        return self.dataset_bytes[name]

    def leave(self, name: str, reason: str = "leaving the cohort") -> None:
        """Paper 4.5: the holder says goodbye to the orchestrator and stops providing data; the
        orchestrator drops its link (travels to it then fail: HolderLost) until it rejoins."""
        self.from_holder(name, Left, Leave(reason=reason))
        self.ask(AwaitDeparture(holder=name, timeout=self.config.boot_timeout), self.config.boot_timeout + 5)
        self.dataset_bytes.pop(name, None)
        self.attestations.pop(name, None)

    def rejoin(self, name: str) -> int:
        """A holder that left joins again, attesting the orchestrator afresh."""
        self.join((name,))
        return self.dataset_bytes[name]

    def from_holder(self, name: str, expect: type, cmd: object | None = None) -> object:
        """Send a holder ``cmd`` (if any) and read its reply, which must be an ``expect``."""
        if cmd is not None:
            self._send(name, cmd)
        try:
            msg = self._recv(name, self.config.boot_timeout)
        except Terminated:
            raise  # this launcher is being stopped: said as that, not as a holder's silence
        except GputravelError as exc:
            raise RemoteError(f"{name} stopped answering: {exc}{self.parties.log_tail(name)}") from None
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
        """The orchestrator's answer to the command sent last (a Failed one raised as its error)."""
        try:
            msg = self._recv(ORCHESTRATOR, timeout)
        except (PeerTimeout, Terminated):
            raise
        except GputravelError as exc:
            raise RemoteError(f"orchestrator stopped answering: {exc}{self.parties.log_tail(ORCHESTRATOR)}") from None
        if isinstance(msg, Failed):
            raise error_from(msg, "orchestrator")
        return msg

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
            try:
                self._recv(name, self.config.boot_timeout + 5)
            except Terminated:
                raise
            except GputravelError as exc:
                raise RemoteError(f"{name} stopped answering: {exc}{self.parties.log_tail(name)}") from None
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
        """Run a training job in the orchestrator CVM; returns its report (see train.loop.make_report).
        The paths are as the orchestrator's process names them (Placement.output); `rank`: its
        place in a data-parallel job (None: it trains alone)."""
        control = self._settle(ORCHESTRATOR)  # the job's steps and its end are read below, as they come
        place = rank if rank is not None else RankPlace()
        control.send(Train(config_json=config_json, run_dir=run_dir, resume_checkpoint=resume_checkpoint,
                           rank=place.rank, world_size=place.world_size, master=place.master,
                           ifname=place.ifname, shares=place.shares, ranks_context=place.context))
        while True:
            try:
                msg = control.recv(timeout=self.config.travel_timeout + 30).message
            except Terminated:
                raise
            except GputravelError as exc:
                tail = self.parties.log_tail(ORCHESTRATOR)
                raise RemoteError(f"orchestrator stopped answering during training: {exc}{tail}") from None
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
