"""An in-process cohort: the real orchestrator and holder shells on one InProcessGpu, linked by
memory pairs (the real codec), each holder serving in a thread. It has no TLS and no attestation:
tests of those, of process isolation or of a CVM that dies need the process cohorts.

    with InProcessCohort({"alice": data_a, "bob": data_b}, buffer_bytes=TEST_LAYOUT.record_bytes) as cohort:
        report = cohort.orchestrator.travel("alice", 0)
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace, TracebackType
from typing import Any

from gputravel.device.process import memfd
from gputravel.driver.driver import Driver
from gputravel.driver.link import PcieMuxClient
from gputravel.driver.orchestrator import OrchestratorDriver
from gputravel.files import RAW, DatasetFormat
from gputravel.errors import BadInput, GputravelError, PeerTimeout, ProtocolError, TransportClosed
from gputravel.holder.cvm import Dataset, DataHolder, HolderConfig
from gputravel.host.mux import CvmRegistration, PcieMux, SwitchPlan, answer, notice
from gputravel.orchestrator.cvm import Orchestrator, OrchestratorConfig
from gputravel.protocol.device import VramGrant, VramRequest
from gputravel.protocol.host import Switched
from gputravel.protocol.layout import SYSMEM_IOVA, Layout
from gputravel.protocol.parties import ORCHESTRATOR
from gputravel.protocol.travel import Bye
from gputravel.testing import TEST_LAYOUT, TIMEOUT_SCALE, InProcessGpu
from gputravel.transport.base import Transport
from gputravel.transport.memory import memory_pair

__all__ = ["InProcessCohort", "InProcessHost", "MemoryListener"]


def _serve_forever(name: str, target: Any, *args: object) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread


class InProcessHost:
    """The host's side of the PCIe MUX for an in-process GPU, one memory pair and thread per CVM:
    it answers and notifies as the host process does (host/mux.answer, notice)."""

    def __init__(self, gpu: InProcessGpu) -> None:
        self.gpu, self.mux = gpu, PcieMux()
        self._lock = threading.Lock()  # one switch at a time, its answer and notice in order
        self._ends: dict[str, Transport] = {}

    def connect(self, cvm: str) -> Transport:
        """Register ``cvm`` (its sysmem is the GPU's FakeLink for it) and return its end of the link."""
        ours, theirs = memory_pair("host", f"{cvm}:host")
        self.mux.register(CvmRegistration(cvm, SYSMEM_IOVA, self.gpu.layout.sysmem_bytes, -1, -1))
        self._ends[cvm] = ours
        _serve_forever(f"host:{cvm}", self._serve, cvm, ours)
        return theirs

    def _serve(self, cvm: str, end: Transport) -> None:
        while True:
            try:
                msg = end.recv().message
            except (TransportClosed, ProtocolError):
                end.close()  # a peer that hangs up or sends garbage is dropped
                return
            with self._lock:
                reply = answer(self.mux, msg, self._switch)
                try:
                    end.send(reply)
                except TransportClosed:
                    return
                told = self._ends.get(reply.target) if isinstance(reply, Switched) else None
                if told is not None and told is not end:
                    with suppress(TransportClosed):  # a CVM that went away
                        told.send(notice(reply))

    def _switch(self, plan: SwitchPlan) -> int:
        self.gpu.switch(plan.target.cvm)
        return 0

    def close(self) -> None:
        for end in self._ends.values():
            end.close()


class MemoryListener:
    """The orchestrator's listener for memory links: ``accept`` returns the next link a holder
    opened with :meth:`connect`, and its name (as TLS names the peer by its certificate)."""

    port = 0

    def __init__(self) -> None:
        self._waiting: queue.SimpleQueue[tuple[Transport, str]] = queue.SimpleQueue()

    def connect(self, holder: str) -> Transport:
        ours, theirs = memory_pair(ORCHESTRATOR, holder)
        self._waiting.put((ours, holder))
        return theirs

    def accept(self, timeout: float | None = None) -> tuple[Transport, str]:
        try:
            return self._waiting.get(timeout=timeout)
        except queue.Empty:
            raise PeerTimeout(f"no holder connected within {timeout} s") from None

    def fileno(self) -> int:
        raise BadInput("a memory listener has no file descriptor")

    def close(self) -> None:
        while True:
            try:
                self._waiting.get_nowait()[0].close()
            except queue.Empty:
                return


@dataclass
class _NoQuote:
    """The orchestrator's GPU attester without a TDX module: it opens the SPDM session, quotes nothing."""

    gpu: object = None

    def open_session(self, driver: OrchestratorDriver, now: object, timeout: float) -> None:
        driver.establish_session(timeout=timeout)

    def refresh(self, *args: object) -> bool:
        return False

    def reattest_if_due(self, *args: object) -> bool:
        return False

    def serve_challenge(self, *args: object) -> None:
        pass


_ACCEPT_ALL = SimpleNamespace(policy=SimpleNamespace(max_evidence_age_s=1e9))  # a policy of no age limit


class InProcessCohort:
    """An orchestrator and its holders on one in-process GPU. ``datasets``: each holder's data, as
    bytes (written into ``workdir``) or a dataset's path; ``formats``: where not "raw" (files.py)."""

    def __init__(self, datasets: Mapping[str, bytes | Path], *, buffer_bytes: int, workdir: str | Path,
                 layout: Layout = TEST_LAYOUT, vram_bytes: int = 8 << 20, audit_arrival: bool = False,
                 timeout: float = 10.0, formats: Mapping[str, DatasetFormat] | None = None,
                 tokenizer: str = "", schema: str = "") -> None:
        self.datasets, self.timeout = datasets, timeout * TIMEOUT_SCALE
        formats = formats or {}
        self._vram_fd, self._vram = memfd("gputravel-vram", vram_bytes, populate=False)
        self.gpu = InProcessGpu(layout, vram_bytes, vram=self._vram)
        self.host = InProcessHost(self.gpu)
        self.listener = MemoryListener()
        self.left: dict[str, str] = {}  # holders that left the cohort, and why
        self._threads: list[threading.Thread] = []
        workdir = Path(workdir)
        self.holders = {name: self._holder(name, data, workdir, layout, audit_arrival, formats.get(name, RAW))
                        for name, data in datasets.items()}
        config = OrchestratorConfig(host_socket="", pki_dir="", layout=layout, buffer_bytes=buffer_bytes,
                                    holder_timeout=self.timeout, device_timeout=self.timeout, tokenizer=tokenizer,
                                    schema=schema)
        host = self.host.connect(ORCHESTRATOR)
        device, self._device = memory_pair("device-link", "device")
        self.orchestrator = Orchestrator(
            config, host=host, driver=OrchestratorDriver(self.gpu.add_cvm(ORCHESTRATOR)),
            mux=PcieMuxClient(host, ORCHESTRATOR), device=device, listener=self.listener, log_key=b"",
            attester=lambda config: _NoQuote())  # type: ignore[arg-type,return-value]

    def _holder(self, name: str, data: bytes | Path, workdir: Path, layout: Layout, audit: bool,
                fmt: DatasetFormat) -> DataHolder:
        path = data if isinstance(data, Path) else workdir / f"{name}.bin"
        if not isinstance(data, Path):
            path.write_bytes(data)
        config = HolderConfig(name=name, dataset_path=str(path), host_socket="", pki_dir="", layout=layout,
                              audit_arrival=audit, device_timeout=self.timeout, orchestrator_timeout=self.timeout,
                              dataset_format=fmt)
        host = self.host.connect(name)
        return DataHolder(config, dataset=Dataset.of(config), host=host,
                          driver=Driver(self.gpu.add_cvm(name)), mux=PcieMuxClient(host, name), log_key=bytes(32),
                          connect=lambda _host, _port: self.listener.connect(name),
                          policy=lambda: _ACCEPT_ALL,  # type: ignore[arg-type,return-value]
                          challenge=lambda conn, policy, timeout: SimpleNamespace())

    # ------------------------------------------------------------------ boot, join, stop
    def start(self) -> InProcessCohort:
        """Holders boot first (each probes the GPU), then the orchestrator; then every holder joins."""
        try:
            for holder in self.holders.values():
                holder.boot()
            self._threads.append(_serve_forever("device", self._grant_vram))
            self.orchestrator.boot()
            self.join(*self.holders)
        except BaseException:
            self.close()  # as a cohort whose boot fails: nothing is left running
            raise
        return self

    def join(self, *names: str) -> dict[str, int]:
        """``names`` join, each then serving in its thread; returns each joined holder's dataset size."""
        for name in names:
            self._threads.append(_serve_forever(name, self._serve_holder, self.holders[name]))
        return self.orchestrator.await_holders(names, self.timeout)

    def _grant_vram(self) -> None:
        """The device's side of the orchestrator's link: VRAM, granted as a shared mapping."""
        while True:
            try:
                msg = self._device.recv().message
            except (TransportClosed, ProtocolError):
                return
            if isinstance(msg, VramRequest):
                self._device.send(VramGrant(vram_bytes=len(self._vram)), fds=(self._vram_fd,))

    def _serve_holder(self, holder: DataHolder) -> None:
        """A holder's process loop: join, then serve until a goodbye, a hang-up or a failure."""
        name = holder.config.name
        try:
            holder.join("memory", 0)
        except GputravelError as exc:
            self.left[name] = f"could not join: {type(exc).__name__}: {exc}"
            return
        conn = holder.orchestrator
        assert conn is not None
        while True:
            try:
                msg = conn.recv().message
            except (TransportClosed, ProtocolError) as exc:
                self.left[name] = f"{type(exc).__name__}: {exc}"
                break
            if isinstance(msg, Bye):
                self.left[name] = f"Bye: {msg.reason}"
                break
            try:
                holder.handle(msg)
            except GputravelError as exc:
                self.left[name] = f"{type(msg).__name__} failed ({type(exc).__name__}: {exc})"
                break
        holder.drop_orchestrator()

    def close(self) -> None:
        self.orchestrator.close()
        self._device.close()
        self.host.close()
        for thread in self._threads:
            thread.join(timeout=self.timeout)
        self.listener.close()
        with suppress(BufferError):  # a view is still exported (the orchestrator's mapping): it goes with it
            self._vram.close()
        os.close(self._vram_fd)

    def __enter__(self) -> InProcessCohort:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

