"""How a cohort's data holders reach its orchestrator: the link each TLS connection runs on.

Three kinds, and every result names the one it ran on (:attr:`CohortLinks.kind`):

* ``"netns-tc"`` (:data:`~gputravel.net.shaped.LINK_NETNS`): each holder and the orchestrator
  run inside their own network namespace of a :class:`~gputravel.net.shaped.ShapedLinks`
  star, capped in the kernel (tc tbf, both directions). The orchestrator's TLS listener binds
  the hub's address; holders connect to it through their shaped veth.
* ``"token-bucket"`` (:data:`~gputravel.net.shaped.LINK_TOKEN_BUCKET`): every process stays on
  loopback and each end of each holder<->orchestrator TLS connection paces what it sends with
  its own :class:`~gputravel.net.shaped.TokenBucket` (the fallback where namespaces are
  unavailable; each party paces itself with net/pace.py).
* ``"none"``: loopback, no cap (what a cohort did before links existed).

``link="auto"`` picks netns-tc when there is a cap and namespaces work, the token bucket when
there is a cap and they do not, and none without a cap. Host and device always stay in the
root namespace: they are reached by Unix socket path, which namespaces do not change.
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
    """Validate a cohort's link settings without building anything."""
    if link not in LINK_CHOICES:
        raise BadInput(f"link must be one of {', '.join(LINK_CHOICES)}, not {link!r}")
    check_bandwidth(bandwidth_mbit)  # the same limits the links themselves apply, before anything boots
    if link == "none" and bandwidth_mbit is not None:
        raise BadInput("a bandwidth cap needs a link: use link 'auto', 'netns' or 'token-bucket', not 'none'")
    if tap and (link == "netns" or (link == "auto" and bandwidth_mbit is not None)):
        raise BadInput("the recording TCP tap listens on loopback, outside any namespace: "
                       "with a tap, cap the links with link='token-bucket'")


def resolve_link(link: str, bandwidth_mbit: float | None) -> str:
    """The kind of link a cohort with these settings runs on (netns-tc, token-bucket or none)."""
    if link == "none" or (link == "auto" and bandwidth_mbit is None):
        return LINK_NONE
    if link == "token-bucket":
        return LINK_TOKEN_BUCKET
    ok, why = netns_available()
    if link == "netns" and not ok:
        raise LinkError(f"link 'netns' was asked for, but {why}")
    return LINK_NETNS if ok else LINK_TOKEN_BUCKET


class CohortLinks:
    """The links of one cohort: where to start each member, where to listen and connect, and
    whether the TLS ends pace themselves. ``open`` builds namespaces (netns-tc only);
    ``close`` deletes them, after the supervisor has reaped the processes inside."""

    def __init__(self, kind: str, holders: tuple[str, ...], bandwidth_mbit: float | None) -> None:
        self.kind = kind
        self.bandwidth_mbit = bandwidth_mbit
        self.shaped: ShapedLinks | None = None
        if kind == LINK_NETNS:
            self.shaped = ShapedLinks(holders, hub=ORCHESTRATOR, bandwidth_mbit=bandwidth_mbit)

    @classmethod
    def for_cohort(cls, link: str, holders: tuple[str, ...], bandwidth_mbit: float | None) -> CohortLinks:
        return cls(resolve_link(link, bandwidth_mbit), holders, bandwidth_mbit)

    def open(self) -> None:
        if self.shaped is not None:
            self.shaped.open()

    def close(self) -> None:
        """Delete the namespaces (idempotent); raises LinkError if any is left behind."""
        if self.shaped is not None:
            self.shaped.close()

    def prefix(self, member: str) -> list[str]:
        """What to put before a member's argv so that it starts on its side of the link."""
        return self.shaped.exec_prefix(member) if self.shaped is not None else []

    def netns_path(self, member: str) -> str | None:
        """The file of a member's network namespace, for a child that enters it itself
        (setns) before it drops root; None without namespaces."""
        return f"/var/run/netns/{self.shaped.namespace(member)}" if self.shaped is not None else None

    @property
    def listen_host(self) -> str:
        """Where the orchestrator's TLS listener binds."""
        return self.shaped.address(ORCHESTRATOR) if self.shaped is not None else LOOPBACK

    @property
    def connect_host(self) -> str:
        """Where holders reach the orchestrator."""
        return self.listen_host

    @property
    def pace_mbit(self) -> float | None:
        """The rate each TLS end paces itself to (token-bucket links only)."""
        return self.bandwidth_mbit if self.kind == LINK_TOKEN_BUCKET else None

