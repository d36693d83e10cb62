"""A CVM's view of the GPU's PCIe link: its reserved unprotected memory, BAR0, doorbell, interrupt.

At boot the driver reserves unprotected memory (a memfd standing for the CVM's shared,
unencrypted pages: the host can read it, the device reaches it only while the PCIe MUX maps
it), creates its interrupt endpoint (an eventfd), and registers both with the host. The host
hands back BAR0 and the doorbell, which stay mapped in every CVM (paper 5.1).
"""

from __future__ import annotations

import mmap
import os
import select
from dataclasses import dataclass

from ..errors import ProtocolError
from ..layout import SYSMEM_IOVA, Layout
from ..messages import HostError, RegisterCvm, Registered, SwitchRequest, Switched
from ..transport.base import Transport


@dataclass
class DeviceLink:
    cvm: str
    layout: Layout
    sysmem_fd: int
    sysmem: mmap.mmap
    bar: mmap.mmap
    doorbell_fd: int
    irq_fd: int

    def ring(self) -> None:
        os.eventfd_write(self.doorbell_fd, 1)

    def wait_interrupt(self, timeout: float) -> bool:
        """Block until the device interrupts this CVM (or ``timeout`` passes)."""
        ready, _, _ = select.select([self.irq_fd], [], [], max(timeout, 0.0))
        if ready:
            os.eventfd_read(self.irq_fd)
            return True
        return False

    def close(self) -> None:
        for m in (self.sysmem, self.bar):
            try:
                m.close()
            except BufferError:
                pass  # a view is still exported; the mapping goes with the process
        for fd in (self.sysmem_fd, self.doorbell_fd, self.irq_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def reserve_sysmem(cvm: str, layout: Layout) -> tuple[int, mmap.mmap]:
    """Reserve this CVM's unprotected memory at boot (one segment, fixed slots inside)."""
    fd = os.memfd_create(f"gputravel-sysmem-{cvm}", os.MFD_CLOEXEC)
    os.ftruncate(fd, layout.sysmem_bytes)
    mem = mmap.mmap(fd, layout.sysmem_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    return fd, mem


def register_with_host(host: Transport, cvm: str, layout: Layout, *, timeout: float = 10.0) -> DeviceLink:
    sysmem_fd, sysmem = reserve_sysmem(cvm, layout)
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


def request_switch(host: Transport, target: str, timeout: float) -> int:
    """Ask the host's PCIe MUX to route the GPU to ``target``; returns the host-measured ns."""
    host.send(SwitchRequest(target=target))
    reply = host.recv(timeout=timeout).message
    if not isinstance(reply, Switched) or reply.target != target:
        raise ProtocolError(f"host could not switch the GPU to {target}: {getattr(reply, 'reason', reply)}")
    return reply.elapsed_ns
