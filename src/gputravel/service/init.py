"""`gputravel cohort init` (issue 16; docs/deploy.md): each party's config, the registry, the
public trust anchors and empty state directories, standing for the hardware vendors and the
consortium's agreement. The emulated vendors' keys (vendor/gpu-K/, platform[-K]/) are root's
alone, outside every party's tree, where a party could rename or relink them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

import tomli_w
from pydantic import ValidationError

from gputravel.attest import GpuIssuer, init_roots, issue_gpu_ca, load_authority
from gputravel.attest.provision import REFERENCE_FILE
from gputravel.attest.roots import GPU_ROOT_KEY, TEE_ROOT_CERT, TEE_ROOT_KEY
from gputravel.cohort import capacity, isolation, stopping
from gputravel.cohort.config import RESERVED_TEXT, is_holder_name
from gputravel.broker.state import IDENTITY_FILE, SECRET_FILE
from gputravel.cohort.trust import measure_orchestrator
from gputravel.orchestrator.job import job_digest
from gputravel.data.records import RecordSchema, common_schema, is_record_dataset
from gputravel.data.tokenizer import KNOWN, default_tokenizer, resolve_record
from gputravel.errors import BadInput
from gputravel.files import RECORDS, TOKENS, DatasetFormat, atomic_write_bytes, open_plain
from gputravel.protocol.layout import MIB, record_bytes_for
from gputravel.service.config import (
    BROKER,
    ORCHESTRATOR,
    BrokerService,
    GpuService,
    HolderService,
    HostService,
    JobSection,
    LayoutSection,
    OrchestratorService,
    PolicySection,
    ServiceConfig,
    explain_built,
    host_party,
    orchestrator_engine_config,
    orchestrator_party,
    validate_service,
)
from gputravel.service.registry import VENDOR_DIR, platform_dir, write_registry
from gputravel.service.status import HOLDER_PKI
from gputravel.train.schedule import check_shares, partition

__all__ = ["carry_state", "data_bytes", "data_format", "data_schema", "holder_shares", "init_cohort",
           "job_tokenizer", "write_service"]

VRAM_MARGIN = 64 * MIB  # the GPU's memory beyond the dataset buffer, as the supervisor gives it


def _check_holders(holders: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    if not holders:
        raise BadInput("a cohort needs at least one holder: --holder NAME=PATH")
    checked: list[tuple[str, str]] = []
    for name, path in holders:
        if not is_holder_name(name):
            raise BadInput(f"--holder {name}=...: a name is 1-32 of a-z, 0-9 and '-', and {RESERVED_TEXT} "
                           "(the launcher's rule, cohort/config.py)")
        if name in dict(checked):
            raise BadInput(f"--holder {name}=...: given twice")
        if not os.path.exists(path):
            raise BadInput(f"--holder {name}={path}: no such file or directory")
        checked.append((name, os.path.abspath(path)))
    return checked


def _tokenizer_of(path: str) -> str:
    """Which tokenizer a holder's data is (or will be) tokenized with, without reading its data."""
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    if p.suffix == ".bin" or any(folder.glob("*.bin")):
        return resolve_record(folder, None).name  # the record, or GPT-2 as llm.c's own scripts write
    return default_tokenizer().name  # text, tokenized when the holder loads it


def job_tokenizer(holders: Sequence[tuple[str, str]]) -> str:
    """The tokenizer every holder's data agrees on, and one this package knows."""
    names = {name: _tokenizer_of(path) for name, path in holders}
    if len(set(names.values())) != 1:
        raise BadInput(f"holders disagree on the tokenizer: {names}; prepare every holder's data with the same one")
    found = next(iter(names.values()))
    if found not in KNOWN:
        raise BadInput(f"unknown tokenizer {found!r} in the holders' tokenizer.json: known are {', '.join(KNOWN)}")
    return found


def data_format(path: str) -> DatasetFormat:
    """A holder's data format: a record dataset's directory, else tokens (shards or text)."""
    return RECORDS if is_record_dataset(path) else TOKENS


def data_schema(holders: Sequence[tuple[str, str]]) -> str:
    """The schema every holder's records agree on (canonical JSON; "": they hold tokens), read
    without their records; BadInput naming a holder that holds otherwise, and the field."""
    kinds = {name: data_format(path) for name, path in holders}
    if len(set(kinds.values())) != 1:
        raise BadInput(f"holders disagree on their data: {kinds}; give every holder records, or every one tokens")
    return common_schema(holders).canonical_json() if RECORDS in kinds.values() else ""


def _check_job_schema(section: JobSection, holders: Sequence[tuple[str, str]], schema: str) -> None:
    """A job stating another schema than its holders' records: refused here, not at every join."""
    want = section.record_schema
    if bool(want) != bool(schema):  # records for a tokens job, or the reverse: every join would be refused
        held = "records" if schema else "tokens"
        raise BadInput(f"job.record_schema: the holders hold {held}, the job trains on "
                       f"{'records' if want else 'tokens'}")
    if not want:
        return
    try:
        diff = RecordSchema.from_json(want).difference(RecordSchema.from_json(schema))
    except BadInput as exc:
        raise BadInput(f"job.record_schema: {exc}") from None
    if diff:
        names = ", ".join(repr(n) for n, _ in holders)
        raise BadInput(f"holders {names} hold records of another schema than job.record_schema: {diff}")


def _record_bytes(buffer_bytes: int) -> int:
    try:
        return record_bytes_for(buffer_bytes)
    except BadInput as exc:
        raise BadInput(f"--buffer-kib: {exc}") from None


def _check_gpus(gpus: int, holders: int, buffer_bytes: int) -> None:
    """--gpus within this machine: one block of uids, each GPU's VRAM populated at boot, a holder per GPU at least."""
    if holders > capacity.MAX_HOLDERS:
        raise BadInput(f"--holder: a cohort has at most {capacity.MAX_HOLDERS} holders, not {holders}")
    most = min(holders, (isolation.BLOCK - 2 - holders) // len(_PER_GPU))  # _uids: base + 1 onwards, a broker
    if type(gpus) is not int or not 1 <= gpus <= most:
        raise BadInput(f"--gpus must be between 1 and {most}: each GPU travels to a share of the {holders} holder"
                       f"{'s' if holders != 1 else ''}, and the parties share a block of {isolation.BLOCK} uids, "
                       f"got {gpus!r}")
    each = -(-(buffer_bytes + VRAM_MARGIN) // MIB) + capacity.PROCESS_MIB
    capacity.check_memory(gpus * each, f"--gpus {gpus}: the GPUs' services need", "use fewer --gpus",
                          f"{each} MiB a GPU: its VRAM, populated when it boots, and its process")


def _free_ports(host: str, count: int) -> list[int]:
    """`count` distinct free ports: each held until all are picked, so none is picked twice."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def data_bytes(path: str | Path) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def holder_shares(holders: Sequence[tuple[str, str]], gpus: int, shares: Sequence[Sequence[str]] | None = None,
                  where: str = "shares") -> list[list[str]]:
    """Each GPU's holders: `shares` checked, else balanced by their data's bytes; a holder is in exactly one."""
    if shares is None:
        return [list(s) for s in partition({name: data_bytes(path) for name, path in holders}, gpus)]
    return [list(s) for s in check_shares(shares, [n for n, _ in holders], gpus, where)]


def write_service(path: Path, cfg: ServiceConfig) -> Path:
    """Write `cfg` as TOML, after checking it reads back to the same config."""
    data = cfg.model_dump(mode="python")
    text = tomli_w.dumps(data)
    if validate_service(tomllib.loads(text), str(path)).model_dump(mode="python") != data:
        raise AssertionError(f"{path}: the config does not survive a round trip through TOML")
    header = (f"# gputravel {cfg.party} service, written by `gputravel cohort init`.\n"
              "# Every key is explained in docs/deploy.md. Nothing here is secret: keys live in state_dir.\n\n")
    atomic_write_bytes(path, (header + text).encode())
    return path


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True)
    path.chmod(0o700)  # whatever the umask
    return path


def _open_to_parties(d: Path) -> None:
    """What every party reads or passes through, whatever init's umask (077 left them 0700 and
    no party could start): the public anchors, and the way to each party's own state directory."""
    os.chmod(d / "state", 0o711)  # searchable, not listable
    os.chmod(d / "public", 0o755)
    os.chmod(d / "trust", 0o755)
    for item in (d / "trust").iterdir():
        if item.is_file() and not item.is_symlink():
            item.chmod(0o644)  # public by design: certificates and reference values, no key


def _provision(d: Path, gpus: int) -> list[GpuIssuer]:
    """The emulated vendors' roots, a GPU CA per GPU, a CPU-TEE root per rank; then the root keys leave trust/."""
    trust = d / "trust"
    init_roots(trust)
    gpu_root = load_authority(trust, "gpu")
    issuers = [issue_gpu_ca(gpu_root, serial=f"GPU-EMU-{k}") for k in range(gpus)]
    vendor = _private_dir(d / VENDOR_DIR)
    for k, issuer in enumerate(issuers):
        issuer.save(_private_dir(vendor / f"gpu-{k}"))
        platform = _private_dir(platform_dir(d, k))
        for name in (TEE_ROOT_CERT, TEE_ROOT_KEY):
            shutil.copy2(trust / name, platform / name)  # the key keeps its 0600
    for name in (GPU_ROOT_KEY, TEE_ROOT_KEY):
        (trust / name).unlink()
    issuers[0].reference_values().save(trust / REFERENCE_FILE)  # what the vendor publishes
    return issuers


def _configs(d: Path, holders: list[tuple[str, str]], issuers: list[GpuIssuer], job: JobSection,
             ports: list[int], shares: list[list[str]], hardware: str = "emulated") -> list[tuple[Path, ServiceConfig]]:
    """Every party's config, a stack per GPU; `ports`: each orchestrator's listener, then rank 0's for the ranks."""
    run, state = d / "run", d / "state"
    layout = LayoutSection(record_bytes=_record_bytes(job.buffer_bytes))
    shared = {"trust_dir": str(d / "trust"), "public_dir": str(d / "public")}
    gpus = len(issuers)
    uid = _uids(gpus, [n for n, _ in holders])
    ranks = {"shares": shares, "ranks_port": ports[gpus], "ranks_context": os.urandom(32).hex()} if gpus > 1 else {}
    gpu_of = {name: k for k, share in enumerate(shares) for name in share}
    # The key broker: every orchestrator asks it on its socket, and trusts the identity the broker made
    # itself, which a job's manifest names (service/job.py); a job alone uses no broker.
    broker = {"broker_socket": str(run / "broker.sock")}
    out: list[tuple[Path, ServiceConfig]] = []
    for k in range(gpus):
        host, orch_name = host_party(k), orchestrator_party(k)
        host_sock = str(run / f"{host}.sock")
        out.append((d / f"{host}.toml", HostService(party="host", cohort_dir=str(d), index=k, state_dir=str(state / host),
                                                    socket=host_sock, uid=uid[host], hardware=hardware)))
        out.append((d / f"gpu-{k}.toml", GpuService(
            party="gpu", cohort_dir=str(d), index=k, state_dir=str(state / f"gpu-{k}"), host_socket=host_sock,
            link_socket=str(run / f"gpu-{k}.sock"), boot_lock=str(run / f"gpu-{k}.lock"),
            vram_bytes=job.buffer_bytes + VRAM_MARGIN, layout=layout, uid=uid[f"gpu-{k}"],
            orchestrator_uid=uid[orch_name])))
        out.append((d / f"{orch_name}.toml", OrchestratorService(
            party="orchestrator", cohort_dir=str(d), state_dir=str(state / orch_name), host_socket=host_sock,
            gpu_link_socket=str(run / f"gpu-{k}.sock"), boot_lock=str(run / f"gpu-{k}.lock"), listen_port=ports[k],
            holders=list(shares[k]), layout=layout, job=job if k == 0 else job.model_copy(
                update={"run_dir": str(d / f"run-dir-{k}")}),
            uid=uid[orch_name], tdx_uid=uid[_tdx(k)], hardware=hardware, rank=k, **ranks, **broker, **shared)))
    # What each holder pins: the orchestrators' code and configuration (placement and job left out),
    # one measurement for every rank, which the ranks check in one another's quotes too; and what it
    # approves: the job's digest (its manifest's, if any), which every rank extends into its RTMR[3].
    engines = [orchestrator_engine_config(o, pki_dir="", trust_dir="") for _, o in out
               if isinstance(o, OrchestratorService)]
    measured = {measure_orchestrator(e).hex() for e in engines}
    jobs = {job_digest(e).hex() for e in engines}
    if len(measured) != 1 or len(jobs) != 1:
        raise AssertionError(f"the ranks' orchestrators measure differently: {sorted(measured)}, jobs {sorted(jobs)}")
    out.append((d / f"{BROKER}.toml", BrokerService(
        party=BROKER, cohort_dir=str(d), state_dir=str(state / BROKER), socket=broker["broker_socket"],
        trust_dir=shared["trust_dir"], accepted_measurements=sorted(measured), uid=uid[BROKER])))
    drivers = sorted({i.driver_version for i in issuers})
    for name, data in holders:
        k = gpu_of[name]  # the one GPU this holder serves: its host route, lock and orchestrator
        policy = PolicySection(orchestrator_measurements=sorted(measured), gpu_driver_versions=drivers,
                               approved_jobs=sorted(jobs))  # the job alone: no manifest to review
        out.append((d / f"holder-{name}.toml", HolderService(
            party="holder", cohort_dir=str(d), name=name, state_dir=str(state / f"holder-{name}"),
            host_socket=str(run / f"{host_party(k)}.sock"), boot_lock=str(run / f"gpu-{k}.lock"), data=data,
            format=data_format(data),
            orchestrator=orchestrator_party(k), orchestrator_port=ports[k], layout=layout, policy=policy,
            uid=uid[f"holder-{name}"], hardware=hardware, **shared)))
    return out


_PER_GPU = ("host", "gpu", ORCHESTRATOR, "tdx-module")  # each GPU's stack: a party each


def _tdx(rank: int) -> str:
    return "tdx-module" if rank == 0 else f"tdx-module-{rank}"


def _uids(gpus: int, holders: list[str]) -> dict[str, int]:
    """One account per party when init runs as root; -1 otherwise: each runs as whoever starts its service."""
    parties = [*(p for k in range(gpus) for p in (host_party(k), orchestrator_party(k), _tdx(k))),
               *(f"gpu-{k}" for k in range(gpus)), *(f"holder-{n}" for n in holders), BROKER]
    if not isolation.decide(None)[0]:
        return dict.fromkeys(parties, -1)
    base = isolation.allocate_block()
    return {party: base + 1 + i for i, party in enumerate(parties)}


def init_cohort(directory: str | Path, holders: Sequence[tuple[str, str]], *, gpus: int = 1,
                steps: int | None = None, buffer_bytes: int | None = None,
                job: Mapping[str, object] | None = None, hardware: str = "emulated",
                shares: Sequence[Sequence[str]] | None = None, carry: str | Path | None = None) -> list[Path]:
    """Write a new cohort directory; its config files. `job`: the [job] table beyond steps and buffer
    (train/job.py's defaults; the data fixes the tokenizer); `shares`: each GPU's holders (None: balanced).
    Every holder approves the job alone; a job with a manifest is set later (service/job.py), once its
    parties made their identities. `carry`: the identities of an earlier cohort's parties to carry on,
    laid out as its state/ (carry_state), so that a sealed checkpoint reopens. Init makes no party's key."""
    d = Path(directory).resolve()
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        raise BadInput(f"{d} exists and is not an empty directory; cohort init writes a new one")
    closed = isolation.unreachable(d.parent) if isolation.decide(None)[0] else None
    if closed is not None:  # as root each party runs under its own account, which must reach D
        raise BadInput(f"{d}: each party's account must reach it, but others cannot search {closed}; "
                       "choose a directory under one they can (or chmod o+x it)")
    checked = _check_holders(holders)
    if steps is not None and (type(steps) is not int or steps < 1):
        raise BadInput(f"--steps: expected a positive integer, got {steps!r}")
    if buffer_bytes is not None:
        _record_bytes(buffer_bytes)
    tokenizer, schema = job_tokenizer(checked), data_schema(checked)
    overrides = {k: v for k, v in (("steps", steps), ("buffer_bytes", buffer_bytes)) if v is not None}
    # The data fixes the tokenizer, and the schema of records (where the job has the key for it).
    found = {"record_schema": schema} if schema else {}
    fields = {"tokenizer": tokenizer, "vocab_size": KNOWN[tokenizer].vocab_size, **found, **(job or {}), **overrides}
    section = JobSection(run_dir=str(d / "run-dir"), **fields)  # BadInput naming job.KEY
    _check_job_schema(section, checked, schema)
    _check_gpus(gpus, len(checked), section.buffer_bytes)
    split = holder_shares(checked, gpus, shares) if gpus > 1 or shares is not None else [[n for n, _ in checked]]
    ports = _free_ports("127.0.0.1", gpus + (gpus > 1))  # each rank's listener, and rank 0's for the ranks
    made = not d.exists()
    try:
        for sub in ("public", "run"):
            (d / sub).mkdir(parents=True)
        os.chmod(d / "run", 0o1777)  # each party binds its own socket here; sticky: none removes another's
        for party in (*(p for k in range(gpus) for p in (host_party(k), f"gpu-{k}", orchestrator_party(k))),
                      *(f"holder-{n}" for n, _ in checked), BROKER):
            _private_dir(d / "state" / party)
        if carry is not None:
            _copy_keys(Path(carry), d / "state", [n for n, _ in checked])
        issuers = _provision(d, gpus)
        _open_to_parties(d)
        try:
            configs = _configs(d, checked, issuers, section, ports, split, hardware)
        except ValidationError as exc:  # a path the schema refuses: a socket path too long for D
            raise explain_built(exc, str(d)) from None
        written = [write_service(path, cfg) for path, cfg in configs]
        if carry is not None:  # the carried identities are their parties' own, made in an earlier cohort
            for _, cfg in configs:
                if isinstance(cfg, (HolderService, BrokerService)) and cfg.uid >= 0:
                    isolation.give(Path(cfg.state_dir), cfg.uid, 0o700)
        write_registry(d, {path.stem: cfg for path, cfg in configs})
        os.chmod(d, 0o755)  # the registry's word rests on nobody else writing here (service/registry.py)
        return written
    except BaseException:  # Ctrl-C too, and SIGTERM where the caller made it unwind (stopping.catch_term)
        with stopping.uninterrupted():  # a second signal cannot leave the undoing half done
            _undo(d, made)
        raise


def _kept_files(holders: Sequence[str]) -> list[str]:
    """The files of a cohort's state/ a sealed checkpoint's key depends on: the broker's secret and
    identity, and the holders' TLS identities (the manifest, whose digest keys it, names both)."""
    return [f"{BROKER}/{SECRET_FILE}", f"{BROKER}/{IDENTITY_FILE}",
            *(f"holder-{n}/{HOLDER_PKI}/{n}{ext}" for n in holders for ext in (".key", ".pem"))]


def _copy_keys(src: Path, dest: Path, holders: Sequence[str]) -> None:
    for rel in _kept_files(holders):
        if os.path.lexists(src / rel):
            for parent in reversed((dest / rel).relative_to(dest).parents[:-1]):
                (dest / parent).mkdir(mode=0o700, exist_ok=True)
            _copy_private(src / rel, dest / rel)


def carry_state(state: Path, dest: Path, holders: Sequence[str]) -> None:
    """Keep the keys a sealed checkpoint depends on (_kept_files) in `dest` (0700, files 0600), laid
    out as `state`, for a later cohort to carry on (init_cohort's `carry`)."""
    if os.path.lexists(dest):
        check_own_keys(dest)
    else:
        dest.mkdir(mode=0o700, parents=True)
    _copy_keys(state, dest, holders)


def check_own_keys(keys: Path) -> None:
    """`keys` and all in it are this account's alone: no link, nothing another account owns or may
    write, the directories 0700; else BadInput. Another account's planted keys are never carried on:
    the second review of issue 28 had one plant a broker secret it knew."""
    me = os.geteuid()
    for root, dirs, files in os.walk(keys, followlinks=False):
        for path in [Path(root), *(Path(root) / n for n in dirs + files)]:
            st = os.lstat(path)
            bad = ("a link" if stat.S_ISLNK(st.st_mode) else "another account's" if st.st_uid != me
                   else "open to other accounts" if st.st_mode & 0o077 else "")
            if bad:
                raise BadInput(f"{path} is {bad}: the keys a sealed run needs are refused; remove {keys} "
                               "and start the run afresh")


def _copy_private(src: Path, dest: Path) -> None:
    """A key file copied as a plain file (no link followed), 0600 from its first byte."""
    try:
        with os.fdopen(open_plain(src), "rb") as f:
            data = f.read(1 << 16)
    except OSError as exc:
        raise BadInput(f"{src}: cannot read the key broker's state ({exc.strerror or exc})") from None
    tmp = dest.with_name(f".{dest.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, dest)


def _undo(d: Path, made: bool) -> None:
    """A failed init leaves the directory as it was (empty or absent)."""
    if made:
        shutil.rmtree(d, ignore_errors=True)
        return
    for child in d.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()
