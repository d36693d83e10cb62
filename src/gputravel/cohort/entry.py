"""Process entry point: ``python -m gputravel.cohort.entry ROLE CONFIG_JSON CONTROL_FD [EXTRA_FD]``.

Every trust domain starts here, reports Ready (or Failed) on its control link, then serves.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from gputravel.crypto.pki import install_member_cert, member_csr, self_signed_member
from gputravel.errors import GputravelError, ProtocolError, failed_where, safe_traceback
from gputravel.protocol.layout import Layout
from gputravel.transport.stream import StreamTransport
from gputravel.protocol.control import Certified, Enroll, Failed, Ready
from gputravel.cohort.isolation import make_nondumpable
from gputravel.attest.material import DeviceMaterial


def load_config(cls, raw: dict):
    if isinstance(raw.get("layout"), dict):
        raw = {**raw, "layout": Layout(**raw["layout"])}
    return cls(**raw)


def jsonable(obj: object) -> object:
    """json.dumps' default for a party's configuration: the launchers' side of load_config."""
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    raise TypeError(f"cannot pass {type(obj).__name__} to a child process")


def _certified(control: StreamTransport, name: str, csr_pem: bytes) -> tuple[bytes, bytes]:
    """Have the launcher certify a key this process made; (certificate, CA) as PEM."""
    control.send(Enroll(name=name, csr_pem=csr_pem))
    reply = control.recv(timeout=60).message
    if not isinstance(reply, Certified):
        raise ProtocolError(f"the launcher answered an enrolment with {type(reply).__name__}")
    return reply.cert_pem, reply.ca_pem


# How an entry module serves a role: (role, its configuration, the control link, the extra socket).
ServeRole = Callable[[str, dict, StreamTransport, socket.socket | None], None]


def run_party(argv: list[str], serve_role: ServeRole) -> int:
    """Enrol if asked, then ``serve_role`` until it returns; a failure goes back as Failed."""
    if os.environ.get("GPUTRAVEL_NONDUMPABLE") == "1":  # isolated: see cohort/isolation.py
        make_nondumpable()
    log_failures_safely()
    role, payload, control_fd = argv[0], json.loads(argv[1]), int(argv[2])
    extra = socket.socket(fileno=int(argv[3])) if len(argv) > 3 else None
    control = StreamTransport(socket.socket(fileno=control_fd), "supervisor")
    try:
        member = payload.pop("enroll", None)
        if member is not None:  # its TLS key, made here, certified by the launcher's cohort CA
            pki = Path(payload["pki_dir"])
            install_member_cert(pki, member, *_certified(control, member, member_csr(pki, member)))
        pinned = payload.pop("self_sign", None)  # a deployed member (service/): its peers pin its certificate
        if pinned is not None:
            self_signed_member(Path(payload["pki_dir"]), pinned)
        serve_role(role, payload, control, extra)
        return 0
    except GputravelError as exc:
        report, failed = safe_traceback(exc), Failed(kind=type(exc).__name__, reason=str(exc))
    except Exception as exc:  # a bug, or a library refusing a record: its message may quote one
        report, failed = safe_traceback(exc), Failed(kind="RemoteError", reason=f"failed (a bug): {failed_where(exc)}")
    # Said once out of the handler: an interrupt or error now does not carry the failure as its context.
    print(report, file=sys.stderr, flush=True)  # the log goes to the launcher, the host's
    try:
        control.send(failed)
    except GputravelError:
        pass  # the launcher is gone: the exit status says it
    return 1


def log_failures_safely() -> None:
    """Whatever this process prints of an exception, it prints through errors.safe_traceback: one that
    leaves the party, one a thread ends on, one a finalizer or callback ignores."""
    sys.excepthook = lambda kind, exc, tb: _print(safe_traceback(exc))
    threading.excepthook = lambda e: _print(f"in a thread: {safe_traceback(e.exc_value)}" if e.exc_value is not None
                                            else "an exception ended a thread")
    # Its object's repr and its err_msg are the code's to choose: neither is printed.
    sys.unraisablehook = lambda u: _print(f"an exception was ignored: {safe_traceback(u.exc_value)}"
                                          if u.exc_value is not None else "an exception was ignored")


def _print(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# Each role's module is imported inside its branch (the device never loads the orchestrator's code).
def _serve(role: str, payload: dict, control: StreamTransport, extra: socket.socket | None) -> None:
    if role == "host":
        from gputravel.host.process import HostConfig, HostProcess  # lazy: only this role's code

        host = HostProcess(load_config(HostConfig, payload))
        control.send(Ready(role="host", detail={}))
        host.serve()
    elif role == "device":
        from gputravel.device.process import DeviceConfig, DeviceProcess  # lazy: only this role's code

        # extra: the orchestrator's link, inherited; None when the device listens on config.link_socket
        config = load_config(DeviceConfig, payload)
        # Its firmware key, made here; the launcher (the GPU vendor) issues its leaf certificate.
        gpu = DeviceMaterial.enroll(config.gpu_dir, lambda csr: _certified(control, "device", csr))
        config = dataclasses.replace(config, serial=gpu.device.serial)
        dev = DeviceProcess(config, gpu.identity(), extra, firmware=gpu.device.firmware())
        control.send(Ready(role="device", detail={"vram_bytes": dev.config.vram_bytes}))
        dev.serve()
    elif role == "holder":
        from gputravel.holder.cvm import HolderConfig, serve  # lazy: only this role's code

        serve(load_config(HolderConfig, payload), control)
    elif role == "orchestrator":
        from gputravel.orchestrator.cvm import OrchestratorConfig  # lazy: only this role's code
        from gputravel.orchestrator.process import serve  # lazy: only this role's code

        assert extra is not None
        serve(load_config(OrchestratorConfig, payload), control, extra)
    elif role == "tdx-module":  # the emulated TDX module / quoting enclave (firmware/tdx_module.py)
        from gputravel.firmware.tdx_module import TdxModuleConfig, serve as serve_tdx_module  # lazy: its role only

        serve_tdx_module(TdxModuleConfig(**payload), control)
    elif role == "key-broker":  # the emulated key broker (broker/process.py)
        from gputravel.broker.process import BrokerConfig, serve as serve_broker  # lazy: its role only

        serve_broker(BrokerConfig(**payload), control)
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    sys.exit(run_party(sys.argv[1:], _serve))
