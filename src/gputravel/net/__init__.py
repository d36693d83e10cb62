"""Bandwidth-capped links between cohort members, like the paper's capped CVM virtio links.

Every result names the kind it ran on: ``LINK_NETNS`` (namespaces capped by tc in the kernel,
:mod:`.shaped`) or ``LINK_TOKEN_BUCKET`` (the in-process fallback, which caps what one sender
writes, not the wire: :mod:`.bucket`). See docs/links.md.
"""

from gputravel.net.bucket import LINK_TOKEN_BUCKET, PacedSocket, TokenBucket
from gputravel.net.iproute import LinkError
from gputravel.net.measure import RateCheck, Transfer, check_rate, transfer
from gputravel.net.namespaces import cleanup_stale, netem_available, netns_available
from gputravel.net.shaped import LINK_NETNS, ShapedLinks
from gputravel.net.tc import LinkShape, check_bandwidth, default_burst_bytes

__all__ = ["LINK_NETNS", "LINK_TOKEN_BUCKET", "LinkError", "LinkShape", "PacedSocket", "RateCheck", "ShapedLinks",
           "TokenBucket", "Transfer", "check_bandwidth", "check_rate", "cleanup_stale", "default_burst_bytes",
           "netem_available", "netns_available", "transfer"]
