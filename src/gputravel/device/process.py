"""The confidential GPU as its own OS process.

It owns VRAM (a memfd it hands only to the orchestrator, over their private link), BAR0 and
the doorbell (handed to the host, which maps them into every CVM), and whatever DMA window
and interrupt endpoint the host's PCIe MUX attached last.
"""

from __future__ import annotations

import mmap
import os
import selectors
import socket
import time
from dataclasses import dataclass

from gputravel.attest.gpu import EmulatedGpuFirmware
from gputravel.crypto.device_identity import DeviceIdentity
from gputravel.crypto.spdm import SpdmResponder
from gputravel.errors import PeerTimeout, ProtocolError, TransportClosed
from gputravel.protocol.layout import Bar0, Layout
from gputravel.protocol.host import AttachCvm, DeviceAck, DeviceAttach
from gputravel.protocol.device import VramGrant, VramRequest
from gputravel.transport.stream import StreamTransport
from gputravel.transport.unix import connect_unix
from gputravel.device.core import DeviceCore
from gputravel.device.memory import DmaWindow


@dataclass(frozen=True)
class DeviceConfig:
    host_socket: str
    vram_bytes: int
    layout: Layout
    serial: str = "GPU-EMU-0"
    gpu_dir: str = ""  # the GPU's firmware state; the device makes its firmware key and stores its chain here
    poll_window: float = 0.005  # seconds of polling after the last work before sleeping


def _memfd(name: str, size: int, populate: bool) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    return fd, mmap.mmap(fd, size, flags=flags)


class DeviceProcess:
    def __init__(self, config: DeviceConfig, identity: DeviceIdentity, orchestrator_link: socket.socket,
                 firmware: EmulatedGpuFirmware | None = None) -> None:
        self.config = config
        # VRAM is populated up front: real VRAM is physically there, and first-touch page
        # faults would otherwise be charged to the first travel.
        self.vram_fd, self.vram = _memfd("gputravel-vram", config.vram_bytes, populate=True)
        self.bar_fd, self.bar = _memfd("gputravel-bar0", Bar0.size(config.layout), populate=True)
        self.doorbell = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self.core = DeviceCore(
            config.layout,
            memoryview(self.vram),
            memoryview(self.bar),
            lambda: SpdmResponder(identity.private_key, identity.chain_der),
            serial=config.serial,
            firmware=firmware,
        )
        self.core.on_interrupt = self._interrupt
        self._irq_fd: int | None = None
        self._segments: dict[tuple[int, int, int], tuple[mmap.mmap, memoryview]] = {}
        self.host = connect_unix(config.host_socket, "host")
        self.orchestrator = StreamTransport(orchestrator_link, "orchestrator-link")

    def _interrupt(self) -> None:
        if self._irq_fd is not None:
            os.eventfd_write(self._irq_fd, 1)

    def serve(self) -> None:
        self.host.send(DeviceAttach(serial=self.config.serial, bar_bytes=len(self.bar)), fds=(self.bar_fd, self.doorbell))
        sel = selectors.DefaultSelector()
        sel.register(self.doorbell, selectors.EVENT_READ, "doorbell")
        sel.register(self.host.fileno(), selectors.EVENT_READ, "host")
        sel.register(self.orchestrator.fileno(), selectors.EVENT_READ, "orchestrator")
        last_work = 0.0
        while True:
            # Like GPU firmware (and KVM halt-polling), keep polling for a moment after work
            # before sleeping: a travel's steps come in quick succession, and waking an idle
            # vCPU costs more than the whole step.
            hot = time.monotonic() - last_work < self.config.poll_window
            events = sel.select(timeout=0 if hot else None)
            if hot and not events:
                os.sched_yield()  # poll, but never hold the CPU from a CVM that has work
            if events:
                last_work = time.monotonic()
            for key, _ in events:
                if key.data == "doorbell":
                    try:
                        os.eventfd_read(self.doorbell)
                    except BlockingIOError:
                        continue
                    self.core.service()
                elif key.data == "host":
                    if not self._host_message():
                        return
                else:
                    self._orchestrator_message(sel)

    def _host_message(self) -> bool:
        try:
            got = self.host.recv(timeout=10)
        except TransportClosed:
            return False  # the host went away: power off
        except (ProtocolError, PeerTimeout):
            return True  # garbage or a stalled frame from the (untrusted) host: ignore it, keep serving
        msg = got.message
        if isinstance(msg, AttachCvm) and len(got.fds) != 2:
            for fd in got.fds:
                os.close(fd)
            return True  # an attach without exactly a memory segment and an interrupt: ignored
        if isinstance(msg, AttachCvm):
            sysmem_fd, irq_fd = got.fds
            try:
                view = self._map_segment(sysmem_fd, msg.nbytes)
            except (OSError, ValueError, OverflowError):  # a size or descriptor that cannot be mapped
                os.close(irq_fd)
                return True
            finally:
                os.close(sysmem_fd)
            self._replace_window(view, msg.cvm, msg.iova, irq_fd)
        else:
            for fd in got.fds:
                os.close(fd)
            return True
        self.host.send(DeviceAck(cvm=getattr(msg, "cvm", "")))
        return True

    def _map_segment(self, fd: int, nbytes: int) -> memoryview:
        """Map a CVM segment the host attaches, reusing the mapping of a segment seen before.

        This is the emulation's IOMMU page-table cache: the host replays saved mappings, and
        re-creating a populated mapping on every switch would cost a millisecond of page-table
        work that a real IOMMU replay does not have. What the device may touch is still only
        the window attached last (DeviceCore.attach); a detached segment is never reachable.
        """
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, nbytes)
        cached = self._segments.get(key)
        if cached is None:
            mem = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            cached = self._segments[key] = (mem, memoryview(mem))
        return cached[1]

    def _replace_window(self, view: memoryview | None, cvm: str, iova: int, irq_fd: int | None) -> None:
        self.core.attach(DmaWindow(cvm, iova, view) if view is not None else None)
        old_irq, self._irq_fd = self._irq_fd, irq_fd
        if old_irq is not None:
            os.close(old_irq)

    def _orchestrator_message(self, sel: selectors.BaseSelector) -> None:
        try:
            got = self.orchestrator.recv(timeout=10)
        except TransportClosed:
            sel.unregister(self.orchestrator.fileno())
            return
        for fd in got.fds:
            os.close(fd)
        if isinstance(got.message, VramRequest):
            self.orchestrator.send(VramGrant(vram_bytes=len(self.vram)), fds=(self.vram_fd,))


