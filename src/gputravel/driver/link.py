"""A CVM's view of the GPU's PCIe link: its unprotected memory (a memfd the host can read),
interrupt eventfd, and the BAR0 and doorbell the host hands back at registration (paper 5.1)."""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import time
from collections import deque
from dataclasses import dataclass

from gputravel.errors import PeerTimeout, ProtocolError
from gputravel.protocol.layout import SYSMEM_IOVA, Layout
from gputravel.protocol.host import Attached, HostError, RegisterCvm, Registered, SwitchRequest, Switched
from gputravel.transport.base import Transport


@dataclass
class DeviceLink:
    cvm: str
    layout: Layout
    sysmem_fd: int
    sysmem: mmap.mmap
    bar: mmap.mmap
    doorbell_fd: int
    irq_fd: int
    spin_s: float = 0.001  # how long Driver waits poll (yielding) before sleeping on the interrupt

    def ring(self) -> None:
        os.eventfd_write(self.doorbell_fd, 1)

    def wait_interrupt(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.irq_fd], [], [], max(timeout, 0.0))
        if ready:
            os.eventfd_read(self.irq_fd)
        return bool(ready)

    def close(self) -> None:
        for m in (self.sysmem, self.bar):
            with contextlib.suppress(BufferError):  # a view is still exported: it goes with the process
                m.close()
        for fd in (self.sysmem_fd, self.doorbell_fd, self.irq_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def register_with_host(host: Transport, cvm: str, layout: Layout, *, timeout: float = 10.0) -> DeviceLink:
    sysmem_fd = os.memfd_create(f"gputravel-sysmem-{cvm}", os.MFD_CLOEXEC)
    os.ftruncate(sysmem_fd, layout.sysmem_bytes)
    sysmem = mmap.mmap(sysmem_fd, layout.sysmem_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    irq_fd = os.eventfd(0, os.EFD_CLOEXEC)
    host.send(RegisterCvm(cvm=cvm, iova=SYSMEM_IOVA, nbytes=layout.sysmem_bytes), fds=(sysmem_fd, irq_fd))
    reply = host.recv(timeout=timeout)
    if isinstance(reply.message, HostError):
        raise ProtocolError(f"host refused registration of {cvm}: {reply.message.reason}")
    if not isinstance(reply.message, Registered) or len(reply.fds) != 2:
        raise ProtocolError("host sent an unexpected reply to registration")
    bar_fd, doorbell_fd = reply.fds
    bar = mmap.mmap(bar_fd, reply.message.bar_bytes, flags=mmap.MAP_SHARED)
    os.close(bar_fd)
    return DeviceLink(cvm, layout, sysmem_fd, sysmem, bar, doorbell_fd, irq_fd)


class PcieMuxClient:
    """This CVM's requests to the host's PCIe MUX, answered in order, and its ``Attached`` notices: one
    older than our last reply is skipped, so a late notice never passes for this switch."""

    def __init__(self, host: Transport, cvm: str) -> None:
        self.host, self.cvm = host, cvm
        self._pending: deque[str] = deque()
        self._seq = 0  # the MUX's switch number in the last reply or notice we took
        self._notice: Attached | None = None  # taken while waiting for a reply, not yet used

    def request(self, target: str) -> None:
        self.host.send(SwitchRequest(target=target))
        self._pending.append(target)

    def switched(self, timeout: float) -> Switched:
        """The reply to the oldest request not yet answered."""
        if not self._pending:
            raise ProtocolError("no switch request is waiting for a reply")
        target = self._pending[0]  # answered in order; it stays pending if its reply is late
        deadline = time.monotonic() + timeout
        while isinstance(reply := self._next(deadline - time.monotonic(), f"the switch to {target}"), Attached):
            self._keep(reply)
        self._pending.popleft()
        if not isinstance(reply, Switched) or reply.target != target:
            raise ProtocolError(f"host could not switch the GPU to {target}: {getattr(reply, 'reason', reply)}")
        self._seq = max(self._seq, reply.seq)
        return reply

    def switch(self, target: str, timeout: float) -> Switched:
        """Ask and wait, answering any earlier requests first."""
        self.request(target)
        while len(self._pending) > 1:
            self.switched(timeout)
        return self.switched(timeout)

    def attached(self, timeout: float) -> Attached:
        """Wait until another CVM's switch made the GPU ours (newer than our last reply)."""
        if self._pending:
            raise ProtocolError("a switch this CVM asked for is still unanswered")
        deadline = time.monotonic() + timeout
        msg: object
        msg, self._notice = self._notice, None  # first a notice kept while waiting for a reply
        while True:  # skipping an older notice, or a reply to nothing: not ours to act on
            if isinstance(msg, Attached) and msg.target == self.cvm and msg.seq > self._seq:
                self._seq = msg.seq
                return msg
            if isinstance(msg, HostError):
                raise ProtocolError(f"host error while waiting for the GPU: {msg.reason}")
            msg = self._next(deadline - time.monotonic(), "the GPU to be switched to us")

    def _keep(self, notice: Attached) -> None:
        if notice.target == self.cvm and (self._notice is None or notice.seq > self._notice.seq):
            self._notice = notice

    def _next(self, timeout: float, what: str) -> object:
        if timeout <= 0:
            raise PeerTimeout(f"host did not answer in time (waiting for {what})")
        return self.host.recv(timeout=timeout).message
