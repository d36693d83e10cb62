"""The confidential GPU as its own OS process: VRAM (a memfd only the orchestrator gets), BAR0
and the doorbell (for the host to hand out), and the DMA window and interrupt attached last.

Its link to the orchestrator is inherited, or, as a service, each connection on `link_socket`
from `link_uid` (SO_PEERCRED; -1: any), the newest replacing the older; any other uid is hung up
on before it can ask for VRAM.
"""

from __future__ import annotations

import logging
import mmap
import os
import selectors
import socket
import stat
import struct
import time
from contextlib import suppress
from dataclasses import dataclass

from gputravel.attest.gpu import EmulatedGpuFirmware
from gputravel.crypto.device_identity import DeviceIdentity
from gputravel.errors import BadInput, PeerTimeout, ProtocolError, TransportClosed
from gputravel.protocol.layout import Bar0, Layout
from gputravel.protocol.host import AttachCvm, DeviceAck, DeviceAttach
from gputravel.protocol.device import VramGrant, VramRequest
from gputravel.transport.base import close_fds
from gputravel.transport.stream import StreamTransport
from gputravel.transport.unix import connect_unix, listen_unix
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
    link_socket: str = ""  # listen here for the orchestrator's link instead of inheriting it
    link_uid: int = -1  # the only uid whose connection becomes the link; -1: any (no isolation)


log = logging.getLogger(__name__)
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_LISTENER = "link-listener"


def _listen_link(path: str, uid_checked: bool) -> socket.socket:
    """The link's listener at `path`, replacing a previous device's socket (the gpu service's boot
    lock keeps two devices from sharing a path)."""
    with suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    listener = listen_unix(path)
    # With a uid to check, SO_PEERCRED decides whose connection becomes the link; without, 0600.
    os.chmod(path, 0o666 if uid_checked else 0o600)
    listener.setblocking(False)
    return listener


def memfd(name: str, size: int, populate: bool) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    return fd, mmap.mmap(fd, size, flags=flags)


class DeviceProcess:
    def __init__(self, config: DeviceConfig, identity: DeviceIdentity,
                 orchestrator_link: socket.socket | None = None,
                 firmware: EmulatedGpuFirmware | None = None) -> None:
        if (orchestrator_link is None) == (not config.link_socket):
            raise BadInput("the device takes its orchestrator link either inherited or on link_socket: one of them")
        self.config = config
        # Populated up front, as real VRAM is: first-touch faults would be charged to the first travel.
        self.vram_fd, self.vram = memfd("gputravel-vram", config.vram_bytes, populate=True)
        self.bar_fd, self.bar = memfd("gputravel-bar0", Bar0.size(config.layout), populate=True)
        self.doorbell = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self.core = DeviceCore(config.layout, memoryview(self.vram), memoryview(self.bar), identity,
                               serial=config.serial, firmware=firmware)
        self.core.on_interrupt = self._interrupt
        self._irq_fd: int | None = None
        self._segments: dict[tuple[int, int, int], tuple[mmap.mmap, memoryview]] = {}
        self.host = connect_unix(config.host_socket, "host")
        self.orchestrator: StreamTransport | None = None
        self.listener: socket.socket | None = None
        if orchestrator_link is not None:
            self.orchestrator = StreamTransport(orchestrator_link, "orchestrator-link")
        else:  # listening before the service says it is up, so the orchestrator can connect at once
            self.listener = _listen_link(config.link_socket, config.link_uid >= 0)

    def _interrupt(self) -> None:
        if self._irq_fd is not None:
            os.eventfd_write(self._irq_fd, 1)

    def serve(self) -> None:
        self.host.send(DeviceAttach(serial=self.config.serial, bar_bytes=len(self.bar)), fds=(self.bar_fd, self.doorbell))
        sel = selectors.DefaultSelector()
        sel.register(self.doorbell, selectors.EVENT_READ, "doorbell")
        sel.register(self.host.fileno(), selectors.EVENT_READ, "host")
        if self.orchestrator is not None:
            sel.register(self.orchestrator.fileno(), selectors.EVENT_READ, self.orchestrator)
        if self.listener is not None:
            sel.register(self.listener.fileno(), selectors.EVENT_READ, _LISTENER)
        try:
            self._loop(sel)
        finally:
            if self.listener is not None:
                self.listener.close()

    def _loop(self, sel: selectors.BaseSelector) -> None:
        last_work = 0.0
        while True:
            # Poll a moment after work (as KVM halt-polling does): waking costs more than the next step.
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
                elif key.data == _LISTENER:
                    self._accept_link(sel)
                elif key.data is self.orchestrator:  # not a link replaced earlier in this batch
                    self._orchestrator_message(sel)

    def _host_message(self) -> bool:
        try:
            got = self.host.recv(timeout=10)
        except TransportClosed:
            return False  # the host went away: power off
        except (ProtocolError, PeerTimeout):
            return True  # garbage or a stalled frame from the (untrusted) host: ignore it, keep serving
        msg = got.message
        if not isinstance(msg, AttachCvm) or len(got.fds) != 2:
            close_fds(got.fds)  # not an attach of exactly a memory segment and an interrupt: ignored
            return True
        sysmem_fd, irq_fd = got.fds
        try:
            view = self._map_segment(sysmem_fd, msg.nbytes)
        except (OSError, ValueError, OverflowError):  # a size or descriptor that cannot be mapped
            os.close(irq_fd)
            return True
        finally:
            os.close(sysmem_fd)
        self.core.attach(DmaWindow(msg.cvm, msg.iova, view))
        old_irq, self._irq_fd = self._irq_fd, irq_fd
        if old_irq is not None:
            os.close(old_irq)
        self.host.send(DeviceAck(cvm=msg.cvm))
        return True

    def _map_segment(self, fd: int, nbytes: int) -> memoryview:
        """Map a CVM segment the host attaches, reusing a mapping seen before: the IOMMU replay's page
        tables, a millisecond a switch otherwise. Only the window attached last is reachable."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, nbytes)
        cached = self._segments.get(key)
        if cached is None:
            mem = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            cached = self._segments[key] = (mem, memoryview(mem))
        return cached[1]

    def _accept_link(self, sel: selectors.BaseSelector) -> None:
        assert self.listener is not None
        try:
            sock, _ = self.listener.accept()
        except OSError:  # gone before we looked, or out of descriptors: keep serving
            return
        pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        if self.config.link_uid >= 0 and uid != self.config.link_uid:
            log.warning("device: refused a link from pid %d uid %d (only uid %d holds the link)",
                        pid, uid, self.config.link_uid)
            sock.close()
            return
        self._drop_link(sel)
        self.orchestrator = StreamTransport(sock, "orchestrator-link")
        sel.register(self.orchestrator.fileno(), selectors.EVENT_READ, self.orchestrator)

    def _drop_link(self, sel: selectors.BaseSelector) -> None:
        if self.orchestrator is not None:
            sel.unregister(self.orchestrator.fileno())
            self.orchestrator.close()
            self.orchestrator = None

    def _orchestrator_message(self, sel: selectors.BaseSelector) -> None:
        link = self.orchestrator
        assert link is not None
        try:
            got = link.recv(timeout=10)
            close_fds(got.fds)
            if isinstance(got.message, VramRequest):
                link.send(VramGrant(vram_bytes=len(self.vram)), fds=(self.vram_fd,))
        except TransportClosed:
            self._drop_link(sel)  # the orchestrator is gone; the device serves on (and, listening, waits)
        except (ProtocolError, PeerTimeout):
            if self.listener is None:
                raise  # an inherited link cannot be replaced: as before, the device stops
            self._drop_link(sel)  # a listening device drops a broken link; a reconnect brings a new one


