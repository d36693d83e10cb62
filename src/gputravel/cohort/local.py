"""A running local cohort, as users open it: ``with Cohort(config) as cohort: cohort.travel(...)``.

The supervisor (cohort/supervisor.py: the processes) with a client (cohort/client.py: the commands).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gputravel.cohort.client import CohortClient, RankPlace
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.supervisor import Launch, Supervisor
from gputravel.errors import BadInput
from gputravel.protocol.control import BaselineReport, Joined, TrainStep, TravelReport


class Cohort(Supervisor):
    """A running local cohort. Use as a context manager. ``launch``: see Supervisor."""

    def __init__(self, config: CohortConfig, *, launch: Launch | None = None) -> None:
        super().__init__(config, launch)
        self.client = CohortClient(config, self)
        self.dataset_bytes: dict[str, int] = self.client.dataset_bytes  # the client's dicts: it keeps them
        self.attestations: dict[str, Joined] = self.client.attestations  # what each holder verified at its join

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
        super().start()
        self.client.join(tuple(h.name for h in self.config.holders))

    # ------------------------------------------------------------------ membership
    def add_holder(self, name: str) -> int:
        """Paper 4.5: a late holder (one of config.late_holders) boots, probes the GPU lent to it
        between travels, attests the orchestrator and joins. Returns its dataset size."""
        spec = {h.name: h for h in self.config.late_holders}.get(name)
        if spec is None or name in self.children:
            raise BadInput(f"{name!r} is not a late holder of this cohort that has not started yet")
        return self._boot_and_join(spec)

    def restart_holder(self, name: str) -> int:
        """A holder CVM that died boots and rejoins as a late holder, its injected faults not repeated."""
        spec = {h.name: h for h in self.config.holders + self.config.late_holders}.get(name)
        child = self.children.get(name)
        if spec is None or child is None or child.proc.poll() is None:
            raise BadInput(f"{name!r} is not a holder of this cohort whose process has ended")
        self.forget(name)
        return self._boot_and_join(dataclasses.replace(spec, die_mid_copy_on_travel=0))

    def _boot_and_join(self, spec: HolderSpec) -> int:
        self._spawn("holder", self._holder_config(spec, late=True), key=spec.name)
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
        return self.client.baseline(holder, dataset_offset)

    def travel(self, holder: str, dataset_offset: int = 0) -> TravelReport:
        return self.client.travel(holder, dataset_offset)

    def train(self, config_json: str, run_dir: str = "", resume_checkpoint: str = "",
              on_step: Callable[[TrainStep], None] | None = None, rank: RankPlace | None = None) -> dict:
        """Run a training job in the orchestrator CVM; its report. `rank`: this GPU's (cohort/gpus.py)."""
        place = self.placement
        assert place is not None
        run_dir, resume_checkpoint = place.output("orchestrator", run_dir), place.stage("orchestrator", resume_checkpoint)
        return self.client.train(config_json, run_dir, resume_checkpoint, on_step, rank)
