"""Network namespaces: whether they work here, and deleting them. Each is named
gt-<owner pid, hex>-..., so a crashed run's (owner dead) can be told from a live run's."""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import time

from gputravel.errors import BadInput
from gputravel.net.iproute import LinkError, run_iproute

NS_PREFIX = "gt-"
_NS_RE = re.compile(r"^gt-([0-9a-f]+)-")
BRIDGE = "gt-br"  # the hub's bridge (also built by the probe)


def _namespace_pids(ns: str) -> list[int]:
    out = run_iproute(["ip", "netns", "pids", ns], check=False).stdout
    return [int(tok) for tok in out.split() if tok.isdigit()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def delete_namespace(ns: str) -> None:
    """Kill what still runs inside (it would keep the namespace and its veths alive), then delete."""
    pids = _namespace_pids(ns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # Ask the kernel, not the pids: a killed child of ours stays a zombie, yet has left the namespace.
    deadline = time.monotonic() + 5.0
    while pids and _namespace_pids(ns) and time.monotonic() < deadline:
        time.sleep(0.02)
    run_iproute(["ip", "netns", "delete", ns])


def cleanup_stale(prefix: str = NS_PREFIX) -> list[str]:
    """Delete (and return) our namespaces whose owner is dead; a live run's are left alone."""
    if not prefix.startswith(NS_PREFIX):
        raise BadInput(f"prefix must start with {NS_PREFIX!r}, got {prefix!r}")
    removed = []
    for line in run_iproute(["ip", "netns", "list"]).stdout.splitlines():  # "name" or "name (id: 3)"
        ns = line.split()[0] if line.strip() else ""
        m = _NS_RE.match(ns)
        if not ns.startswith(prefix) or m is None or _pid_alive(int(m.group(1), 16)):
            continue
        delete_namespace(ns)
        removed.append(ns)
    return removed


# ----------------------------------------------------------------------------- probe
@functools.cache
def netns_available() -> tuple[bool, str]:
    """Whether ShapedLinks work here (a throwaway namespace, bridge, veth and tbf), and why not."""
    if os.geteuid() != 0:
        return False, "network namespaces need root (euid is not 0)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"{tool!r} (iproute2) is not installed"
    why = _probe("probe", "tbf", "rate", "20mbit", "burst", "32768", "latency", "100ms")
    return (False, why) if why else (True, "network namespaces, veth, bridge and tc tbf are available")


@functools.cache
def netem_available() -> bool:
    """Whether the kernel has sch_netem, needed only for ``delay_ms`` > 0."""
    return netns_available()[0] and not _probe("probenetem", "netem", "delay", "1ms")


def _probe(name: str, *qdisc: str) -> str:
    """Why a throwaway namespace cannot take a veth pair, a bridge and `qdisc` ("": it can)."""
    ns = f"{NS_PREFIX}{os.getpid():x}-{name}"
    try:
        run_iproute(["ip", "netns", "add", ns])
    except LinkError as e:
        return f"cannot create a network namespace: {e}"
    try:
        run_iproute(["ip", "-n", ns, "link", "add", "gt-a", "type", "veth", "peer", "name", "gt-b"])
        run_iproute(["ip", "-n", ns, "link", "add", BRIDGE, "type", "bridge"])
        run_iproute(["tc", "-n", ns, "qdisc", "add", "dev", "gt-a", "root", *qdisc])
    except LinkError as e:
        return f"veth, bridge or tc {qdisc[0]} unavailable: {e}"
    finally:
        run_iproute(["ip", "netns", "delete", ns], check=False)
    return ""
