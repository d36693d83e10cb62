"""The launcher's side of the emulated TDX module (firmware/tdx_module.py): it certifies the
module's quoting key, measures the orchestrator it launches, and registers that process's pid
and measurement with the module. The orchestrator never names a measurement.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.attest import orchestrator_measurement
from gputravel.firmware.tdx_module import (
    QUOTING_KEY_CN,
    CvmRegistered,
    LaunchedCvm,
    QuotingKey,
    QuotingKeyCertified,
)
from gputravel.errors import BadInput, ProtocolError
from gputravel.transport.stream import StreamTransport
from gputravel.cohort.trust import CohortTrust, measured_config

if TYPE_CHECKING:
    from gputravel.cohort.placement import Placement

__all__ = ["KEY", "QuotingLaunch"]

KEY = "tdx-module"  # the child's key and role in the supervisor
_FIND_PACKAGE = ("import importlib.util as u; s = u.find_spec('gputravel'); "
                 "print(s.submodule_search_locations[0] if s and s.submodule_search_locations else '')")


class QuotingLaunch:
    """Where the module listens, and the launcher's three steps with it."""

    def __init__(self, place: Placement, directory: Path, *, hold_s: float = 30.0) -> None:
        home = directory / "tdx"
        home.mkdir(mode=0o711)
        place.own(home, KEY, 0o711)  # the module binds here; others may only reach the socket
        self.socket = place.path(home / "quote.sock")  # one name for the module and the orchestrator
        self.config = {"socket_path": self.socket, "hold_s": hold_s}

    @classmethod
    def at(cls, socket_path: str, *, hold_s: float = 30.0) -> QuotingLaunch:
        """A module listening at `socket_path` in a directory the caller made (service/members.py)."""
        launch = cls.__new__(cls)
        launch.socket = socket_path
        launch.config = {"socket_path": socket_path, "hold_s": hold_s}
        return launch

    @staticmethod
    def certify(control: StreamTransport, trust: CohortTrust, timeout: float) -> CohortTrust:
        """Certify the module's quoting key under the CPU-TEE root, and drop the root key."""
        if trust.tee_root is None:
            raise BadInput("the CPU-TEE root key is gone: nothing can certify a quoting key")
        msg = control.recv(timeout=timeout, expect=QuotingKey).message
        assert isinstance(msg, QuotingKey)
        try:
            key = serialization.load_der_public_key(msg.public_key)
        except ValueError:
            raise ProtocolError("the TDX module sent a malformed quoting key") from None
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp384r1":
            raise ProtocolError("the TDX module's quoting key is not a P-384 key")
        cert = trust.tee_root.issue(QUOTING_KEY_CN, key, is_ca=False, days=365)
        control.send(QuotingKeyCertified(cert_chain=(cert, trust.tee_root.cert_der)))
        return dataclasses.replace(trust, tee_root=None)

    @staticmethod
    def measure_launch(config: dict, popen: dict) -> bytes:
        """Measure an orchestrator started so: its configuration, and the package its interpreter imports there."""
        kwargs = {k: popen[k] for k in ("preexec_fn", "env", "cwd", "pass_fds") if k in popen}
        try:
            # -P: as the orchestrator runs (isolation.party_env), never a package in the working directory.
            found = subprocess.run([sys.executable, "-P", "-c", _FIND_PACKAGE], capture_output=True, text=True,
                                   timeout=60, check=True, stdin=subprocess.DEVNULL, **kwargs).stdout.strip()
        except (subprocess.SubprocessError, OSError) as exc:
            raise BadInput(f"cannot find the package the orchestrator would run: {exc}") from None
        if not found:
            raise BadInput("the orchestrator's interpreter finds no gputravel package")
        from gputravel.orchestrator.cvm import OrchestratorConfig  # lazy: every service imports this module

        measured = measured_config(OrchestratorConfig(**config))
        return orchestrator_measurement(measured, package_dir=Path(found))

    @staticmethod
    def register(control: StreamTransport, pid: int, uid: int | None, measurement: bytes, timeout: float) -> None:
        control.send(LaunchedCvm(pid=pid, uid=os.geteuid() if uid is None else uid, measurement=measurement))
        reply = control.recv(timeout=timeout, expect=CvmRegistered).message
        if not isinstance(reply, CvmRegistered) or reply.pid != pid:
            raise ProtocolError("the TDX module did not register the orchestrator")
