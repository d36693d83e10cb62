"""A running local cohort, as users open it: ``with Cohort(config) as cohort: cohort.travel(...)``.

It is the supervisor (cohort/supervisor.py: the processes) and the client
(cohort/client.py: the commands) put together: it starts every party, has the holders join,
and answers the questions callers ask of either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from gputravel.cohort.client import CohortClient, RankPlace
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.isolation import Isolation
from gputravel.cohort.links import CohortLinks
from gputravel.cohort.placement import Placement
from gputravel.cohort.supervisor import Child, Launch, Supervisor
from gputravel.cohort.trust import CohortTrust
from gputravel.errors import BadInput
from gputravel.protocol.control import BaselineReport, Joined, TrainStep, TravelReport


class Cohort:
    """A running local cohort. Use as a context manager.

    ``launch`` (cohort/supervisor.py): how each party is started, given the spec the
    supervisor made for it; None starts every party as specified."""

    def __init__(self, config: CohortConfig, *, launch: Launch | None = None) -> None:
        self.config = config
        self.supervisor = Supervisor(config, launch)
        self.client = CohortClient(config, self.supervisor)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Cohort:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self.supervisor.start()
        self.client.join(tuple(h.name for h in self.config.holders))

    def close(self) -> None:
        """Stop everything; never raises; leaves nothing behind."""
        self.supervisor.close()

    # ------------------------------------------------------------------ membership
    def add_holder(self, name: str) -> int:
        """Paper 4.5: a late holder (one of config.late_holders) boots and joins the running
        cohort. The orchestrator lends it the GPU for its probe between travels, takes it back,
        then the holder attests the orchestrator and joins. Returns its dataset size."""
        spec = {h.name: h for h in self.config.late_holders}.get(name)
        if spec is None or name in self.children:
            raise BadInput(f"{name!r} is not a late holder of this cohort that has not started yet")
        return self._boot_and_join(spec)

    def restart_holder(self, name: str) -> int:
        """A holder CVM that died (crashed, killed mid-copy) boots again and rejoins, the way a
        late holder joins: a probe on the lent GPU, then attestation afresh. Faults injected
        into the first run are not repeated."""
        spec = {h.name: h for h in self.config.holders + self.config.late_holders}.get(name)
        child = self.children.get(name)
        if spec is None or child is None or child.proc.poll() is None:
            raise BadInput(f"{name!r} is not a holder of this cohort whose process has ended")
        self.supervisor.forget(name)
        return self._boot_and_join(dataclasses.replace(spec, die_mid_copy_on_travel=0))

    def _boot_and_join(self, spec: HolderSpec) -> int:
        self.supervisor.spawn_holder(spec, late=True)
        return self.client.admit(spec.name)

    def leave(self, name: str, reason: str = "leaving the cohort") -> None:
        """Paper 4.5: the holder says goodbye and stops providing data (CohortClient.leave)."""
        self.client.leave(self._running(name), reason)

    def rejoin(self, name: str) -> int:
        """A holder that left joins again, attesting the orchestrator afresh."""
        return self.client.rejoin(self._running(name))

    def _running(self, name: str) -> str:
        if name not in self.children or name not in {h.name for h in self.config.holders + self.config.late_holders}:
            raise BadInput(f"{name!r} is not a data holder of this cohort whose process has started")
        return name

    # ------------------------------------------------------------------ commands
    def baseline(self, holder: str, dataset_offset: int = 0) -> BaselineReport:
        """Fill the dataset buffer the centralised TLS way (paper 7.2, orchestrator/baseline.py)."""
        return self.client.baseline(holder, dataset_offset)

    def travel(self, holder: str, dataset_offset: int = 0) -> TravelReport:
        return self.client.travel(holder, dataset_offset)

    def train(self, config_json: str, run_dir: str = "", resume_checkpoint: str = "",
              on_step: Callable[[TrainStep], None] | None = None, rank: RankPlace | None = None) -> dict:
        """Run a training job in the orchestrator CVM; returns its report (see train.loop.make_report).
        `rank`: this cohort's GPU as one rank of a data-parallel job (cohort/gpus.py)."""
        place = self.supervisor.placement
        run_dir, resume_checkpoint = place.output("orchestrator", run_dir), place.stage("orchestrator", resume_checkpoint)
        return self.client.train(config_json, run_dir, resume_checkpoint, on_step, rank)

    # ------------------------------------------------------------------ what callers look at
    @property
    def dataset_bytes(self) -> dict[str, int]:
        return self.client.dataset_bytes

    @property
    def attestations(self) -> dict[str, Joined]:
        """What each holder verified when it last joined."""
        return self.client.attestations

    @property
    def children(self) -> dict[str, Child]:
        return self.supervisor.children

    @property
    def dir(self) -> Path | None:
        return self.supervisor.dir

    @property
    def port(self) -> int:
        return self.supervisor.port

    @property
    def links(self) -> CohortLinks | None:
        return self.supervisor.links

    @property
    def trust(self) -> CohortTrust | None:
        return self.supervisor.trust

    @property
    def placement(self) -> Placement | None:
        return self.supervisor.placement

    @property
    def link(self) -> str:
        """The kind of link the holders reach the orchestrator on: netns-tc, token-bucket or none."""
        return self.supervisor.link

    @property
    def snoop_path(self) -> Path | None:
        return self.supervisor.snoop_path

    @property
    def audit_log_path(self) -> Path | None:
        """Where the orchestrator writes its signed travel log."""
        return self.supervisor.audit_log_path

    def orchestrator_certificate(self) -> bytes:
        """The orchestrator's cohort certificate (public): the key that signs the travel log."""
        return self.supervisor.orchestrator_certificate()

    @property
    def isolation(self) -> Isolation:
        """The isolation this cohort got: on or off (and why), each party's uid and dumpability."""
        return self.supervisor.isolation

    def pids(self) -> dict[str, int]:
        return self.supervisor.pids()
