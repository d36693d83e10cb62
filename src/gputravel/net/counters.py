"""Bytes over a shaped link, counted by the kernel at the hub's end of each holder's veth: whole
frames, headers and retransmissions included, which is what a capped link has to carry."""

from __future__ import annotations

import json
from dataclasses import dataclass

from gputravel.errors import BadInput
from gputravel.net.iproute import LinkError, run_iproute
from gputravel.net.shaped import ShapedLinks


@dataclass(frozen=True)
class LinkBytes:
    up: int  # holder -> hub
    down: int  # hub -> holder

    @property
    def total(self) -> int:
        return self.up + self.down

    def __sub__(self, before: LinkBytes) -> LinkBytes:
        return LinkBytes(self.up - before.up, self.down - before.down)


def link_bytes(links: ShapedLinks) -> dict[str, LinkBytes]:
    """Every holder's link counters now (one ``ip -s -j link show`` in the hub's namespace)."""
    out = run_iproute(["ip", "-n", links.namespace(links.hub), "-s", "-j", "link", "show"]).stdout
    try:
        stats = {d["ifname"]: d["stats64"] for d in json.loads(out)}
    except (ValueError, KeyError, TypeError) as e:
        raise LinkError(f"cannot read the link counters from `ip -s -j link show`: {e}") from None
    result = {}
    for member in links.members[1:]:
        dev = links.hub_device(member)
        if dev not in stats:
            raise LinkError(f"the link of {member!r} ({dev}) is missing from the hub's namespace")
        result[member] = LinkBytes(up=int(stats[dev]["rx"]["bytes"]), down=int(stats[dev]["tx"]["bytes"]))
    return result


def bytes_between(before: dict[str, LinkBytes], after: dict[str, LinkBytes]) -> dict[str, LinkBytes]:
    """What each holder's link carried between two snapshots."""
    if set(before) != set(after):
        raise BadInput("the two snapshots are of different links")
    return {m: after[m] - before[m] for m in after}
