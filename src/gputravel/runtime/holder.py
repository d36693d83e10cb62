"""A data holder CVM: boots first, keeps its dataset, serves travel requests.

The dataset is mapped once at boot (page tables populated, as a holder CVM keeps its data
resident) and its manifest computed; during a travel, records are encrypted straight from
that mapping into the staging slots (zero-copy on the holder side).
"""

from __future__ import annotations

import mmap
import os
import selectors
import time
from dataclasses import dataclass

from ..crypto.pki import CohortPki
from ..driver.driver import Driver
from ..driver.link import register_with_host, request_switch
from ..errors import BadInput, GputravelError, ProtocolError, TransportClosed
from ..layout import Layout
from ..messages import Bye, HolderHello, TravelRequest, Welcome
from ..roles.holder import CopyChunk, ExportBlob, HolderTravel, ImportBlob, Reply, SwitchBack
from ..roles.manifest import PIECE_BYTES, piece_digests
from ..transport.base import Transport
from ..transport.stream import connect_unix
from ..transport.tls import connect_tls
from .control import JoinCohort, Ready, Shutdown

ORCHESTRATOR = "orchestrator"


@dataclass(frozen=True)
class HolderConfig:
    name: str
    dataset_path: str
    host_socket: str
    pki_dir: str
    layout: Layout
    device_timeout: float = 30.0
    audit_arrival: bool = False  # read the buffer back on arrival and count non-zero bytes


class Dataset:
    """A holder's dataset, mapped read-only once."""

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise BadInput(f"dataset {path!r} does not exist or is not a file")
        self.size = os.path.getsize(path)
        self._map: mmap.mmap | None = None
        if self.size:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), self.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        self.view = memoryview(self._map) if self._map is not None else memoryview(b"")


class DataHolder:
    def __init__(self, config: HolderConfig) -> None:
        self.config = config
        self.dataset = Dataset(config.dataset_path)
        self.host = connect_unix(config.host_socket, "host")
        self.driver = Driver(register_with_host(self.host, config.name, config.layout))
        self.sm = HolderTravel(config.name, self.dataset.size, piece_digests(self.dataset.view, PIECE_BYTES), PIECE_BYTES)
        self.orchestrator: Transport | None = None

    def boot(self) -> None:
        """Paper 4.1: set up the driver while this CVM has the GPU, before the orchestrator boots."""
        self.switch(self.config.name)
        self.driver.probe(timeout=self.config.device_timeout)

    def switch(self, target: str) -> int:
        return request_switch(self.host, target, self.config.device_timeout)

    def join(self, host: str, port: int) -> None:
        ctx = CohortPki.load(self.config.pki_dir).client_context(self.config.name)
        conn = connect_tls(host, port, ctx, server_hostname=ORCHESTRATOR)
        conn.send(HolderHello(self.config.name, self.dataset.size, PIECE_BYTES, self.sm.manifest))
        if not isinstance(conn.recv(timeout=30).message, Welcome):
            raise ProtocolError("orchestrator did not welcome us")
        self.orchestrator = conn

    def serve_travel(self, req: TravelRequest) -> None:
        clock = time.perf_counter
        act = self.sm.on_request(req, clock())
        if isinstance(act, ImportBlob):
            self.driver.import_context(act.blob)
            act = self.sm.imported(clock())
            assert isinstance(act, CopyChunk)
            if self.config.audit_arrival:
                self.sm.audited(self._audit(act))
            act = self._copy(act, clock)
            assert isinstance(act, ExportBlob)
            act = self.sm.exported(self.driver.export_context(), clock())
        assert isinstance(act, SwitchBack)
        self.switch(ORCHESTRATOR)
        reply = self.sm.switched_back(clock())
        assert isinstance(reply, Reply)
        assert self.orchestrator is not None
        self.orchestrator.send(reply.message)

    def _copy(self, act: CopyChunk, clock):
        try:
            info = self.driver.query_buffer(act.buffer_offset, timeout=self.config.device_timeout)
            if info.nbytes < act.buffer_bytes:
                raise BadInput(f"the device buffer holds {info.nbytes} bytes, the request claims {act.buffer_bytes}")
            chunk = self.dataset.view[act.dataset_offset : act.dataset_offset + act.nbytes]
            self.driver.copy_to_vram(chunk, act.buffer_offset, buffer_bytes=info.nbytes, timeout=self.config.device_timeout)
        except GputravelError as exc:
            return self.sm.copy_failed(f"{type(exc).__name__}: {exc}", clock())
        return self.sm.copied(act.nbytes, clock())

    def _audit(self, act: CopyChunk) -> int:
        data = self.driver.copy_from_vram(act.buffer_offset, act.buffer_bytes, timeout=self.config.device_timeout)
        return act.buffer_bytes - data.count(0)


def serve(config: HolderConfig, control: Transport) -> None:
    holder = DataHolder(config)
    holder.boot()
    control.send(Ready(role=config.name, detail={"dataset_bytes": holder.dataset.size}))
    sel = selectors.DefaultSelector()
    sel.register(control.fileno(), selectors.EVENT_READ, "control")
    while True:
        for key, _ in sel.select():
            if key.data == "control":
                cmd = control.recv().message
                if isinstance(cmd, Shutdown):
                    return
                if isinstance(cmd, JoinCohort):
                    holder.join(cmd.host, cmd.port)
                    assert holder.orchestrator is not None
                    sel.register(holder.orchestrator.fileno(), selectors.EVENT_READ, "orchestrator")
            else:
                try:
                    msg = holder.orchestrator.recv(timeout=30).message
                except TransportClosed:
                    return
                if isinstance(msg, Bye):
                    return
                if isinstance(msg, TravelRequest):
                    holder.serve_travel(msg)
