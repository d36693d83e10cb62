"""`gputravel status --config FILE`: what that party may know without asking anyone; for a
holder, its travels in the published log, checked by signature, against the head it last
verified (a log cut short or of another job fails) and by its own chunk MACs.
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import gputravel
from gputravel.errors import BadInput, GputravelError
from gputravel.files import open_plain, read_plain, write_json
from gputravel.holder.cvm import Dataset, manifest_piece_bytes
from gputravel.holder.log_key import read_log_key
from gputravel.orchestrator.audit import AuditError, Entry, Failure, mismatched_chunks, verify_log
from gputravel.protocol.manifest import chunk_digest
from gputravel.service.config import (AUDIT_LOG, BROKER, STATUS_FILE, BrokerService, GpuService, HolderService, HostService, OrchestratorService,
                                      ServiceConfig, gpu_socket, party_name, public_file)
from gputravel.service.party import as_party
from gputravel.service.registry import bind

__all__ = ["STATUS_FILE", "cohort_status", "party_name"]

HEAD_FILE = "audit-head.json"  # in a holder's state_dir: the head of the published log it last verified
SHIPPED = Path(os.path.realpath(Path(gputravel.__file__).parent / "demo_data"))
HOLDER_PKI = "pki"  # in a holder's state_dir (service/members.py): its TLS key and its travel-log key
MAX_STATUS_BYTES = 1 << 20  # a status.json is a few hundred bytes; the party could make its own any size
_LOCAL = ("127.0.0.1", "localhost", "::1", "0.0.0.0", "::")


def _proc_net(name: str) -> list[list[str]] | None:
    """The rows of /proc/net/`name` below its header, split into fields; None if it cannot be read."""
    try:
        return [line.split() for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]]
    except OSError:
        return None


def _bound_unix_paths() -> set[str] | None:
    rows = _proc_net("unix")
    return None if rows is None else {fields[7] for fields in rows if len(fields) > 7}


def _unix_up(path: str, bound: set[str] | None) -> bool:
    # A socket file alone may be left over from a crash; bound means a live process holds it.
    return path in bound if bound is not None else Path(path).is_socket()


def _tcp_listening(port: int) -> bool:
    rows = [fields for name in ("tcp", "tcp6") for fields in _proc_net(name) or []]
    return any(len(f) > 3 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port for f in rows)  # 0A: LISTEN


def _services(cfg: ServiceConfig) -> dict[str, str]:
    bound = _bound_unix_paths()
    if isinstance(cfg, BrokerService):  # on no host route: the orchestrator asks it on its own socket
        return {BROKER: "up" if _unix_up(cfg.socket, bound) else "down"}
    host_sock = cfg.socket if isinstance(cfg, HostService) else cfg.host_socket
    up: dict[str, bool | None] = {"host": _unix_up(host_sock, bound)}  # this party's host route; None: remote
    if isinstance(cfg, GpuService):
        up[party_name(cfg)] = _unix_up(cfg.link_socket, bound)
    if isinstance(cfg, OrchestratorService):
        up[f"gpu-{cfg.rank}"] = _unix_up(cfg.gpu_link_socket, bound)
        up["orchestrator"] = _tcp_listening(cfg.listen_port)
    if isinstance(cfg, HolderService):
        up[Path(cfg.boot_lock).stem] = _unix_up(gpu_socket(cfg.boot_lock), bound)
        remote = cfg.orchestrator_host not in _LOCAL  # another machine's listener: not visible here
        up["orchestrator"] = None if remote else _tcp_listening(cfg.orchestrator_port)
    return {k: "remote" if v is None else "up" if v else "down" for k, v in up.items()}


def _own_status(path: Path, uid: int = -1) -> dict:
    """The status.json at `path`, read only if a plain file of root's or of party `uid` with one
    link: status runs as root, and an operator could link another party's private file there."""
    try:
        fd = open_plain(path)  # never through a link, nor blocked on a FIFO
    except FileNotFoundError:
        return {}
    except OSError as exc:
        return {"status_file": f"not read: {path} is not a plain file ({exc.strerror or exc})"}
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_nlink != 1 or st.st_uid not in {0, os.geteuid(), uid}:
            return {"status_file": f"not read: {path} is not its party's own file (uid {st.st_uid}, "
                                   f"{st.st_nlink} links)"}
        data = f.read(MAX_STATUS_BYTES + 1)
    try:
        found = json.loads(data) if len(data) <= MAX_STATUS_BYTES else None
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def _my_travels(cfg: HolderService) -> dict:
    """This holder's travels in its orchestrator's published log, verified; the head it keeps moves on."""
    log, cert = Path(cfg.public_dir) / public_file(cfg.orchestrator, AUDIT_LOG), Path(cfg.public_dir) / f"{cfg.orchestrator}.pem"
    if not (log.exists() and cert.exists()):
        return {"log": "not published"}
    head_file = Path(cfg.state_dir) / HEAD_FILE
    try:
        kept = _kept_head(head_file)
        summary = verify_log(log, cert.read_bytes(), cfg.name, allow_truncated_tail=True, known_head=kept)
    except (GputravelError, OSError) as exc:
        if isinstance(exc, AuditError) and exc.failure is Failure.HEAD:
            return {"log": f"does not verify: {exc} (the head this holder verified before, kept in {head_file}: "
                           "the log was cut short; if a new job began, delete that file)"}
        return {"log": f"does not verify: {exc}"}
    closed = "closed" if summary.closed else "not closed: entries may be missing at the end"
    if summary.continues is not None:  # a run resumed by another orchestrator: the earlier log holds the rest
        closed += "; it continues an earlier log of its job, which holds the travels before it"
    travels = [e for e in summary.entries if e.event.value == "travel"]
    out = {"log": f"verified, {summary.count} entries, {closed}", "log_closed": summary.closed,
           "log_job": summary.job.hex() if summary.job is not None else None, "log_travels": summary.travels,
           "my_travels": len(travels), "my_bytes": sum(e.chunk.nbytes for e in travels if e.chunk is not None)}
    if summary.count:
        out["log_head"] = summary.head_hash.hex()
        try:  # the next status refuses a log that no longer holds it
            write_json(head_file, {"seq": summary.head_seq, "hash": summary.head_hash.hex()})
        except OSError as exc:
            out["log_head_kept"] = f"no: {exc.strerror or type(exc).__name__}"
    out.update(_my_chunks(cfg, travels))
    return out


def _kept_head(path: Path) -> bytes | None:
    try:
        kept = json.loads(read_plain(path, 4096))
        return bytes.fromhex(kept["hash"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        raise BadInput(f"{path} does not hold a head (delete it to start again)") from None


def _holders_data(cfg: HolderService) -> Dataset:
    """The holder's data, opened as its account (root opening any path told an operator about
    another holder's data); the package's shipped data, which as_party cannot reach, as root."""
    # Laid out as the holder's CVM lays it out (a records dataset: in its pieces, held-out records last).
    opened = partial(Dataset, fmt=cfg.format, piece_bytes=manifest_piece_bytes(cfg.layout.to_layout()),
                     eval_share=cfg.eval_share, eval_seed=cfg.eval_seed)
    try:
        with as_party(cfg.uid):
            return opened(cfg.data)
    except (GputravelError, OSError):
        real = Path(os.path.realpath(cfg.data))  # resolved once: a link swapped now changes nothing
        if not real.is_relative_to(SHIPPED):
            raise
    return opened(str(real))  # public text, the package's own, in a tree only root writes


def _my_chunks(cfg: HolderService, travels: list[Entry]) -> dict:
    """Whether each travel's chunk MAC matches this holder's data under its travel-log key (never shown)."""
    logged = [e for e in travels if e.chunk_mac]
    if not logged:
        return {}
    try:
        with as_party(cfg.uid):  # the holder's own key and data, as its CVM reads them, never as root's
            key = read_log_key(Path(cfg.state_dir) / HOLDER_PKI)
        data = _holders_data(cfg)
    except (GputravelError, OSError) as exc:
        return {"my_chunks": f"not checked: {exc}"}
    piece = manifest_piece_bytes(cfg.layout.to_layout())

    def digest_of(offset: int, nbytes: int) -> bytes:
        if offset + nbytes > data.size:
            raise BadInput("the chunk lies past the end of this holder's data")
        return chunk_digest(data.view[offset : offset + nbytes], piece)

    bad = mismatched_chunks(logged, key, digest_of)
    if bad:
        return {"my_chunks": f"{len(bad)} of {len(logged)} do not match this holder's data (seq "
                             f"{', '.join(map(str, bad))})"}
    return {"my_chunks": f"all {len(logged)} match this holder's data"}


def cohort_status(cfg: ServiceConfig) -> dict:
    """What `gputravel status` shows, only for the party cohort init made and read as that party:
    as root, a config naming another party's state read its status, key and data (issue 30)."""
    bind(cfg, party_name(cfg))
    out: dict = {"config": cfg.source, "party": party_name(cfg), "services": _services(cfg)}
    if isinstance(cfg, (OrchestratorService, HolderService)):
        out["published"] = sorted(p.stem for p in Path(cfg.public_dir).glob("*.pem"))
    out.update({k: v for k, v in _own_status(Path(cfg.state_dir) / STATUS_FILE, cfg.uid).items() if k not in out})
    if isinstance(cfg, HolderService):  # the job as its orchestrator publishes it: members, the GPU, travels
        public = Path(cfg.public_dir) / public_file(cfg.orchestrator, STATUS_FILE)
        out.update({k: v for k, v in _own_status(public).items() if k not in out})
        out.update(_my_travels(cfg))
    out["running"] = any(v == "up" for v in out["services"].values())
    return out
