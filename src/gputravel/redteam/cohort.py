"""A live local cohort whose host is the malicious hypervisor and one of whose holders is
malicious; and the links the red team's driver uses to give them orders."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path

from gputravel.errors import RemoteError
from gputravel.cohort.config import CohortConfig
from gputravel.cohort.local import Cohort
from gputravel.cohort.supervisor import PartySpec
from gputravel.transport.unix import connect_unix
from gputravel.redteam.bus import Event, HolderNews, HostNews, MarkRow, Query

SNOOP_LIMIT = 48 << 20  # the plain snooper's file; the adversary's own snapshots come on top
ENTRY = "gputravel.redteam.entry"  # serves the adversaries' roles (redteam/entry.py)
NO_NEWS = HostNews((), 0, 0, "")


class AdversaryError(RemoteError):
    """An adversary could not carry out an order (the attack was not really tried)."""


class RedTeamCohort(Cohort):
    """Every process is the real one, except the host and the holders named ``malicious``, which run the
    adversaries (redteam/host.py, redteam/holder.py) through the red team's own entry module."""

    def __init__(self, config: CohortConfig, malicious: tuple[str, ...]) -> None:
        super().__init__(config, launch=self._adversarial)
        self.malicious = malicious

    @property
    def adversary_dir(self) -> Path:
        assert self.dir is not None
        return self.dir / "adversary"

    @property
    def loot_dir(self) -> Path:
        return self.adversary_dir / "loot"

    def _adversarial(self, spec: PartySpec) -> PartySpec:
        """The party's spec, the adversary's where it is one. The colluders, under their own uids,
        still write into each other's loot (umask 0)."""
        if spec.role == "host":  # its work directory: its layout, and the colluders' common stash
            self.adversary_dir.mkdir(mode=0o700)
            layout = dataclasses.asdict(self.config.layout)
            (self.adversary_dir / "config.json").write_text(json.dumps({"layout": layout}))
            self.loot_dir.mkdir(mode=0o777)
            os.chmod(self.loot_dir, 0o777)  # the colluders' common stash (umask 0 for what they write)
            self.placement.own(self.adversary_dir, "host", 0o711)
            extra = {"adversary_dir": self.child_path(self.adversary_dir), "snoop_limit_bytes": SNOOP_LIMIT}
        elif spec.role == "holder" and spec.key in self.malicious:
            extra = {"loot_dir": self.child_path(self.loot_dir)}
        else:
            return spec
        return dataclasses.replace(spec, config={**spec.config, **extra}, entry=ENTRY, umask=0)

    def child_path(self, path: Path) -> str:
        """How the host and the malicious holders name a path in the cohort directory."""
        assert self.placement is not None
        return self.placement.path(path)


OnEvents = Callable[[str, tuple[Event, ...]], None]


class HostLink:
    """Orders to the malicious host; what it reports piles up until :meth:`news` takes it."""

    def __init__(self, cohort: RedTeamCohort, on_events: OnEvents) -> None:
        self._t = connect_unix(str(cohort.adversary_dir / "adversary.sock"), "malicious-host")
        self._pending = NO_NEWS
        self.on_events = on_events

    def order(self, msg: object) -> None:
        self._t.send(msg)
        news = self._t.recv(timeout=60, expect=HostNews).message
        assert isinstance(news, HostNews)
        p = self._pending
        self._pending = HostNews(p.events + news.events, p.user_faults + news.user_faults,
                                 p.kernel_faults + news.kernel_faults, "")
        if news.error:
            raise AdversaryError(f"the host could not {type(msg).__name__}: {news.error}")

    def news(self) -> HostNews:
        self.order(Query())
        news, self._pending = self._pending, NO_NEWS
        self.on_events("host", news.events)
        return news

    def begin(self, row: str) -> None:
        self.order(MarkRow(row))
        self._pending = NO_NEWS

    def close(self) -> None:
        self._t.close()


class HolderLink:
    """Orders to the malicious holder, over the control link the supervisor has to it."""

    def __init__(self, cohort: RedTeamCohort, name: str, on_events: OnEvents) -> None:
        self.name = name
        self._t = cohort.children[name].control
        self.on_events = on_events

    def order(self, msg: object, timeout: float = 120) -> HolderNews:
        self._t.send(msg)
        news = self._t.recv(timeout=timeout, expect=HolderNews).message
        assert isinstance(news, HolderNews)
        self.on_events(self.name, news.events)
        return news
