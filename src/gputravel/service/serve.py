"""`gputravel serve ROLE --config FILE`: one party in the foreground, waiting for its peers and
stopping cleanly on SIGTERM or SIGINT; the host and the GPU here, the members in members.py.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from gputravel.attest.provision import GpuIssuer
from gputravel.errors import BadInput, GputravelError, one_line
from gputravel.protocol.control import Certified, Enroll
from gputravel.service.config import (BrokerService, GpuService, HolderService, HostService, check_before_start,
                                      load_service, party_name)
from gputravel.service.members import serve_holder, serve_orchestrator
from gputravel.service.party import (BOOT_TIMEOUT, PartyChild, Stopping, as_party, log, own_state, private_dir,
                                     refuse_planted, unix_listening, wait_for)
from gputravel.service.registry import bind, vendor_dir


def serve(role: str, config_path: Path) -> int:
    """Run one party until it is done or told to stop; its exit status. An error that ends the
    service is logged as a `failed` event first: no service ends non-zero without saying why."""
    name = role
    try:
        cfg = load_service(config_path, role)  # BadInput if the file is another party's
        name = cfg.name if isinstance(cfg, HolderService) else party_name(cfg)  # as the party logs
        bind(cfg, party_name(cfg))  # the party cohort init made, or nothing is touched
        check_before_start(cfg)
        stop = Stopping()
        run = {"host": serve_host, "gpu": serve_gpu, "holder": serve_holder, "orchestrator": serve_orchestrator,
               "broker": serve_broker}[role]
        return run(cfg, stop)
    except (Exception, KeyboardInterrupt) as exc:
        log(name, "failed", kind=type(exc).__name__, why=str(exc))
        raise


def main(argv: list[str]) -> int:
    """``serve ROLE --config FILE`` as the launcher spawns it (service/launch.py SERVE): `gputravel
    serve` without the command line's other imports (typer, rich, every command: 0.16 s a service).
    A typed error, an OSError on a path or a RecursionError ends as one line and status 1, as the
    command's (errors.one_line); an interrupt before serve's own handlers, 130."""
    roles = ("host", "gpu", "holder", "orchestrator", "broker")
    if len(argv) != 4 or argv[0] != "serve" or argv[1] not in roles or argv[2] != "--config":
        print(f"usage: serve {{{','.join(roles)}}} --config FILE (got {' '.join(argv)!r})", file=sys.stderr)
        return 2
    try:
        return serve(argv[1], Path(argv[3]))
    except (GputravelError, OSError, RecursionError) as exc:
        if (line := one_line(exc)) is None:
            raise
        print(f"error: {line}", flush=True)
        return 1
    except KeyboardInterrupt:  # before serve's own handlers: as typer ends a command, 130 and no words
        return 130


def serve_host(cfg: HostService, stop: Stopping) -> int:
    """The untrusted host: its PCIe MUX and the socket every CVM and the GPU register at."""
    private_dir(cfg.state_dir)
    if os.path.exists(cfg.socket) and not unix_listening(cfg.socket):
        os.unlink(cfg.socket)  # a stale socket from a host that died; a live one is refused below
    home = private_dir(Path(cfg.state_dir) / "home")
    own_state(Path(cfg.state_dir), cfg.uid)
    config = {"socket_path": cfg.socket, "hardware": cfg.hardware, "outlive_device": True}
    return _serve_child("host", "host", config, cfg.uid, home, stop, socket=cfg.socket)


def serve_gpu(cfg: GpuService, stop: Stopping) -> int:
    """The GPU: its firmware key is certified once by the vendor's per-device CA (root's), which is then gone."""
    name = party_name(cfg)
    state = private_dir(cfg.state_dir)
    vendor = vendor_dir(cfg)
    wait_for(name, f"the host at {cfg.host_socket}", lambda: unix_listening(cfg.host_socket), stop)
    firmware = state / "firmware"
    home = private_dir(state / "home")
    own_state(state, cfg.uid)
    if not firmware.exists():  # first start: the firmware state the vendor vouches for
        if not GpuIssuer.exists(vendor):
            raise BadInput(f"the GPU has no firmware state and its vendor material at {vendor} is gone")
        issuer = GpuIssuer.load(vendor)
        with as_party(cfg.uid):  # written inside the device's own tree: as the device
            issuer.save_state(private_dir(firmware))
    config = {"host_socket": cfg.host_socket, "vram_bytes": cfg.vram_bytes, "layout": cfg.layout.to_layout(),
              "serial": cfg.serial, "gpu_dir": str(firmware), "link_socket": cfg.link_socket,
              "link_uid": cfg.orchestrator_uid}
    return _serve_child(name, "device", config, cfg.uid, home, stop,
                        lambda child, msg: _certify_firmware(child, vendor, msg), serial=cfg.serial, link=cfg.link_socket)


def serve_broker(cfg: BrokerService, stop: Stopping) -> int:
    """The key broker (broker/process.py) under its own account: its secret and identity, which it makes
    at first start (or `gputravel cohort identity` made), stay in its state directory; it ends when this
    service closes its link."""
    state = private_dir(cfg.state_dir)
    refuse_planted(state, cfg.uid)
    if os.path.exists(cfg.socket) and not unix_listening(cfg.socket):
        os.unlink(cfg.socket)  # a stale socket from a broker that died; a live one is refused at bind
    home = private_dir(state / "home")
    own_state(state, cfg.uid)
    return _serve_child("broker", "key-broker", cfg.broker_config(str(state)), cfg.uid, home, stop,
                        stop_by="close", socket=cfg.socket, accepted=len(cfg.accepted_measurements))


def _certify_firmware(child: PartyChild, vendor: Path, msg: Enroll) -> None:
    if msg.name != "device" or not GpuIssuer.exists(vendor):
        raise BadInput(f"the GPU asked to be certified, but its vendor material at {vendor} is gone")
    cert_pem, ca_pem = GpuIssuer.load(vendor).certify_request(msg.csr_pem)
    child.control.send(Certified(cert_pem=cert_pem, ca_pem=ca_pem))
    GpuIssuer.discard(vendor)  # certified once: nobody can certify another key for this GPU


def _serve_child(party: str, role: str, config: dict, uid: int, home: Path, stop: Stopping,
                 certify: Callable[[PartyChild, Enroll], None] | None = None, stop_by: str = "terminate",
                 **up: object) -> int:
    """Start the party's process, then serve until a signal (a clean stop: 0) or it ends (its status)."""
    child = PartyChild(role, config, stop_by=stop_by, uid=uid, home=home)
    try:
        child.ready(BOOT_TIMEOUT, None if certify is None else lambda msg: certify(child, msg))
        log(party, "up", **up)
        while child.alive() and not stop():
            with contextlib.suppress(subprocess.TimeoutExpired):  # still serving
                child.proc.wait(timeout=0.2)
        if stop():
            log(party, "stopping", why="signal")
            child.stop()
            return 0
        log(party, "exited", status=child.proc.returncode)
        return child.proc.returncode
    finally:
        child.close()
