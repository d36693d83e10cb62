"""The untrusted host as its own OS process: the hypervisor side of the PCIe MUX. It holds BAR0,
the doorbell and each CVM's DMA segment and interrupt, never VRAM; with ``snoop`` it reads every
CVM's unprotected memory, so tests can show it holds no plaintext. What it hands out and where a
switch goes pass through its :class:`HostHooks` (honest: :class:`NoHooks`; or the red team's).
"""

from __future__ import annotations

import mmap
import os
import selectors
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gputravel.errors import BadInput, GputravelError, PeerTimeout, ProtocolError, TransportClosed
from gputravel.protocol.host import AttachCvm, DeviceAck, DeviceAttach, HostError, RegisterCvm, Registered, Switched
from gputravel.transport.base import Transport, close_fds
from gputravel.transport.stream import StreamTransport
from gputravel.transport.unix import listen_unix
from gputravel.host.mux import CvmRegistration, PcieMux, SwitchPlan, answer, notice
from gputravel.protocol.hardware import hardware_profile, hold_until


@dataclass(frozen=True)
class HostConfig:
    socket_path: str
    snoop_path: str | None = None  # where the snooper appends what it reads
    snoop_limit_bytes: int = 256 << 20
    switch_timeout: float = 10.0
    hardware: str = "emulated"  # protocol/hardware.py: a profile may hold each switch for its hardware's time
    outlive_device: bool = False  # a deployed host (service/) waits for a restarted GPU; the launcher's stops


class Snooper(threading.Thread):
    """The malicious-hypervisor view: copies every CVM's unprotected memory, again and again."""

    def __init__(self, path: str, limit: int) -> None:
        super().__init__(daemon=True, name="snooper")
        self._path, self._limit = Path(path), limit
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.written = 0

    def watch(self, reg: CvmRegistration) -> None:
        with self._lock:
            self._maps[reg.cvm] = mmap.mmap(reg.sysmem_fd, reg.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)

    def run(self) -> None:
        with open(self._path, "ab") as out:
            while not self._stop.is_set() and self.written < self._limit:
                with self._lock:
                    for mem in self._maps.values():
                        out.write(mem[:])
                        self.written += len(mem)
                time.sleep(0.001)

    def stop(self) -> None:
        self._stop.set()


# ----------------------------------------------------------------------------- the hooks
class HostHooks(Protocol):
    """What the host loop lets a hook decide: which doorbell a CVM gets, where a switch goes."""

    def on_serve(self, host: HostProcess, sel: selectors.BaseSelector) -> None:
        """The loop starts; a hook may add endpoints to ``sel`` whose data, a callable, runs when readable."""

    def on_register(self, reg: CvmRegistration, doorbell: int) -> int:
        """The doorbell descriptor to hand a CVM that registered (``doorbell``: the device's own)."""

    def on_switch(self, requester: str, plan: SwitchPlan) -> tuple[CvmRegistration, CvmRegistration]:
        """The CVM whose DMA range the device gets, and the one its interrupt goes to, for a switch."""


class NoHooks:
    """The honest host: it hands out what it holds and switches where it is asked."""

    def on_serve(self, host: HostProcess, sel: selectors.BaseSelector) -> None:
        pass

    def on_register(self, reg: CvmRegistration, doorbell: int) -> int:
        return doorbell

    def on_switch(self, requester: str, plan: SwitchPlan) -> tuple[CvmRegistration, CvmRegistration]:
        return plan.target, plan.target


# ----------------------------------------------------------------------------- the process
class HostProcess:
    def __init__(self, config: HostConfig, hooks: HostHooks | None = None) -> None:
        self.config = config
        self.hooks: HostHooks = hooks if hooks is not None else NoHooks()
        self.mux = PcieMux()
        self.profile = hardware_profile(config.hardware)
        self.device: Transport | None = None
        self.device_fds: tuple[int, int] | None = None  # BAR0 and the device's own doorbell, to hand out
        self.bar_bytes = 0
        self._listener = listen_unix(config.socket_path)
        # CVMs of other uids connect to it; the directory it lies in decides who can reach it.
        os.chmod(config.socket_path, 0o666)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._snooper = Snooper(config.snoop_path, config.snoop_limit_bytes) if config.snoop_path else None
        self._cvm_of: dict[Transport, str] = {}  # which CVM registered over which connection
        self._conn_of: dict[str, Transport] = {}  # and the other way: where to tell a CVM it has the GPU

    def serve(self) -> None:
        if self._snooper:
            self._snooper.start()
        self.hooks.on_serve(self, self._sel)
        try:
            while True:
                for key, _ in self._sel.select():
                    if key.data is None:
                        conn, _ = self._listener.accept()
                        peer = StreamTransport(conn, "peer")
                        self._sel.register(peer.fileno(), selectors.EVENT_READ, peer)
                    elif callable(key.data):  # the hooks' own endpoints
                        key.data()
                    elif not self._serve_one(key.data):
                        self._sel.unregister(key.data.fileno())
                        self._forget(key.data)
                        key.data.close()
                        if key.data is self.device:
                            if not self.config.outlive_device:
                                return  # the GPU is gone: nothing left to multiplex
                            self._device_gone()
        finally:
            if self._snooper:
                self._snooper.stop()
                self._snooper.join(timeout=1)

    def _device_gone(self) -> None:
        """Forget the GPU that left, its BAR0 and doorbell with it, until one attaches again."""
        close_fds(self.device_fds or ())
        self.device, self.device_fds, self.bar_bytes = None, None, 0

    def _serve_one(self, peer: Transport) -> bool:
        try:
            got = peer.recv(timeout=self.config.switch_timeout)
        except (TransportClosed, ProtocolError, PeerTimeout):
            return False  # drop a peer that sends garbage or stalls mid-frame; keep serving the others
        try:
            answer = self._answer(peer, got.message, got.fds)
        except GputravelError as exc:
            answer = HostError(reason=str(exc)), ()
        if answer is None:
            return True
        reply, fds = answer
        try:
            peer.send(reply, fds=fds)
        except (TransportClosed, PeerTimeout):
            return False  # the peer hung up (or stalled) before our answer: drop it, serve the others
        if isinstance(reply, Switched):
            self._notify(peer, reply)
        return True

    def _answer(self, peer: Transport, msg: object, fds: tuple[int, ...]) -> tuple[object, tuple[int, ...]] | None:
        """What to send back to ``peer`` (and with which descriptors); None: nothing."""
        if isinstance(msg, DeviceAttach):
            self._attach_device(peer, msg, fds)
            return None
        if isinstance(msg, RegisterCvm):
            return self._register(peer, msg, fds)
        close_fds(fds)  # nothing else carries descriptors we keep
        return answer(self.mux, msg, lambda plan: self._switch(plan, self._cvm_of.get(peer, ""))), ()

    def _attach_device(self, peer: Transport, msg: DeviceAttach, fds: tuple[int, ...]) -> None:
        if len(fds) != 2:
            close_fds(fds)
            raise BadInput("device attach needs BAR0 and doorbell descriptors")
        self.device, self.device_fds, self.bar_bytes = peer, (fds[0], fds[1]), msg.bar_bytes

    def _register(self, peer: Transport, msg: RegisterCvm, fds: tuple[int, ...]) -> tuple[Registered, tuple[int, int]]:
        if len(fds) != 2 or self.device_fds is None:
            close_fds(fds)
            raise BadInput("CVM registration needs its sysmem and interrupt descriptors" if len(fds) != 2
                           else "no device is attached yet")
        reg = CvmRegistration(msg.cvm, msg.iova, msg.nbytes, fds[0], fds[1])
        old = self.mux.register(reg)
        if old is not None:
            close_fds((old.sysmem_fd, old.irq_fd))
        if self._snooper:
            self._snooper.watch(reg)
        self._cvm_of[peer] = msg.cvm
        self._conn_of[msg.cvm] = peer
        bar, doorbell = self.device_fds
        return Registered(bar_bytes=self.bar_bytes), (bar, self.hooks.on_register(reg, doorbell))

    def _forget(self, peer: Transport) -> None:
        cvm = self._cvm_of.pop(peer, None)
        if cvm is not None and self._conn_of.get(cvm) is peer:
            del self._conn_of[cvm]

    def _notify(self, requester: Transport, done: Switched) -> None:
        told = self._conn_of.get(done.target)
        if told is not None and told is not requester:
            with suppress(GputravelError):  # a CVM that went away: the selector drops it
                told.send(notice(done))

    def _switch(self, plan: SwitchPlan, requester: str) -> int:
        started = time.perf_counter_ns()
        self.attach(*self.hooks.on_switch(requester, plan))
        hold_until(started / 1e9, self.profile.switch_s(plan.target.cvm))  # busy as long as the hardware's switch
        return time.perf_counter_ns() - started

    def attach(self, dma: CvmRegistration, irq: CvmRegistration) -> None:
        """Map ``dma``'s unprotected memory for the device, route its interrupt to ``irq`` (the same
        CVM unless the host is malicious)."""
        if self.device is None:
            raise BadInput("no device is attached")
        self.device.send(AttachCvm(cvm=dma.cvm, iova=dma.iova, nbytes=dma.nbytes), fds=(dma.sysmem_fd, irq.irq_fd))
        ack = self.device.recv(timeout=self.config.switch_timeout).message
        if not isinstance(ack, DeviceAck) or ack.cvm != dma.cvm:
            raise BadInput("device did not acknowledge the switch")
