"""The holder and orchestrator services. Trust is pinned, not issued: each makes its TLS key in
its own state directory and publishes only its certificate; a holder pins its one orchestrator
and checks its attestation on every join. The GPU's boot lock keeps paper 4.1's boot order.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import socket
import struct
import time
from pathlib import Path

from gputravel.attest.material import LIMITS_FILE, POLICY_FILE, REFERENCE_FILE
from gputravel.attest.roots import GPU_ROOT_CERT, TEE_ROOT_CERT, TEE_ROOT_KEY, load_authority
from gputravel.cohort import isolation
from gputravel.cohort.quoting import QuotingLaunch
from gputravel.cohort.trust import CohortTrust
from gputravel.crypto.pki import pin_peers
from gputravel.cohort.client import error_from
from gputravel.errors import BadInput, GputravelError, ProtocolError
from gputravel.files import atomic_write_bytes, write_json
from gputravel.protocol.control import (AwaitHolders, Failed, Holders, JoinCohort, Joined, Leave, Left, Shutdown,
                                        TrainDone, TrainStep, Train)
from gputravel.service.config import (AUDIT_LOG, STATUS_FILE, HolderService, OrchestratorService, gpu_socket, orchestrator_party, public_file,
                                      ORCHESTRATOR, orchestrator_engine_config, quoting_socket)
from gputravel.service.party import (PartyChild, Stopping, as_party, log, one_certificate, own_state, private_dir,
                                     BOOT_TIMEOUT, publish, publish_certificate, refuse_planted, unix_listening, wait_for,
                                     wait_for_sockets)
from gputravel.service.registry import platform_dir, registered

STOP_WAIT_S = 60.0  # a stopping orchestrator finishes its step and checkpoints within this
STATUS_EVERY_S = 0.25  # how often status.json follows the training (the log: every 5th step)
DONE_FILE = "job-done"  # in the public directory (config.public_file): that orchestrator finished the job


def _trust_dir(state: Path, trust: str, extra: dict[str, dict]) -> Path:
    """This party's trust material, each file replaced, never written through a link in its directory."""
    out = private_dir(state / "trust")
    for name in (GPU_ROOT_CERT, TEE_ROOT_CERT, REFERENCE_FILE):
        atomic_write_bytes(out / name, (Path(trust) / name).read_bytes())
    for name, content in extra.items():
        atomic_write_bytes(out / name, (json.dumps(content, indent=2) + "\n").encode())
    return out


def _try_lock(path: str) -> int | None:
    try:  # only the services (root) take it; run/ is every party's (1777), so never through a link
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise BadInput(f"boot_lock: {path} cannot be taken ({exc.strerror}): a link or another file put in "
                       "its place in the cohort's run directory; remove it") from None
    owner = os.fstat(fd).st_uid
    if owner != os.geteuid():  # a party made it first, and could hold its lock for ever
        os.close(fd)
        raise BadInput(f"boot_lock: {path} belongs to uid {owner}, not to the services: a party put it in the "
                       "cohort's run directory; remove it")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def serve_holder(cfg: HolderService, stop: Stopping) -> int:
    """Serve this holder until the job is done or we stop; a new CVM rejoins an orchestrator that went away."""
    name = cfg.name
    state = private_dir(cfg.state_dir)
    gpu = gpu_socket(cfg.boot_lock)
    wait_for_sockets(name, {"the host": cfg.host_socket, "the GPU": gpu}, stop)
    policy = dataclasses.replace(cfg.policy.to_policy(""), gpu_reference_values=Path(REFERENCE_FILE))  # beside it
    refuse_planted(state, cfg.uid)  # its TLS key signs its releases: never one someone else made
    own_state(state, cfg.uid)
    from gputravel.service.budget import check_budget_at_start  # lazy: the ledger's imports, holders' alone

    check_budget_at_start(cfg)  # its epsilon cap: nothing sent to a job past it, or not in its ledger
    with as_party(cfg.uid):  # inside the holder's own tree: as the holder, so no link of its reaches root's files
        trust = _trust_dir(state, cfg.trust_dir, {POLICY_FILE: policy.to_json()})
        pki = private_dir(state / "pki")
        home = private_dir(state / "home")
    while True:
        outcome = _serve_holder_once(cfg, pki, trust, home, stop)
        if outcome is not None:
            return outcome
        log(name, "rejoining", why="the orchestrator went away before the job was done")


def _serve_holder_once(cfg: HolderService, pki: Path, trust: Path, home: Path, stop: Stopping) -> int | None:
    """One holder CVM, from boot to its end: the exit status, or None to boot another."""
    name = cfg.name
    lock = _try_lock(cfg.boot_lock)  # None: the orchestrator has the GPU, we join late
    config = {"name": name, "dataset_path": cfg.data, "host_socket": cfg.host_socket, "pki_dir": str(pki),
              "layout": cfg.layout.to_layout(), "dataset_format": cfg.format, "trust_dir": str(trust),
              "eval_share": cfg.eval_share, "eval_seed": cfg.eval_seed,
              "probe_at_boot": lock is not None, "hardware": cfg.hardware, "device_timeout": cfg.device_timeout,
              "sign_release": cfg.sign_release, "self_sign": name}
    child = PartyChild("holder", config, uid=cfg.uid, home=home)
    try:
        ready = child.ready(BOOT_TIMEOUT)
        if lock is not None:
            os.close(lock)  # probed: the next CVM may take the GPU
            lock = None
        publish_certificate(pki / f"{name}.pem", Path(cfg.public_dir) / f"holder-{name}.pem", name, cfg.uid)
        log(name, "up", dataset_bytes=ready.detail.get("dataset_bytes"), late=config["probe_at_boot"] is False)
        if not _join(cfg, child, pki, stop):
            return _leave_and_stop(name, child, joined=False)
        while child.alive() and not stop():
            time.sleep(0.2)
        if stop():
            return _leave_and_stop(name, child, joined=True)
        if not (Path(cfg.public_dir) / public_file(cfg.orchestrator, DONE_FILE)).exists():
            return None
        log(name, "exited", status=child.proc.returncode, why="the job is done")
        return child.proc.returncode or 0
    finally:
        if lock is not None:
            os.close(lock)
        child.close()


def _join(cfg: HolderService, child: PartyChild, pki: Path, stop: Stopping) -> bool:
    """Pin our orchestrator's certificate, then join (attesting it) until it works or we stop."""
    cert = Path(cfg.public_dir) / f"{cfg.orchestrator}.pem"
    wait_for(cfg.name, f"the orchestrator's certificate at {cert}", cert.exists, stop)
    said = 0.0
    while not stop():
        with as_party(cfg.uid):  # its own pki directory: as the holder
            orchestrator = one_certificate(cert.read_bytes(), ORCHESTRATOR, cert)
            pin_peers(pki, cfg.name, [orchestrator])  # as published now (a restarted orchestrator keeps its key)
        child.control.send(JoinCohort(host=cfg.orchestrator_host, port=cfg.orchestrator_port))
        reply = child.control.recv(timeout=BOOT_TIMEOUT).message
        if isinstance(reply, Joined):
            log(cfg.name, "joined", measurement=reply.measurement.hex(), gpu=reply.gpu_serial)
            return True
        if isinstance(reply, Failed) and (reply.kind.startswith("Attestation") or reply.kind == "BadInput"):
            log(cfg.name, "refused", why=f"{reply.kind}: {reply.reason}")  # our policy or config said no: final
            return False
        if time.monotonic() - said >= 5:
            why = f"{reply.kind}: {reply.reason}" if isinstance(reply, Failed) else type(reply).__name__
            log(cfg.name, "waiting", waiting_for=f"the orchestrator at {cfg.orchestrator_host}:{cfg.orchestrator_port}",
                last=why)
            said = time.monotonic()
        time.sleep(1)
    return False


def _leave_and_stop(name: str, child: PartyChild, joined: bool) -> int:
    """SIGTERM: leave the cohort first (a goodbye the orchestrator reads), then stop."""
    if joined and child.alive():
        try:
            child.control.send(Leave(reason="service stopped"))
            reply = child.control.recv(timeout=30).message
            log(name, "left" if isinstance(reply, Left) else "leave-failed", reply=type(reply).__name__)
        except GputravelError as exc:
            log(name, "leave-failed", why=type(exc).__name__)
    child.stop()
    log(name, "stopped")
    return 0


def serve_orchestrator(cfg: OrchestratorService, stop: Stopping) -> int:
    name = orchestrator_party(cfg.rank)  # "orchestrator"; rank K of several GPUs: "orchestrator-K"
    state = private_dir(cfg.state_dir)
    own_state(state, cfg.uid)
    gpu = cfg.gpu_link_socket
    # A job with a manifest seals its checkpoints with the key broker's keys: it waits for the broker too.
    broker = {"the key broker": cfg.broker_socket} if cfg.manifest_json else {}
    wait_for_sockets(name, {"the host": cfg.host_socket, "the GPU": gpu, **broker}, stop)
    (Path(cfg.public_dir) / public_file(name, DONE_FILE)).unlink(missing_ok=True)  # a job under way again (resumed)
    lock = _hold_boot_lock(name, cfg.boot_lock, stop)  # held for our whole life: later holders join late
    with as_party(cfg.uid):  # inside the orchestrator's own tree: as the orchestrator
        pki = private_dir(state / "pki")
    certs = {h: Path(cfg.public_dir) / f"holder-{h}.pem" for h in cfg.holders}
    for h, path in certs.items():
        wait_for(name, f"holder {h}'s certificate at {path}", path.exists, stop)
    pinned = b"".join(one_certificate(p.read_bytes(), h, p) for h, p in certs.items())  # one each, theirs
    with as_party(cfg.uid):
        atomic_write_bytes(pki / "ca.pem", pinned)
    tdx, link, child = None, None, None
    try:
        tdx, quoting = _start_tdx_module(cfg, state, platform_dir(Path(cfg.cohort_dir), cfg.rank))
        with as_party(cfg.uid):
            trust = _trust_dir(state, cfg.trust_dir, {LIMITS_FILE: {"max_evidence_age_s": cfg.max_evidence_age_s,
                                                                    "quoting_socket": quoting.socket}})
            home = private_dir(state / "home")
        engine = dataclasses.asdict(orchestrator_engine_config(cfg, pki_dir=str(pki), trust_dir=str(trust)))
        own_state(private_dir(cfg.job.run_dir), cfg.uid)
        measured = QuotingLaunch.measure_launch(engine, {})
        link = _gpu_link(gpu, cfg.uid, registered(cfg, f"gpu-{cfg.rank}").get("uid", -1))  # our GPU's account
        child = PartyChild(ORCHESTRATOR, {**engine, "self_sign": ORCHESTRATOR}, extra=link, uid=cfg.uid, home=home)
        quoting.register(tdx.control, child.proc.pid, cfg.uid if cfg.uid >= 0 else None, measured, BOOT_TIMEOUT)
        ready = child.ready(BOOT_TIMEOUT)
        publish_certificate(pki / f"{ORCHESTRATOR}.pem", Path(cfg.public_dir) / f"{name}.pem", ORCHESTRATOR, cfg.uid)
        log(name, "up", port=ready.detail.get("port"), measurement=measured.hex(),
            **({"rank": cfg.rank, "world_size": cfg.world_size} if cfg.shares else {}))
        return _run_job(cfg, child, state, stop)
    finally:
        for c in (child, tdx, link):
            if c is not None:
                c.close()
        os.close(lock)


def _hold_boot_lock(name: str, path: str, stop: Stopping) -> int:
    fd: list[int | None] = [None]

    def taken() -> bool:
        fd[0] = _try_lock(path)
        return fd[0] is not None

    wait_for(name, f"the GPU's boot lock {path} (a holder is probing)", taken, stop)
    assert fd[0] is not None
    return fd[0]


def _gpu_link(path: str, uid: int, gpu_uid: int) -> socket.socket:
    """Our private link to the GPU, connected as our account (the device checks it); the peer must
    be our GPU's account: a party that bound its name first must not be handed the dataset."""
    link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with as_party(uid):
        link.connect(path)
    peer = struct.unpack("3i", link.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
    if gpu_uid >= 0 and peer != gpu_uid:
        link.close()
        raise BadInput(f"gpu_link_socket: {path} is served by uid {peer}, not the GPU's ({gpu_uid}): a party took "
                       "its name in the run directory; stop it and start the GPU again")
    return link


def _start_tdx_module(cfg: OrchestratorService, state: Path, platform: Path) -> tuple[PartyChild, QuotingLaunch]:
    """The TDX module under its own account; its directory is searchable, so the orchestrator reaches its socket."""
    socket_path = quoting_socket(str(state))
    home = Path(socket_path).parent
    home.mkdir(mode=0o711, exist_ok=True)
    if cfg.tdx_uid >= 0:
        isolation.give(home, cfg.tdx_uid, 0o711)
    quoting = QuotingLaunch.at(socket_path)
    if os.path.exists(quoting.socket) and not unix_listening(quoting.socket):
        os.unlink(quoting.socket)  # left by a module that stopped with its orchestrator
    config = {**quoting.config, "key_dir": str(home / "key")}  # it keeps its quoting key there (0700)
    tdx = PartyChild("tdx-module", config, stop_by="close", uid=cfg.tdx_uid, home=home)
    try:
        if not tdx.ready(BOOT_TIMEOUT).detail.get("certified"):
            _certify_quoting_key(tdx, platform)
        else:  # certified at an earlier start: a root copy left by a service killed before deleting it goes now
            (platform / TEE_ROOT_KEY).unlink(missing_ok=True)
    except BaseException:
        tdx.close()
        raise
    return tdx, quoting


def _certify_quoting_key(tdx: PartyChild, platform: Path) -> None:
    """First start: the platform's key certifies the module's, then is deleted, so nobody (this
    operator included) can certify another quoting key and quote a measurement of their choosing."""
    if not (platform / TEE_ROOT_KEY).exists():  # the cohort's platform/: root's alone (service/registry.py)
        raise BadInput(f"the TDX module has no certified quoting key and the platform's provisioning key at "
                       f"{platform} is gone (used once already): initialise the cohort again")
    authority = CohortTrust(platform, "", "", tee_root=load_authority(platform, "tee"))
    QuotingLaunch.certify(tdx.control, authority, BOOT_TIMEOUT)
    (platform / TEE_ROOT_KEY).unlink()


def _run_job(cfg: OrchestratorService, child: PartyChild, state: Path, stop: Stopping) -> int:
    """Wait for the holders to join, then train (resuming a checkpoint found), saying it in the log and status.json."""
    name = orchestrator_party(cfg.rank)  # the name this rank logs and publishes under
    status, stopping, said = state / STATUS_FILE, False, 0.0
    _say_status(cfg, status, {"phase": "admitting", "members": [], "step": 0})
    child.control.send(AwaitHolders(names=tuple(cfg.holders), timeout=3600.0))
    log(name, "waiting", waiting_for=f"holders {', '.join(cfg.holders)} to join")
    joined = child.control.recv(timeout=3700.0).message
    if isinstance(joined, Failed):
        raise error_from(joined, "the holders did not join")
    if not isinstance(joined, Holders):
        raise ProtocolError(f"the orchestrator answered AwaitHolders with {type(joined).__name__}")
    log(name, "admitted", holders=sorted(joined.dataset_bytes))
    run_dir = Path(cfg.job.run_dir)
    checkpoint = run_dir / "checkpoint.pt"
    train = cfg.job.train_config()
    child.control.send(Train(config_json=train.canonical_json(), run_dir=str(run_dir),
                             resume_checkpoint=str(checkpoint) if checkpoint.exists() else "",
                             rank=cfg.rank, world_size=cfg.world_size,
                             master=f"{cfg.ranks_host}:{cfg.ranks_port}" if cfg.shares else "", ifname="",
                             shares=tuple(tuple(share) for share in cfg.shares),
                             ranks_context=bytes.fromhex(cfg.ranks_context)))
    while True:
        if stop() and not stopping:
            # It checkpoints at the next step; with several GPUs every rank stops at that step with it.
            child.control.send(Shutdown())
            stopping = True
        msg = child.control.recv(timeout=STOP_WAIT_S if stopping else cfg.holder_timeout + 60).message
        if isinstance(msg, TrainStep):
            now = time.monotonic()
            if now - said >= STATUS_EVERY_S:  # two whole-file writes a step would pace the service, not the job
                said = now
                _say_status(cfg, status, {"phase": "training", "members": sorted(joined.dataset_bytes),
                                          "step": msg.step, "loss": msg.loss, "travels": msg.travels,
                                          "gpu_at": msg.holder})
            if msg.step % 5 == 0:
                log(name, "step", step=msg.step, loss=round(msg.loss, 4))
            continue
        report = json.loads(msg.report_json) if isinstance(msg, TrainDone) else None
        if report is not None and report.get("stopped"):
            done = len(report["losses"])
            _say_status(cfg, status, {"phase": "stopped", "members": sorted(joined.dataset_bytes), "step": done})
            log(name, "stopped", why="signal" if stopping else "another rank was stopped", step=done,
                checkpoint=str(checkpoint) if cfg.rank == 0 else "")
            return 0
        elif report is not None:
            write_json(run_dir / "report.json", report)
            _say_status(cfg, status, {"phase": "done", "members": sorted(joined.dataset_bytes), "step": train.steps})
            if (state / AUDIT_LOG).exists():  # public: offsets and digests, no data or keys, for holders to check
                publish(state / AUDIT_LOG, Path(cfg.public_dir) / public_file(name, AUDIT_LOG), cfg.uid)
            atomic_write_bytes(Path(cfg.public_dir) / public_file(name, DONE_FILE), b"done\n")  # its holders end
            log(name, "trained", steps=train.steps, run_dir=str(run_dir))
            return 0
        elif isinstance(msg, Failed):
            log(name, "failed", kind=msg.kind, why=msg.reason)
            return 1


PUBLIC_STATUS = ("phase", "members", "step", "travels", "gpu_at")  # what every party may know


def _say_status(cfg: OrchestratorService, path: Path, status: dict) -> None:
    """The job's state in our state directory; what any party may know (no loss) in the public one."""
    write_json(path, status)
    public = Path(cfg.public_dir) / public_file(orchestrator_party(cfg.rank), STATUS_FILE)
    write_json(public, {k: v for k, v in status.items() if k in PUBLIC_STATUS})
