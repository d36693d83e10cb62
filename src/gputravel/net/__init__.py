"""Bandwidth-capped links between cohort members, like the paper's capped CVM virtio links.

Two kinds of link exist, and every result must say which one it ran on:

* ``LINK_NETNS`` ("netns-tc"): :class:`ShapedLinks` (:mod:`.shaped`) puts each member in its
  own network namespace (:mod:`.namespaces`), wired as a star around the orchestrator's, and
  caps both directions of each holder's link with a kernel token bucket filter (:mod:`.tc`).
  :mod:`.measure` times real transfers over it.
* ``LINK_TOKEN_BUCKET`` ("token-bucket"): :class:`TokenBucket` and :func:`paced_socket`
  (:mod:`.bucket`) pace ``send`` in-process. It is the fallback where namespaces are
  unavailable (no root, no ``ip``, no ``sch_tbf``); it caps what one sender writes, not the wire.

Only ``ip`` (iproute2) and ``tc`` are used, always with argument lists, never a shell
(:mod:`.iproute`). See docs/links.md for the picture, the tc parameters and how to inspect a
live set-up.
"""

from gputravel.net.bucket import LINK_TOKEN_BUCKET, PacedSocket, TokenBucket, paced_socket
from gputravel.net.iproute import LinkError
from gputravel.net.measure import RateCheck, Transfer, check_rate, transfer
from gputravel.net.namespaces import cleanup_stale, netem_available, netns_available
from gputravel.net.shaped import LINK_NETNS, ShapedLinks
from gputravel.net.tc import LinkShape, check_bandwidth, default_burst_bytes

__all__ = [
    "LINK_NETNS",
    "LINK_TOKEN_BUCKET",
    "LinkError",
    "LinkShape",
    "PacedSocket",
    "RateCheck",
    "ShapedLinks",
    "TokenBucket",
    "Transfer",
    "check_bandwidth",
    "check_rate",
    "cleanup_stale",
    "default_burst_bytes",
    "netem_available",
    "netns_available",
    "paced_socket",
    "transfer",
]
