"""Measuring a shaped link: a real TCP transfer between two namespaces, timed by the receiver."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass

from gputravel.processes import Children
from gputravel.errors import BadInput
from gputravel.net.iproute import LinkError
from gputravel.net.shaped import ShapedLinks

# The receiver times from accept to EOF, so interpreter start-up is never counted.
_SERVER = """
import hashlib, socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); t0 = time.monotonic(); h = hashlib.sha256(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b); h.update(b)
t1 = time.monotonic(); c.sendall(b"k"); c.close()
print(n, t1 - t0, h.hexdigest(), flush=True)
"""

# Pseudo-random bytes, so a dropped or reordered chunk changes the digest.
_CLIENT = """
import hashlib, random, socket, sys
addr, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = random.Random(n).randbytes(n)
c = socket.create_connection((addr, port), timeout=30); c.settimeout(None)
c.sendall(data); c.shutdown(socket.SHUT_WR); c.recv(1)
print(hashlib.sha256(data).hexdigest(), flush=True)
"""


@dataclass(frozen=True)
class Transfer:
    link: str
    src: str
    dst: str
    sent_bytes: int
    received_bytes: int
    seconds: float
    sent_sha256: str
    received_sha256: str

    @property
    def intact(self) -> bool:
        return self.sent_bytes == self.received_bytes and self.sent_sha256 == self.received_sha256

    @property
    def mbit_per_s(self) -> float:
        return self.received_bytes * 8 / self.seconds / 1e6 if self.seconds > 0 else math.inf


def transfer(links: ShapedLinks, src: str, dst: str, nbytes: int, *,
             timeout: float | None = None) -> Transfer:
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise BadInput(f"transfer size must be a positive number of bytes, got {nbytes!r}")
    if timeout is None:
        rate = links.shape.bandwidth_mbit or 1000.0
        timeout = 30.0 + 4 * nbytes * 8 / (rate * 1e6)
    with Children(0.0) as children:
        # -P: as root in the namespaces, never a module from the working directory (service/launch.py SERVE)
        argv = [*links.exec_prefix(dst), sys.executable, "-P", "-c", _SERVER, links.address(dst)]
        server = children.start("receiver", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        port = server.stdout.readline().strip() if server.stdout else ""
        if not port.isdigit():
            raise LinkError(f"receiver in {dst!r} did not start: {server.communicate()[1].strip()}")
        client = links.run(src, [sys.executable, "-P", "-c", _CLIENT, links.address(dst), port, str(nbytes)],
                           timeout=timeout)
        if client.returncode != 0:
            raise LinkError(f"sender in {src!r} failed: {client.stderr.decode().strip()}")
        out, err = server.communicate(timeout=timeout)
        if server.returncode != 0:
            raise LinkError(f"receiver in {dst!r} failed: {err.strip()}")
    got, seconds, digest = out.split()
    return Transfer(links.link, src, dst, nbytes, int(got), float(seconds), client.stdout.decode().strip(), digest)


@dataclass(frozen=True)
class RateCheck:
    """A capped transfer against the issue's target: time within ``tolerance`` of size/cap."""

    cap_mbit: float
    nbytes: int
    measured_mbit: float
    expected_s: float
    measured_s: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return abs(self.measured_s - self.expected_s) <= self.tolerance * self.expected_s


def check_rate(links: ShapedLinks, src: str, dst: str, nbytes: int, *,
               tolerance: float = 0.15) -> RateCheck:
    """One transfer's time against size/cap (frame bytes: TCP goodput sits ~4-5 % under it at MTU 1500)."""
    cap = links.shape.bandwidth_mbit
    if cap is None:
        raise BadInput("an uncapped link has no rate to check")
    t = transfer(links, src, dst, nbytes)
    if not t.intact:
        raise LinkError(f"transfer {src}->{dst} arrived damaged")
    return RateCheck(cap, nbytes, t.mbit_per_s, nbytes * 8 / (cap * 1e6), t.seconds, tolerance)
