"""Process entry point: ``python -m gputravel.cohort.entry ROLE CONFIG_JSON CONTROL_FD [EXTRA_FD]``.

Every trust domain starts here, reports Ready (or Failed) on its control link, then serves.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

from gputravel.crypto.pki import install_member_cert, member_csr, self_signed_member
from gputravel.errors import GputravelError, ProtocolError, failed_where, named_class, safe_traceback, words
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
    except SystemExit as exc:
        if exc.code is None or type(exc.code) is int:
            raise
        # Python prints a SystemExit's other code as it is, past every hook: words of unknown origin.
        report, failed = "SystemExit (its message withheld)", Failed(kind="RemoteError", reason="exited with a message")
    except GputravelError as exc:
        report, failed = safe_traceback(exc), Failed(kind=type(exc).__name__, reason=words(exc))
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
    """Whatever this process prints of an exception, a warning or a log record it did not plan for, it
    prints through errors.safe_traceback or in fixed words: an exception that leaves the party, one a
    thread ends on, one a finalizer or callback ignores, logging's last resort, a warning. SIGINT is
    no interrupt here: a party stops on Shutdown or SIGTERM, and the host could time one to land in a
    failure's handling, carrying the failure as its context."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.excepthook = lambda kind, exc, tb: _say("", exc)
    threading.excepthook = lambda e: _say("in a thread: ", e.exc_value)
    # Its object's repr and its err_msg are the code's to choose: neither is printed.
    sys.unraisablehook = lambda u: _say("an exception was ignored: ", u.exc_value)
    logging.raiseExceptions = False  # a record that fails to format is dropped, not printed with its arguments
    logging.lastResort = _LastResort()
    logging.getLogger("gputravel").addHandler(_Ours())  # our records keep their words (the red team reads them)
    logging.getLogger("gputravel").propagate = False
    warnings.showwarning = _warned


def _say(what: str, exc: BaseException | None = None) -> None:
    """`what`, then `exc` through safe_traceback. Total: a hook that raises makes Python print the
    original exception its own way."""
    try:
        text = "" if exc is None else safe_traceback(exc)
    except BaseException:  # noqa: BLE001 (see above)
        text = "an exception (not printable safely)"
    try:
        print(what + text, file=sys.stderr, flush=True)
    except BaseException:  # noqa: BLE001 (no stderr left: nothing to print to)
        pass


class _Printer(logging.Handler):
    """Prints a WARNING or worse as `said` words it, an exception through safe_traceback."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        said, exc = self.said(record), record.exc_info[1] if record.exc_info else None
        _say(said if exc is None else said + "\n", exc)

    def said(self, record: logging.LogRecord) -> str:
        raise NotImplementedError


class _LastResort(_Printer):
    """What logging prints with no handler configured: the level, the logger and the message's
    template, never its arguments."""

    def said(self, record: logging.LogRecord) -> str:
        return f"{record.levelname} {record.name}: {record.msg if isinstance(record.msg, str) else '(a message)'}"


class _Ours(_Printer):
    """gputravel's own records, as logging's last resort printed them: their message, its arguments
    ours (names, typed errors' words)."""

    def said(self, record: logging.LogRecord) -> str:
        try:
            return record.getMessage()
        except Exception:  # noqa: BLE001 (a record that does not format: its template)
            return f"{record.msg}"


def _warned(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: object = None,
            line: str | None = None) -> None:
    _say(f"{filename}:{lineno}: {named_class(category) or 'a warning'} (its text withheld)")


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
