"""The red team's entry point, ``python -m gputravel.redteam.entry ROLE CONFIG_JSON CONTROL_FD [EXTRA_FD]``:
the adversarial ``host`` and ``holder`` boot, enrol and fail through the production entry's ``run_party``."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from gputravel.cohort.entry import load_config, run_party
from gputravel.host.process import HostConfig, HostProcess
from gputravel.protocol.control import Ready
from gputravel.redteam.holder import serve as serve_holder
from gputravel.redteam.host import HostAdversary
from gputravel.transport.stream import StreamTransport


def _serve(role: str, payload: dict, control: StreamTransport, extra: socket.socket | None) -> None:
    if role == "host":
        adversary = HostAdversary(Path(payload.pop("adversary_dir")))
        host = HostProcess(load_config(HostConfig, payload), hooks=adversary)
        control.send(Ready(role="host", detail={}))
        host.serve()
    elif role == "holder":
        serve_holder(payload, control)
    else:
        raise SystemExit(f"unknown red-team role {role!r}")


if __name__ == "__main__":
    sys.exit(run_party(sys.argv[1:], _serve))
