"""A TCP tap: the untrusted host's view of the network. It forwards a port to the orchestrator's
and records every byte both ways, so tests can show TLS carries no holder plaintext."""

from __future__ import annotations

import socket
import threading
from contextlib import suppress
from pathlib import Path


class TcpTap:
    def __init__(self, target: tuple[str, int], record: Path) -> None:
        self._target = target
        self._record = open(record, "ab")
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="tap-accept").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._target)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True, name="tap-pump").start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    self._record.write(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            self._record.close()
