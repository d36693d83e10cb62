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
    dataset_format: str = "raw"  # "raw": the file's bytes; "tokens": llm.c shards or text, as uint16 tokens


class Dataset:
    """A holder's dataset, mapped read-only once.

    A "tokens" dataset (a directory of llm.c shards, one shard, or text) is the concatenation
    of its shards' tokens, without headers, in shard order; it is laid out once at boot in the
    CVM's private memory, so travels copy from it without touching the files again.
    """

    def __init__(self, path: str, fmt: str = "raw") -> None:
        self.tokenizer = ""
        self._map: mmap.mmap | None = None
        if fmt == "tokens":
            self._load_tokens(path)
        elif fmt == "raw":
            self._load_raw(path)
        else:
            raise BadInput(f"unknown dataset format {fmt!r}: use 'raw' or 'tokens'")
        self.view = memoryview(self._map) if self._map is not None else memoryview(b"")

    def _load_raw(self, path: str) -> None:
        if not os.path.isfile(path):
            raise BadInput(f"dataset {path!r} does not exist or is not a file")
        self.size = os.path.getsize(path)
        if self.size:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), self.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)

    def _load_tokens(self, path: str) -> None:
        from ..data.shards import load_tokens

        loaded = load_tokens(path)
        data = loaded.tokens.astype("<u2", copy=False).tobytes()
        self.tokenizer = loaded.tokenizer
        self.size = len(data)
        if self.size:
            self._map = mmap.mmap(-1, self.size)
            self._map.write(data)


class DataHolder:
    def __init__(self, config: HolderConfig) -> None:
        self.config = config
        self.dataset = Dataset(config.dataset_path, config.dataset_format)
        self.host = connect_unix(config.host_socket, "host")
        self.driver = Driver(register_with_host(self.host, config.name, config.layout))
        # Manifest pieces must tile any buffer the orchestrator may have: buffers are whole
        # records, so pieces are at most one record.
        self.piece_bytes = min(PIECE_BYTES, config.layout.record_bytes)
        self.sm = HolderTravel(config.name, self.dataset.size, piece_digests(self.dataset.view, self.piece_bytes),
                               self.piece_bytes)
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
        conn.send(HolderHello(self.config.name, self.dataset.size, self.piece_bytes, self.sm.manifest, self.dataset.tokenizer))
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
