"""How a cohort's holders reach its orchestrator: "netns-tc" (a star of namespaces, capped by
the kernel), "token-bucket" (loopback, each TLS end paces itself) or "none" (loopback, no cap).
Host and device stay in the root namespace: they are reached by Unix socket path.
"""

from __future__ import annotations

from gputravel.errors import BadInput
from gputravel.net import (
    LINK_NETNS,
    LINK_TOKEN_BUCKET,
    LinkError,
    ShapedLinks,
    check_bandwidth,
    netns_available,
)
from gputravel.protocol.parties import ORCHESTRATOR

LINK_NONE = "none"
#: What a cohort may be asked for (``CohortConfig.link``).
LINK_CHOICES = ("auto", "netns", "token-bucket", "none")
LOOPBACK = "127.0.0.1"


def check_link_config(link: str, bandwidth_mbit: float | None, tap: bool) -> None:
    if link not in LINK_CHOICES:
        raise BadInput(f"link must be one of {', '.join(LINK_CHOICES)}, not {link!r}")
    check_bandwidth(bandwidth_mbit)  # the same limits the links themselves apply, before anything boots
    if link == "none" and bandwidth_mbit is not None:
        raise BadInput("a bandwidth cap needs a link: use link 'auto', 'netns' or 'token-bucket', not 'none'")
    if tap and (link == "netns" or (link == "auto" and bandwidth_mbit is not None)):
        raise BadInput("the recording TCP tap listens on loopback, outside any namespace: "
                       "with a tap, cap the links with link='token-bucket'")


def resolve_link(link: str, bandwidth_mbit: float | None) -> str:
    """The kind a cohort runs on: "auto" is netns-tc when capped and namespaces work, else the bucket."""
    if link == "none" or (link == "auto" and bandwidth_mbit is None):
        return LINK_NONE
    if link == "token-bucket":
        return LINK_TOKEN_BUCKET
    ok, why = netns_available()
    if link == "netns" and not ok:
        raise LinkError(f"link 'netns' was asked for, but {why}")
    return LINK_NETNS if ok else LINK_TOKEN_BUCKET


class CohortLinks:
    """One cohort's links: where each member starts, listens and connects, and whether it paces."""

    def __init__(self, kind: str, holders: tuple[str, ...], bandwidth_mbit: float | None) -> None:
        self.kind = kind
        self.bandwidth_mbit = bandwidth_mbit
        self.shaped: ShapedLinks | None = None
        if kind == LINK_NETNS:
            self.shaped = ShapedLinks(holders, hub=ORCHESTRATOR, bandwidth_mbit=bandwidth_mbit)

    def open(self) -> None:
        if self.shaped is not None:
            self.shaped.open()

    def close(self) -> None:
        if self.shaped is not None:
            self.shaped.close()

    def prefix(self, member: str) -> list[str]:
        return self.shaped.exec_prefix(member) if self.shaped is not None else []

    def netns_path(self, member: str) -> str | None:
        """A member's namespace file, for a child that enters it itself before it drops root."""
        return f"/var/run/netns/{self.shaped.namespace(member)}" if self.shaped is not None else None

    @property
    def listen_host(self) -> str:
        """Where the orchestrator's TLS listener binds, and holders reach it."""
        return self.shaped.address(ORCHESTRATOR) if self.shaped is not None else LOOPBACK

    @property
    def pace_mbit(self) -> float | None:
        return self.bandwidth_mbit if self.kind == LINK_TOKEN_BUCKET else None

