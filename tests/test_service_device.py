"""The gpu service's two pieces: the vendor's per-device CA saved for its one use
(`GpuIssuer.save/load/discard`) and a device that takes its orchestrator link on a Unix
socket, from the orchestrator's uid only (`DeviceConfig.link_socket`, `link_uid`)."""

from __future__ import annotations

import mmap
import os
import socket
import stat
import threading
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest

from gputravel.attest.chain import verify_chain
from gputravel.attest.provision import ISSUER_KEY, GpuIssuer, enroll_gpu, issue_gpu_ca
from gputravel.attest.roots import GPU_VENDOR_ROOT_CN, Authority
from gputravel.crypto.device_identity import make_device_identity
from gputravel.device.process import DeviceConfig, DeviceProcess
from gputravel.errors import BadInput, TransportClosed
from gputravel.protocol.device import VramGrant, VramRequest
from gputravel.protocol.layout import Layout
from gputravel.transport.stream import HEADER, StreamTransport
from gputravel.transport.unix import accept_unix, connect_unix, listen_unix

NOW = datetime(2025, 1, 1, tzinfo=timezone.utc)
VRAM = 1 << 20


# ----------------------------------------------------------------------------- the vendor's CA
@pytest.fixture(scope="module")
def issuer() -> GpuIssuer:
    return issue_gpu_ca(Authority.self_signed(GPU_VENDOR_ROOT_CN, now=NOW), serial="GPU-SVC-0", now=NOW,
                        driver_version="555.1-emulated")


def test_a_saved_issuer_loads_as_the_same_vendor_ca(tmp_path: Path, issuer: GpuIssuer) -> None:
    issuer.save(tmp_path / "vendor")
    assert stat.S_IMODE((tmp_path / "vendor" / ISSUER_KEY).stat().st_mode) == 0o600
    loaded = GpuIssuer.load(tmp_path / "vendor")
    assert loaded.reference_values() == issuer.reference_values()
    assert (loaded.chain_der, loaded.serial, loaded.cc_mode, loaded.now, loaded.days) == \
        (issuer.chain_der, issuer.serial, issuer.cc_mode, issuer.now, issuer.days)
    assert loaded.ca.key.private_numbers() == issuer.ca.key.private_numbers()


def test_a_loaded_issuer_certifies_the_key_the_device_makes(tmp_path: Path, issuer: GpuIssuer) -> None:
    """The gpu service's first start: firmware state, the device's own key, the vendor's leaf."""
    issuer.save(tmp_path / "vendor")
    loaded = GpuIssuer.load(tmp_path / "vendor")
    loaded.save_state(tmp_path / "firmware")
    device = enroll_gpu(tmp_path / "firmware", loaded.certify_request)
    verify_chain(device.chain_der, [issuer.chain_der[-1]], NOW, what="GPU", length=5)
    assert device.reference_values() == issuer.reference_values()


def test_discard_consumes_the_vendor_ca(tmp_path: Path, issuer: GpuIssuer) -> None:
    issuer.save(tmp_path / "vendor")
    assert GpuIssuer.exists(tmp_path / "vendor")
    GpuIssuer.discard(tmp_path / "vendor")
    assert not (tmp_path / "vendor").exists()
    assert not GpuIssuer.exists(tmp_path / "vendor")
    with pytest.raises(BadInput, match="already used"):
        GpuIssuer.load(tmp_path / "vendor")
    GpuIssuer.discard(tmp_path / "vendor")  # twice is harmless


def test_an_issuer_whose_key_is_not_its_certificates_is_refused(tmp_path: Path, issuer: GpuIssuer) -> None:
    other = issue_gpu_ca(Authority.self_signed(GPU_VENDOR_ROOT_CN, now=NOW), serial="GPU-SVC-0", now=NOW)
    issuer.save(tmp_path / "a")
    other.save(tmp_path / "b")
    (tmp_path / "a" / ISSUER_KEY).write_bytes((tmp_path / "b" / ISSUER_KEY).read_bytes())
    with pytest.raises(BadInput, match="does not match"):
        GpuIssuer.load(tmp_path / "a")


# ----------------------------------------------------------------------------- the device's link socket
class Running:
    """A device serving in a thread, the test standing for its host."""

    def __init__(self, tmp_path: Path, link_uid: int) -> None:
        host_path, self.link_path = str(tmp_path / "host.sock"), str(tmp_path / "gpu-0.sock")
        listener = listen_unix(host_path)
        config = DeviceConfig(host_socket=host_path, vram_bytes=VRAM, layout=Layout(record_bytes=4096),
                              link_socket=self.link_path, link_uid=link_uid)
        self.device = DeviceProcess(config, make_device_identity(serial="GPU-SVC-0"))
        self.host = accept_unix(listener, "device", timeout=5)
        listener.close()
        self.thread = threading.Thread(target=self.device.serve, daemon=True)
        self.thread.start()
        self.host.recv(timeout=5)  # its DeviceAttach: the device is serving

    def connect(self) -> StreamTransport:
        return connect_unix(self.link_path, "orchestrator")

    def stop(self) -> None:
        self.host.close()  # the host gone: the device powers off
        self.thread.join(timeout=5)
        assert not self.thread.is_alive()


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    dev = Running(tmp_path, os.getuid())
    yield dev
    dev.stop()


def granted(link: StreamTransport) -> bool:
    link.send(VramRequest())
    got = link.recv(timeout=5)
    for fd in got.fds:
        os.close(fd)
    return isinstance(got.message, VramGrant) and len(got.fds) == 1


def test_the_orchestrators_uid_gets_vram(running: Running) -> None:
    assert stat.S_IMODE(os.stat(running.link_path).st_mode) == 0o666  # the uid check decides, not the mode
    link = running.connect()
    link.send(VramRequest())
    got = link.recv(timeout=5)
    assert isinstance(got.message, VramGrant) and got.message.vram_bytes == VRAM and len(got.fds) == 1
    with mmap.mmap(got.fds[0], VRAM, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as vram:
        assert len(vram) == VRAM
    os.close(got.fds[0])
    link.close()


def test_another_uid_is_hung_up_on_before_any_vram(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dev = Running(tmp_path, os.getuid() + 1)  # the orchestrator's uid is not ours
    try:
        link = dev.connect()
        try:
            link.send(VramRequest())
        except TransportClosed:
            pass  # hung up on already
        with pytest.raises(TransportClosed):
            link.recv(timeout=5)
        link.close()
        assert "refused a link" in caplog.text
    finally:
        dev.stop()


def test_a_new_connection_replaces_the_link(running: Running) -> None:
    first = running.connect()
    assert granted(first)
    second = running.connect()
    with pytest.raises(TransportClosed):
        first.recv(timeout=5)  # the old link is closed by the device
    assert granted(second)
    first.close()
    second.close()


def test_the_device_serves_on_after_its_link_goes(running: Running) -> None:
    """A restarted orchestrator reconnects; a broken frame only costs the sender its link."""
    link = running.connect()
    link.close()
    broken = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    broken.connect(running.link_path)
    broken.sendall(HEADER.pack(8, 0) + b"\xc1" * 8)  # a frame whose payload is not msgpack
    broken.settimeout(5)
    assert broken.recv(1) == b""  # the device hung up on it
    broken.close()
    again = running.connect()
    assert granted(again)
    again.close()


def test_a_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    stale = listen_unix(tmp_path / "gpu-0.sock")
    stale.close()  # the file stays, as after a device that died
    dev = Running(tmp_path, os.getuid())
    try:
        link = dev.connect()
        assert granted(link)
        link.close()
    finally:
        dev.stop()


def test_the_link_comes_one_way_or_the_other(tmp_path: Path) -> None:
    config = DeviceConfig(host_socket=str(tmp_path / "host.sock"), vram_bytes=VRAM, layout=Layout(record_bytes=4096))
    identity = make_device_identity()
    with pytest.raises(BadInput, match="one of them"):
        DeviceProcess(config, identity)
    a, b = socket.socketpair()
    with pytest.raises(BadInput, match="one of them"):
        DeviceProcess(DeviceConfig(**{**config.__dict__, "link_socket": str(tmp_path / "l.sock")}), identity, a)
    a.close()
    b.close()


def test_without_a_uid_to_check_only_our_own_user_may_connect(tmp_path: Path) -> None:
    """Not isolated (link_uid -1), the link's socket is 0600: no other local account reaches
    VRAM through it (the review found it 0666 with no check)."""
    dev = Running(tmp_path, -1)
    try:
        assert stat.S_IMODE(os.stat(dev.link_path).st_mode) == 0o600
    finally:
        dev.stop()
