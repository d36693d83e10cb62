"""Shared fixtures."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import pytest


@dataclass
class HostWithDevice:
    """A real host process loop (in a thread) and a stand-in device that acknowledges every
    attach: enough for CVM-side code that talks to the PCIe MUX without touching the GPU."""

    socket_path: str
    attached: list[str] = field(default_factory=list)  # the CVMs the device was attached to, in order


@pytest.fixture
def host_with_device(tmp_path):
    from gputravel.host.process import HostConfig, HostProcess
    from gputravel.protocol.host import AttachCvm, DeviceAck, DeviceAttach
    from gputravel.transport.unix import connect_unix

    sock = str(tmp_path / "host.sock")
    host = HostProcess(HostConfig(socket_path=sock))
    threading.Thread(target=host.serve, daemon=True).start()
    device = connect_unix(sock, "device")
    bar, bell = os.memfd_create("bar"), os.eventfd(0)
    os.ftruncate(bar, 8192)
    device.send(DeviceAttach(serial="GPU-TEST", bar_bytes=8192), fds=(bar, bell))
    out = HostWithDevice(sock)

    def play_device() -> None:
        while True:
            try:
                got = device.recv(timeout=30)
            except Exception:
                return
            for fd in got.fds:
                os.close(fd)
            if isinstance(got.message, AttachCvm):
                out.attached.append(got.message.cvm)
                device.send(DeviceAck(cvm=got.message.cvm))

    threading.Thread(target=play_device, daemon=True).start()
    yield out
    device.close()  # the host stops serving once its device is gone
    for fd in (bar, bell):
        os.close(fd)
