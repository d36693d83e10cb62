"""Several GPUs on one machine: one single-GPU cohort (a rank) per GPU, each travelling only to its
share of the holders (paper 9), all chained to one set of vendor roots, held in memory only and
dropped once every cohort has booted. A late holder is enrolled on its own GPU's cohort alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar
from pathlib import Path

from gputravel.cohort.config import CohortConfig
from gputravel.cohort.local import Cohort
from gputravel.cohort.supervisor import Launch
from gputravel.cohort.trust import SharedRoots
from gputravel.errors import BadInput
from gputravel.net import ShapedLinks, check_bandwidth
from gputravel.protocol.parties import ORCHESTRATOR
from gputravel.train.schedule import check_shares

__all__ = ["GpuCohorts", "PerGpu", "on_each", "place_late"]

SERVER_SUBNET = "10.214.0"  # the servers' switch; each cohort's own star is on net/shaped's subnet
RANK_IF = "gt-srv"  # a server's end of its link to the switch, in its orchestrator's namespace

# Given a GPU's index and the config made for its cohort, the config to boot it with (a rank's
# own audit log, run directory). It may not change the cohort's holders, roots or GPU index.
PerGpu = Callable[[int, CohortConfig], CohortConfig]
T = TypeVar("T")


class GpuCohorts:
    """A running cohort per share of the holders (late ones included). Use as a context manager."""

    def __init__(self, base: CohortConfig, shares: tuple[tuple[str, ...], ...], *,
                 per_gpu: PerGpu | None = None, launch: Launch | None = None,
                 servers: bool = False, server_mbit: float | None = None) -> None:
        """`servers`: each cohort an emulated server (link "netns"), joined to the others at `server_mbit`."""
        if servers and base.link != "netns":
            raise BadInput("GPUs on servers of their own need their cohorts on network namespaces (link 'netns')")
        check_bandwidth(server_mbit)
        self.servers, self.server_mbit = servers, server_mbit
        self.fabric: ShapedLinks | None = None
        self._closing = threading.Lock()
        self.base = base
        self.shares = _checked_shares(base, shares)
        self.per_gpu = per_gpu
        self.launch = launch
        self.cohorts: list[Cohort] = []
        self.roots: SharedRoots | None = None  # while the cohorts boot; dropped after
        self._gpu = {name: k for k, share in enumerate(self.shares) for name in share}

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> GpuCohorts:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Make the roots, boot every cohort in turn, drop the roots; on failure close them all."""
        try:
            self.roots = SharedRoots.make()
            for config in self._configs():
                cohort = Cohort(config, launch=self.launch)
                self.cohorts.append(cohort)  # before it starts: close() stops what it started
                cohort.start()
            self._forget_roots()
            if self.servers:
                self._join_servers()
        except BaseException:
            self.close()
            raise
        finally:
            self.roots = None  # the last reference besides the cohorts' trust, itself dropped once used

    def _configs(self) -> list[CohortConfig]:
        """Each GPU's cohort config, all checked before any boots."""
        configs = []
        for k, share in enumerate(self.shares):
            # A late holder is enrolled on its own GPU's cohort only: no other certifies or pins it.
            pinned = {"holders": tuple(h for h in self.base.holders if h.name in share),
                      "late_holders": tuple(h for h in self.base.late_holders if h.name in share),
                      "roots": self.roots, "gpu_index": k}
            config = dataclasses.replace(self.base, **pinned)
            if self.per_gpu is not None:
                config = self.per_gpu(k, config)
                if any(getattr(config, f) != v for f, v in pinned.items()):
                    raise BadInput(f"the per-GPU hook may not change GPU {k}'s holders, late holders, roots or index")
            configs.append(config)
        _check_outputs(configs)
        return configs

    def _forget_roots(self) -> None:
        """No copy of the roots stays in any cohort's configuration once all have booted."""
        for cohort in self.cohorts:
            stripped = dataclasses.replace(cohort.config, roots=None)
            cohort.config = cohort.client.config = stripped

    def _join_servers(self) -> None:
        """A switch and one shaped link to each server's orchestrator namespace, on a subnet of its own."""
        hubs = {}
        for k, cohort in enumerate(self.cohorts):
            shaped = cohort.links.shaped if cohort.links is not None else None
            if shaped is None:
                raise BadInput(f"GPU {k}'s cohort runs on no network namespace: it cannot be a server of its own")
            hubs[f"server-{k}"] = shaped.namespace(ORCHESTRATOR)
        self.fabric = ShapedLinks(tuple(hubs), hub="switch", bandwidth_mbit=self.server_mbit,
                                  subnet=SERVER_SUBNET, member_if=RANK_IF, joined=hubs)
        self.fabric.open()

    def rank_address(self, k: int) -> str:
        """Where the other ranks reach GPU k's orchestrator: its server link, or loopback."""
        return self.fabric.address(f"server-{k}") if self.fabric is not None else "127.0.0.1"

    @property
    def rank_ifname(self) -> str:
        """The interface the ranks' gloo traffic must use ("" : gloo's own choice, loopback)."""
        return RANK_IF if self.fabric is not None else ""

    def close(self) -> None:
        """Stop every cohort, last started first; never raises, but warns. Thread-safe: a failing rank closes all."""
        with self._closing:
            failures = []
            if self.fabric is not None:
                try:
                    self.fabric.close()  # before the servers' namespaces it has a leg in
                except Exception as exc:  # a namespace left behind must not keep the cohorts running
                    failures.append(f"the servers' links were not all deleted: {exc}")
                self.fabric = None
            while self.cohorts:
                k, cohort = len(self.cohorts) - 1, self.cohorts.pop()
                try:
                    cohort.close()
                except Exception as exc:  # one that raises must not keep the rest running
                    failures.append(f"closing GPU {k}'s cohort failed: {type(exc).__name__}: {exc}")
            for failure in failures:  # said once everything that could stop has stopped
                with contextlib.suppress(Exception):  # a filter that turns warnings into errors
                    warnings.warn(failure, RuntimeWarning, stacklevel=2)
            self.roots = None

    # ------------------------------------------------------------------ looking at it
    def gpu_of(self, holder: str) -> int:
        try:
            return self._gpu[holder]
        except KeyError:
            raise BadInput(f"{holder!r} is not a data holder of these GPUs") from None

    def cohort_of(self, holder: str) -> Cohort:
        k = self.gpu_of(holder)
        if k >= len(self.cohorts):
            raise BadInput(f"GPU {k}'s cohort is not running")
        return self.cohorts[k]

    # ------------------------------------------------------------------ membership (paper 4.5)
    def add_holder(self, name: str) -> int:
        return self.cohort_of(name).add_holder(name)

    def restart_holder(self, name: str) -> int:
        return self.cohort_of(name).restart_holder(name)

    def leave(self, name: str, reason: str = "leaving the cohort") -> None:
        self.cohort_of(name).leave(name, reason)

    def rejoin(self, name: str) -> int:
        return self.cohort_of(name).rejoin(name)


def place_late(shares: tuple[tuple[str, ...], ...], sizes: Mapping[str, int],
               late: Iterable[str]) -> tuple[tuple[str, ...], ...]:
    """`shares` with each `late` holder added, largest first, to the GPU with the fewest bytes so far."""
    shares = tuple(tuple(s) for s in shares)
    late = tuple(late)
    placed = {n for s in shares for n in s}
    if not shares:
        raise BadInput("late holders need a share of holders present at boot to join")
    again = sorted(placed.intersection(late) | {n for n in late if late.count(n) > 1})
    if again:
        raise BadInput(f"a late holder goes to one share once, and is not already in one: {', '.join(again)}")
    unknown = sorted(n for n in placed.union(late) if n not in sizes)
    if unknown:
        raise BadInput(f"the dataset size of {', '.join(unknown)} is not known")
    negative = sorted(n for n in placed.union(late) if type(sizes[n]) is not int or sizes[n] < 0)
    if negative:
        raise BadInput(f"dataset sizes are whole numbers of bytes, not negative: {', '.join(negative)}")
    loads = [sum(sizes[n] for n in s) for s in shares]
    out = [list(s) for s in shares]
    for name in sorted(late, key=lambda n: (-sizes[n], n)):
        k = min(range(len(out)), key=lambda i: (loads[i], i))
        out[k].append(name)
        loads[k] += sizes[name]
    return tuple(tuple(s) for s in out)


def _checked_shares(base: CohortConfig, shares: tuple[tuple[str, ...], ...]) -> tuple[tuple[str, ...], ...]:
    """BadInput unless every holder, late ones included, is in one share, each with a holder present at boot."""
    shares = check_shares(shares, [h.name for h in base.holders + base.late_holders], where="--gpus")
    present = {h.name for h in base.holders}
    for k, s in enumerate(shares):
        if not present.intersection(s):
            raise BadInput(f"GPU {k}'s share has only late holders: every GPU needs a data holder present at boot")
    return shares


def _check_outputs(configs: list[CohortConfig]) -> None:
    """Each orchestrator needs its own audit log (two would mix signed records) and output directories
    (one lent to a rank's uid is closed to the next)."""
    logs = [str(Path(c.audit_log).resolve()) for c in configs if c.audit_log]
    if len(set(logs)) != len(logs):
        raise BadInput("each GPU's orchestrator needs an audit log of its own: set them with the per-GPU hook")
    dirs = [(k, Path(d).resolve()) for k, c in enumerate(configs) for d in c.output_dirs]
    for k, a in dirs:
        for j, b in dirs:
            if k < j and (a == b or a in b.parents or b in a.parents):
                raise BadInput(f"GPUs {k} and {j} would share the output directory {b}: give each its own "
                               "with the per-GPU hook")


def on_each(cohorts: list[Cohort], work: Callable[[int, Cohort], T], *, stop_all: Callable[[], None]) -> list[T]:
    """`work(k, cohort)` for every GPU at once, one thread each; what each returned, by GPU. The
    first failure (or an interrupted wait) calls `stop_all` and is raised once every thread is done."""
    out: list = [None] * len(cohorts)
    failures: list[BaseException] = []
    lock = threading.Lock()

    def run(k: int, cohort: Cohort) -> None:
        try:
            out[k] = work(k, cohort)
        except BaseException as exc:  # re-raised below, in the caller's thread
            with lock:
                failures.append(exc)
                first = len(failures) == 1
            if first:
                stop_all()

    threads = [threading.Thread(target=run, args=(k, c), name=f"gpu-{k}", daemon=True) for k, c in enumerate(cohorts)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    except BaseException:  # the caller interrupted: every GPU stops
        stop_all()
        raise
    if failures:
        raise failures[0]
    return out
