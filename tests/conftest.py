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
    bar: int = -1  # the device's BAR0 memfd and doorbell eventfd, as it gave them to the host
    bell: int = -1
    attached: list[str] = field(default_factory=list)  # the CVMs the device was attached to, in order


@pytest.fixture
def make_host(tmp_path):
    """Start a real host loop (optionally with hooks) and its stand-in device; closed after the test."""
    from gputravel.host.process import HostConfig, HostProcess
    from gputravel.protocol.host import AttachCvm, DeviceAck, DeviceAttach
    from gputravel.transport.unix import connect_unix

    opened = []

    def start(hooks=None) -> HostWithDevice:
        sock = str(tmp_path / f"host{len(opened)}.sock")
        host = HostProcess(HostConfig(socket_path=sock), hooks=hooks)
        threading.Thread(target=host.serve, daemon=True).start()
        device = connect_unix(sock, "device")
        out = HostWithDevice(sock, bar=os.memfd_create("bar"), bell=os.eventfd(0, os.EFD_NONBLOCK))
        os.ftruncate(out.bar, 8192)
        device.send(DeviceAttach(serial="GPU-TEST", bar_bytes=8192), fds=(out.bar, out.bell))
        opened.append((device, out))

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
        return out

    yield start
    for device, out in opened:
        device.close()  # the host stops serving once its device is gone
        for fd in (out.bar, out.bell):
            os.close(fd)


@pytest.fixture
def host_with_device(make_host):
    return make_host()
