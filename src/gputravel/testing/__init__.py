"""The emulated device and CVM drivers in one process, for tests and red-team drills: memory is
bytearrays and the doorbell runs the device at once; the rest is the real code::

    gpu = InProcessGpu()
    orch, holders = gpu.boot("alice", "bob")      # holders probe first, orchestrator last
    buf = orch.alloc_dataset_buffer(256 * 1024)
    back = gpu.travel(holders["alice"], data, buf)

:meth:`InProcessGpu.holder` refuses once a session exists (paper 4.1: a driver joins the RPC queue
where it stands); a drill builds a late one by hand (``Driver(gpu.add_cvm("mallory"))``). The
host's powers: :meth:`InProcessGpu.switch`, :meth:`snoop`, writes to ``link.sysmem`` and ``gpu.bar``,
and the hooks :attr:`FakeLink.before_service` and :attr:`FakeLink.while_waiting`.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from gputravel.crypto.device_identity import DeviceIdentity, make_device_identity
from gputravel.device.core import DeviceCore
from gputravel.device.memory import DmaWindow
from gputravel.driver.driver import Driver
from gputravel.driver.orchestrator import OrchestratorDriver
from gputravel.errors import BadInput, IllegalTransition
from gputravel.protocol.parties import ORCHESTRATOR
from gputravel.protocol.layout import SYSMEM_IOVA, Bar0, Layout
from gputravel.protocol.rpc import BufferInfo

if TYPE_CHECKING:
    from gputravel.attest.provision import GpuDevice

__all__ = ["FakeClock", "FakeLink", "InProcessGpu", "ORCHESTRATOR", "TEST_LAYOUT", "TIMEOUT_SCALE", "leaks",
           "renderings", "timeout_scale"]


def timeout_scale(raw: str | None) -> float:
    """GPUTRAVEL_TEST_TIMEOUT_SCALE: every test's waits scale by it (more time, never another verdict)."""
    if raw is None or raw == "":
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 1):
        raise BadInput(f"GPUTRAVEL_TEST_TIMEOUT_SCALE: expected a number of at least 1, got {raw!r}")
    return value


TIMEOUT_SCALE = timeout_scale(os.environ.get("GPUTRAVEL_TEST_TIMEOUT_SCALE"))

#: Small records and few slots, so multi-record copies and slot reuse happen with little data.
TEST_LAYOUT = Layout(record_bytes=64 * 1024, staging_slots=4, gpfifo_entries=16)


class FakeClock:
    """A clock that moves ``step`` seconds each read: a driver's timeout runs out in polls, not sleeps."""

    def __init__(self, start: float = 0.0, step: float = 1.0) -> None:
        self.now = start
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


class FakeLink:
    """One CVM's :class:`gputravel.driver.link.DeviceLink`, in process: its own ``sysmem``, the
    shared ``bar``; ``ring()`` services the device at once unless ``before_service`` returns False."""

    def __init__(self, gpu: InProcessGpu, cvm: str) -> None:
        self.gpu, self.cvm, self.layout = gpu, cvm, gpu.layout
        self.sysmem = bytearray(gpu.layout.sysmem_bytes)
        self.bar = gpu.bar
        #: ``hook(link)`` on every ring, before the device runs; False drops the doorbell.
        self.before_service: Callable[[FakeLink], bool | None] | None = None
        #: ``hook(link)`` each poll while the driver waits: a late device plays from here.
        self.while_waiting: Callable[[FakeLink], None] | None = None
        self.rings = 0
        self.closed = False
        self.spin_s = 0.0  # the device runs in process, on ring(): nothing to poll for

    def ring(self) -> None:
        self.rings += 1
        hook = self.before_service
        if hook is not None and hook(self) is False:
            return
        with self.gpu.lock:  # CVMs in threads of their own (testing/cohort.py) share the device
            self.gpu.core.service()

    def wait_interrupt(self, timeout: float) -> bool:
        """Always True: the device already ran (unless ``while_waiting`` runs it late)."""
        if self.while_waiting is not None:
            self.while_waiting(self)
        return True

    def close(self) -> None:
        self.closed = True

    def __repr__(self) -> str:
        return f"FakeLink({self.cvm!r})"


class InProcessGpu:
    """One emulated confidential GPU plus the host's PCIe MUX, all in this process."""

    def __init__(self, layout: Layout = TEST_LAYOUT, vram_bytes: int = 4 << 20, *, serial: str = "GPU-EMU-0",
                 clock: Callable[[], float] | None = None, device: GpuDevice | None = None,
                 vram: bytearray | mmap.mmap | None = None) -> None:
        """``device``: a provisioned GPU (attest.provision_gpu) for its chain and firmware; without
        one, a 2-certificate identity and no attestation. ``vram``: memory to use (default: its own)."""
        self.layout = layout
        self.vram = vram if vram is not None else bytearray(vram_bytes)
        self.bar = bytearray(Bar0.size(layout))
        if device is None:
            self.identity = make_device_identity(serial=serial)
        else:
            self.identity = DeviceIdentity(device.leaf_key, device.chain_der)
        self.core = DeviceCore(layout, memoryview(self.vram), memoryview(self.bar), self.identity, serial=serial,
                               firmware=device.firmware() if device is not None else None)
        #: Handed to every driver this harness builds.
        self.clock: Callable[[], float] = clock if clock is not None else FakeClock()
        self.links: dict[str, FakeLink] = {}
        self.current: str | None = None
        self.switches = 0
        self._orchestrator: OrchestratorDriver | None = None
        self.lock = threading.RLock()  # the device runs one doorbell or switch at a time

    # ------------------------------------------------------------------ CVMs and the MUX
    def add_cvm(self, name: str) -> FakeLink:
        """Boot a CVM: reserve its unprotected memory and return its link to the device."""
        if not name or name in self.links:
            raise BadInput(f"CVM name {name!r} is empty or already taken")
        link = self.links[name] = FakeLink(self, name)
        return link

    def switch(self, name: str | None) -> None:
        """The PCIe MUX: the device's DMA now reaches ``name``'s sysmem only (None: nobody)."""
        with self.lock:
            if name is None:
                self.core.attach(None)
            else:
                link = self.links.get(name)
                if link is None:
                    raise BadInput(f"unknown CVM {name!r} (registered: {', '.join(sorted(self.links)) or 'none'})")
                self.core.attach(DmaWindow(name, SYSMEM_IOVA, memoryview(link.sysmem)))
            self.current = name
            self.switches += 1

    def sysmem(self, name: str) -> bytearray:
        return self.links[name].sysmem

    def snoop(self) -> bytes:
        """What the untrusted host can read: every CVM's sysmem, then BAR0 (never VRAM)."""
        return b"".join(bytes(link.sysmem) for link in self.links.values()) + bytes(self.bar)

    # ------------------------------------------------------------------ drivers
    def holder(self, name: str) -> Driver:
        """Boot a data holder: add its CVM, probe from it, give the GPU back (before any session)."""
        if self._orchestrator is not None:
            raise IllegalTransition("in-process gpu", "session-established", f"boot holder {name!r}")
        link = self.add_cvm(name)
        previous = self.current
        self.switch(name)
        driver = Driver(link, clock=self.clock)
        driver.probe()
        self.switch(previous)
        return driver

    def orchestrator(self, name: str = ORCHESTRATOR) -> OrchestratorDriver:
        """Boot the orchestrator: add its CVM, take the GPU, run SPDM. The GPU stays with it."""
        link = self.add_cvm(name)
        self.switch(name)
        driver = OrchestratorDriver(link, clock=self.clock)
        driver.establish_session()
        self._orchestrator = driver
        return driver

    def boot(self, *holders: str) -> tuple[OrchestratorDriver, dict[str, Driver]]:
        """Holders first, orchestrator last; returns the orchestrator and holders by name."""
        drivers = {name: self.holder(name) for name in holders}
        return self.orchestrator(), drivers

    def travel(self, holder: Driver, data: bytes | memoryview, buffer: BufferInfo, *, rotate: bool = True) -> bytes:
        """One honest travel (no scrub); returns the holder's blob. A failed copy still exports and
        comes home, as the runtime does, and then raises."""
        orch = self._orchestrator
        if orch is None:
            raise IllegalTransition("in-process gpu", "no-session", "run a travel")
        home = orch.link.cvm
        blob = orch.export_for_travel()
        self.switch(holder.link.cvm)
        holder.import_context(blob)
        try:
            holder.copy_to_vram(memoryview(data), buffer.offset, buffer_bytes=buffer.nbytes)
        finally:
            back = holder.export_context()
            self.switch(home)
            orch.import_returned(back)
            if rotate:
                orch.rotate()
        return back

    # ------------------------------------------------------------------ inspection
    def vram_at(self, offset: int, nbytes: int) -> bytes:
        return bytes(self.vram[offset : offset + nbytes])


# ---------------------------------------------------------------------------- leak checks
def _escaped(secret: bytes, quote: str) -> str:
    """``secret`` as it appears inside a bytes repr delimited by ``quote``."""
    special = {"\\": "\\\\", quote: "\\" + quote, "\t": "\\t", "\n": "\\n", "\r": "\\r"}
    return "".join(special.get(chr(c)) or (chr(c) if 32 <= c < 127 else f"\\x{c:02x}") for c in secret)


def renderings(secret: bytes) -> set[str]:
    """How ``secret`` could show in text: hex (either case), in a bytes repr (either quote), raw."""
    return {secret.hex(), secret.hex().upper(), _escaped(secret, "'"), _escaped(secret, '"'), secret.decode("latin-1")}


def leaks(text: str, secrets: Iterable[bytes]) -> list[str]:
    """The renderings of any of ``secrets`` found in ``text`` (empty: nothing leaked)."""
    return [r for s in secrets for r in renderings(s) if r and r in text]
