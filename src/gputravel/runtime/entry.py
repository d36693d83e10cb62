"""Process entry point: ``python -m gputravel.runtime.entry ROLE CONFIG_JSON CONTROL_FD [EXTRA_FD]``.

The supervisor starts every trust domain through here; each reports Ready (or Failed) over
its control link, then serves until told to stop or its peers go away.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import sys
import traceback

from ..errors import GputravelError
from ..layout import Layout
from ..transport.stream import StreamTransport
from .control import Failed, Ready


def _config(cls, raw: dict):
    if isinstance(raw.get("layout"), dict):
        raw = {**raw, "layout": Layout(**raw["layout"])}
    return cls(**raw)


def main(argv: list[str]) -> int:
    role, payload, control_fd = argv[0], json.loads(argv[1]), int(argv[2])
    extra = socket.socket(fileno=int(argv[3])) if len(argv) > 3 else None
    control = StreamTransport(socket.socket(fileno=control_fd), "supervisor")
    try:
        if role == "host":
            from ..host.process import HostConfig, HostProcess

            host = HostProcess(_config(HostConfig, payload))
            control.send(Ready(role="host", detail={}))
            host.serve()
        elif role == "device":
            from ..device.process import DeviceConfig, DeviceProcess
            from .trust import DeviceMaterial

            assert extra is not None
            config = _config(DeviceConfig, payload)
            gpu = DeviceMaterial.load(config.gpu_dir)  # its 5-certificate chain and firmware key
            config = dataclasses.replace(config, serial=gpu.device.serial)
            dev = DeviceProcess(config, gpu.identity(), extra, firmware=gpu.device.firmware())
            control.send(Ready(role="device", detail={"vram_bytes": dev.config.vram_bytes}))
            dev.serve()
        elif role == "holder":
            from .holder import HolderConfig, serve

            serve(_config(HolderConfig, payload), control)
        elif role == "orchestrator":
            from .orchestrator import OrchestratorConfig, serve

            assert extra is not None
            serve(_config(OrchestratorConfig, payload), control, extra)
        elif role == "redteam-holder":  # a malicious holder (gputravel.redteam, tests and `gputravel redteam`)
            from ..redteam.holder import serve as serve_malicious

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
