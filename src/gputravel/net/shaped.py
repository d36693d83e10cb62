"""Kernel-shaped links: a star of network namespaces around the orchestrator's, each holder's
link capped both ways by tc, so traffic crosses a real TCP/IP stack and queue (docs/links.md)."""

from __future__ import annotations

import atexit
import os
import re
import secrets
import subprocess
from typing import Mapping, Sequence

from gputravel.errors import BadInput
from gputravel.net.iproute import LinkError, run_iproute
from gputravel.net.namespaces import (
    BRIDGE,
    NS_PREFIX,
    cleanup_stale,
    delete_namespace,
    netem_available,
    netns_available,
)
from gputravel.net.tc import LinkShape, shape_device

LINK_NETNS = "netns-tc"

# Namespaces are private, so one fixed subnet serves every run (even concurrent ones).
_SUBNET = "10.213.0"
_PREFIX_LEN = 24
_MAX_HOLDERS = 250
_HOLDER_IF = "gt-up"  # the holder's end of its link, inside the holder's namespace


class ShapedLinks:
    """A star of network namespaces, one per member: holder i's veth (10.213.0.(i+1)) to the hub's
    bridge gt-br (10.213.0.1), each end's egress shaped. Use as a context manager; teardown
    deletes every namespace, even when the body raises, and at exit if close() was never reached."""

    link = LINK_NETNS

    def __init__(self, holders: Sequence[str], *, hub: str = "orchestrator",
                 bandwidth_mbit: float | None = None, delay_ms: float = 0.0,
                 burst_bytes: int | None = None, latency_ms: float | None = None,
                 subnet: str = _SUBNET, member_if: str = _HOLDER_IF,
                 joined: Mapping[str, str] | None = None) -> None:
        """`joined`: members in existing namespaces (cohort/gpus.py's servers), wired, never made nor deleted."""
        self.shape = LinkShape(bandwidth_mbit, delay_ms, burst_bytes, latency_ms)
        if isinstance(holders, str):  # a lone name would be split into one holder per letter
            raise BadInput(f"holders must be a sequence of names, got the string {holders!r}")
        members = (hub, *holders)
        if not holders:
            raise BadInput("shaped links need at least one holder")
        if len(holders) > _MAX_HOLDERS:
            raise BadInput(f"at most {_MAX_HOLDERS} holders fit the link subnet, got {len(holders)}")
        if any(not isinstance(m, str) or not m for m in members):
            raise BadInput("member names must be non-empty strings")
        if len(set(members)) != len(members):
            raise BadInput(f"member names must be unique, got {list(members)}")
        self.hub = hub
        self.members: tuple[str, ...] = members
        self.run_id = f"{os.getpid():x}-{secrets.token_hex(2)}"
        self._joined = dict(joined or {})
        if set(self._joined) - set(holders):
            raise BadInput("only holders (spokes) of the star may be joined to existing namespaces")
        self._member_if = member_if
        slug = {m: re.sub(r"[^a-z0-9]", "", m.lower())[:8] for m in members}
        self._ns = {m: self._joined.get(m) or f"{NS_PREFIX}{self.run_id}-{i}{slug[m]}" for i, m in enumerate(members)}
        self._addr = {m: f"{subnet}.{i + 1}" for i, m in enumerate(members)}
        self._created: list[str] = []
        self._open = False

    # -------------------------------------------------------------- lookups
    def namespace(self, member: str) -> str:
        return self._ns[self._known(member)]

    def address(self, member: str) -> str:
        return self._addr[self._known(member)]

    def hub_device(self, member: str) -> str:
        """The hub's end of a holder's veth: its counters see all of that link (net/counters.py)."""
        i = self.members.index(self._known(member))
        if i == 0:
            raise BadInput(f"{member!r} is the hub: it has no link of its own")
        return f"gt-h{i}"

    def exec_prefix(self, member: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(member)]

    def run(self, member: str, argv: Sequence[str], *, input: bytes | None = None,
            timeout: float = 60.0) -> subprocess.CompletedProcess[bytes]:
        self._check_open()
        return subprocess.run([*self.exec_prefix(member), *argv], input=input, capture_output=True, timeout=timeout)

    def _known(self, member: str) -> str:
        if member not in self._ns:
            raise BadInput(f"unknown member {member!r}; members are {list(self.members)}")
        return member

    def _check_open(self) -> None:
        if not self._open:
            raise BadInput("shaped links are not set up (use them inside `with`)")

    # -------------------------------------------------------------- lifecycle
    def __enter__(self) -> ShapedLinks:
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except LinkError as e:
            if exc is None:
                raise
            exc.add_note(f"also, shaped-link teardown failed: {e}")

    def open(self) -> None:
        if self._open or self._created:
            raise BadInput("shaped links are already set up")
        ok, why = netns_available()
        if not ok:
            raise LinkError(f"cannot build shaped links: {why}")
        if self.shape.delay_ms > 0 and not netem_available():
            raise LinkError("a delay needs sch_netem, which this kernel lacks")
        cleanup_stale()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self._open = True

    def _build(self) -> None:
        for m in (m for m in self.members if m not in self._joined):
            run_iproute(["ip", "netns", "add", self._ns[m]])
            self._created.append(self._ns[m])
            run_iproute(["ip", "-n", self._ns[m], "link", "set", "lo", "up"])
        hub = self._ns[self.hub]
        run_iproute(["ip", "-n", hub, "link", "add", BRIDGE, "type", "bridge"])
        run_iproute(["ip", "-n", hub, "addr", "add", f"{self._addr[self.hub]}/{_PREFIX_LEN}", "dev", BRIDGE])
        run_iproute(["ip", "-n", hub, "link", "set", BRIDGE, "up"])
        for m in self.members[1:]:
            self._wire_holder(m, self.hub_device(m))

    def _wire_holder(self, member: str, hub_dev: str) -> None:
        hub, ns = self._ns[self.hub], self._ns[member]
        # Both ends are made inside their namespaces, so concurrent runs never collide on names; a
        # joined namespace loses its end with the hub's (a veth pair dies with either end).
        end = self._member_if
        run_iproute(["ip", "link", "add", hub_dev, "netns", hub, "type", "veth", "peer", "name", end, "netns", ns])
        run_iproute(["ip", "-n", hub, "link", "set", hub_dev, "master", BRIDGE])
        run_iproute(["ip", "-n", ns, "addr", "add", f"{self._addr[member]}/{_PREFIX_LEN}", "dev", end])
        shape_device(ns, end, self.shape)  # holder -> hub
        shape_device(hub, hub_dev, self.shape)  # hub -> holder
        run_iproute(["ip", "-n", hub, "link", "set", hub_dev, "up"])
        run_iproute(["ip", "-n", ns, "link", "set", end, "up"])

    def close(self) -> None:
        """Delete every namespace this instance created, killing what runs inside; idempotent."""
        self._open = False
        atexit.unregister(self.close)
        errors = []
        while self._created:
            ns = self._created.pop()
            try:
                delete_namespace(ns)
            except LinkError as e:
                errors.append(str(e))
        if errors:
            raise LinkError("teardown left namespaces behind: " + "; ".join(errors))

    def qdisc_report(self, member: str) -> str:
        self._check_open()
        return run_iproute(["tc", "-n", self.namespace(member), "-s", "qdisc", "show"]).stdout
