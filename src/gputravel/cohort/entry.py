"""Process entry point: ``python -m gputravel.cohort.entry ROLE CONFIG_JSON CONTROL_FD [EXTRA_FD]``.

The supervisor starts every trust domain through here; each reports Ready (or Failed) over
its control link, then serves until told to stop or its peers go away.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import traceback
from pathlib import Path

from gputravel.errors import GputravelError, ProtocolError
from gputravel.protocol.layout import Layout
from gputravel.transport.stream import StreamTransport
from gputravel.protocol.control import Certified, Enroll, Failed, Ready
from gputravel.cohort.isolation import make_nondumpable


def _config(cls, raw: dict):
    if isinstance(raw.get("layout"), dict):
        raw = {**raw, "layout": Layout(**raw["layout"])}
    return cls(**raw)


def _certified(control: StreamTransport, name: str, csr_pem: bytes) -> tuple[bytes, bytes]:
    """Send the launcher a request for a key this process made; (certificate, CA) as PEM.
    Only the request and the certificates cross the control link."""
    control.send(Enroll(name=name, csr_pem=csr_pem))
    reply = control.recv(timeout=60).message
    if not isinstance(reply, Certified):
        raise ProtocolError(f"the launcher answered an enrolment with {type(reply).__name__}")
    return reply.cert_pem, reply.ca_pem


def _enroll(control: StreamTransport, name: str, pki_dir: str) -> None:
    """Make this member's TLS key here, in its own directory, and have the launcher's cohort
    CA certify it."""
    from gputravel.crypto.pki import install_member_cert, member_csr

    cert_pem, ca_pem = _certified(control, name, member_csr(Path(pki_dir), name))
    install_member_cert(Path(pki_dir), name, cert_pem, ca_pem)


def main(argv: list[str]) -> int:
    if os.environ.get("GPUTRAVEL_NONDUMPABLE") == "1":  # isolated: see cohort/isolation.py
        make_nondumpable()
    role, payload, control_fd = argv[0], json.loads(argv[1]), int(argv[2])
    extra = socket.socket(fileno=int(argv[3])) if len(argv) > 3 else None
    control = StreamTransport(socket.socket(fileno=control_fd), "supervisor")
    try:
        member = payload.pop("enroll", None)
        if member is not None:
            _enroll(control, member, payload["pki_dir"])
        if role == "host":
            from gputravel.host.process import HostConfig, HostProcess

            host = HostProcess(_config(HostConfig, payload))
            control.send(Ready(role="host", detail={}))
            host.serve()
        elif role == "device":
            from gputravel.device.process import DeviceConfig, DeviceProcess
            from gputravel.cohort.trust import DeviceMaterial

            assert extra is not None
            config = _config(DeviceConfig, payload)
            # Its firmware key, made here; the launcher (the GPU vendor) issues its leaf certificate.
            gpu = DeviceMaterial.enroll(config.gpu_dir, lambda csr: _certified(control, "device", csr))
            config = dataclasses.replace(config, serial=gpu.device.serial)
            dev = DeviceProcess(config, gpu.identity(), extra, firmware=gpu.device.firmware())
            control.send(Ready(role="device", detail={"vram_bytes": dev.config.vram_bytes}))
            dev.serve()
        elif role == "holder":
            from gputravel.holder.cvm import HolderConfig, serve

            serve(_config(HolderConfig, payload), control)
        elif role == "orchestrator":
            from gputravel.orchestrator.cvm import OrchestratorConfig, serve

            assert extra is not None
            serve(_config(OrchestratorConfig, payload), control, extra)
        elif role == "tdx-module":  # the emulated TDX module / quoting enclave (attest/tdx_module.py)
            from gputravel.attest.tdx_module import TdxModuleConfig, serve as serve_tdx_module

            serve_tdx_module(TdxModuleConfig(**payload), control)
        elif role == "redteam-holder":  # a malicious holder (gputravel.redteam, tests and `gputravel redteam`)
            from gputravel.redteam.holder import serve as serve_malicious

            serve_malicious(payload, control)
        else:
            raise SystemExit(f"unknown role {role!r}")
    except GputravelError as exc:
        traceback.print_exc()
        try:
            control.send(Failed(kind=type(exc).__name__, reason=str(exc)))
        except GputravelError:
            pass
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
