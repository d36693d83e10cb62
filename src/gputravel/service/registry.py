"""The cohort's registry: who each party is and where it may act, as `cohort init` made it.

A party's service runs as root (it gives its party an account of its own) and reads its config
from whoever starts it, so that config is an operator's input, not the cohort's word. The
registry, `D/cohort.registry`, is written once by init, owned by init's account (root when the
parties are isolated) and writable by nobody else. Before a service touches any file it
checks that its config agrees with the registry on every key that says who the party is and
where it acts (its name, account, state directory, sockets, lock, trust and public
directories, the orchestrator's run directory) and, with several GPUs, whom it serves (an
orchestrator's rank and every rank's share of the holders, a holder's orchestrator): a holder
serves one GPU. The keys an operator may tune (the job, the data, timeouts) are not in it.
"""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path
from typing import Any

import tomli_w

from gputravel.errors import BadInput
from gputravel.files import atomic_write_bytes

__all__ = ["PLATFORM_DIR", "REGISTRY_FILE", "VENDOR_DIR", "bind", "bound_keys", "platform_dir", "registered",
           "vendor_dir", "write_registry"]

REGISTRY_FILE = "cohort.registry"
# The emulated vendors' material, in the cohort directory and root's alone (0700): never inside
# a party's own tree, where the party could rename or relink it (the second hostile review of
# issue 30 had root hand it over that way). Found from cohort_dir, which the registry binds.
VENDOR_DIR, PLATFORM_DIR = "vendor", "platform"
MAX_REGISTRY_BYTES = 1 << 20
# What says who a party is and where it acts; "job.run_dir" is the [job] table's key. With
# several GPUs, whom it serves: an orchestrator's rank and the shares, a holder's orchestrator.
_BOUND = ("name", "index", "uid", "tdx_uid", "orchestrator_uid", "state_dir", "socket", "host_socket", "link_socket",
          "gpu_link_socket", "boot_lock", "trust_dir", "public_dir", "job.run_dir", "rank", "shares", "orchestrator")


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        if not hasattr(cfg, part):
            return None
        cfg = getattr(cfg, part)
    return cfg


def vendor_dir(cfg: Any) -> Path:
    """The GPU vendor's per-device CA for the GPU of `cfg` (a gpu service's config)."""
    return Path(cfg.cohort_dir) / VENDOR_DIR / f"gpu-{cfg.index}"


def platform_dir(cfg: Any) -> Path:
    """The CPU-TEE root that certifies the orchestrator's TDX module's key, once: each rank's
    module its own copy (platform/, platform-K/ for rank K), as each CVM's TDX module is
    provisioned on its own and every quote chains to one CPU-TEE root."""
    return platform_dir_of(Path(cfg.cohort_dir), getattr(cfg, "rank", 0))


def platform_dir_of(cohort_dir: Path, rank: int) -> Path:
    """Rank `rank`'s platform directory in `cohort_dir`: init writes it, the rank's service reads it."""
    return cohort_dir / (PLATFORM_DIR if rank == 0 else f"{PLATFORM_DIR}-{rank}")


def bound_keys(cfg: Any) -> dict[str, Any]:
    """The keys of `cfg` the registry binds, with their values."""
    return {k: v for k in _BOUND if (v := _get(cfg, k)) is not None}


def write_registry(directory: Path, parties: dict[str, Any]) -> Path:
    """D/cohort.registry, from each party's config as init wrote it (party name -> config)."""
    doc = {"directory": str(directory), "parties": {name: bound_keys(cfg) for name, cfg in parties.items()}}
    header = ("# gputravel cohort registry, written by `gputravel cohort init`: who each party is and where it\n"
              "# acts. A service refuses a config that disagrees with it (docs/deploy.md). Do not edit.\n\n")
    path = directory / REGISTRY_FILE
    atomic_write_bytes(path, (header + tomli_w.dumps(doc)).encode())
    os.chmod(path, 0o644)  # every service reads it; only its owner writes it
    return path


def _trusted(st: os.stat_result, what: str, path: str) -> None:
    """Owned by root or by us, and writable by nobody else: what the registry's word rests on."""
    owners = {0, os.geteuid()}
    if st.st_uid not in owners:
        raise BadInput(f"cohort_dir: {what} {path} belongs to uid {st.st_uid}, not to "
                       f"{' or '.join(map(str, sorted(owners)))}: anyone with that account could rewrite it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise BadInput(f"cohort_dir: {what} {path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})")


def _read(cohort_dir: str) -> dict[str, Any]:
    """The registry in `cohort_dir`, after checking that nobody else could have written it."""
    if cohort_dir.endswith("/") and cohort_dir != "/":
        raise BadInput(f"cohort_dir: expected the cohort directory's path without a trailing slash, got {cohort_dir}")
    if os.path.realpath(cohort_dir) != cohort_dir:
        raise BadInput(f"cohort_dir: {cohort_dir} goes through a link; name the cohort directory itself")
    try:
        st = os.lstat(cohort_dir)
    except OSError as exc:
        raise BadInput(f"cohort_dir: {cohort_dir} cannot be read ({exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise BadInput(f"cohort_dir: {cohort_dir} is not a directory")
    _trusted(st, "the cohort directory", cohort_dir)
    path = os.path.join(cohort_dir, REGISTRY_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise BadInput(f"cohort_dir: no registry at {path} ({exc.strerror}): a cohort from `gputravel cohort init` "
                       "has one; initialise the cohort again") from None
    with os.fdopen(fd, "rb") as f:
        fst = os.fstat(f.fileno())
        if not stat.S_ISREG(fst.st_mode):
            raise BadInput(f"cohort_dir: {path} is not a regular file")
        _trusted(fst, "the registry", path)
        data = f.read(MAX_REGISTRY_BYTES + 1)
    if len(data) > MAX_REGISTRY_BYTES:
        raise BadInput(f"cohort_dir: {path} is larger than a registry ({MAX_REGISTRY_BYTES} bytes)")
    try:
        doc = tomllib.loads(data.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
        raise BadInput(f"cohort_dir: {path} is not a registry cohort init wrote") from None
    if doc.get("directory") != cohort_dir or not isinstance(doc.get("parties"), dict):
        raise BadInput(f"cohort_dir: {path} is not the registry of {cohort_dir}")
    return doc


def registered(cfg: Any, party: str) -> dict[str, Any]:
    """What the registry of cfg's cohort says of `party` (after the same checks as bind)."""
    entry = _read(cfg.cohort_dir)["parties"].get(party)
    if not isinstance(entry, dict):
        raise BadInput(f"{cfg.source}: no party {party!r} in the cohort's registry")
    return entry


def bind(cfg: Any, party: str) -> None:
    """Refuse `cfg`, by key, unless the registry in its cohort_dir names `party` with exactly
    these bound keys. Runs before the service touches any path."""
    doc = _read(cfg.cohort_dir)
    registered = doc["parties"].get(party)
    if not isinstance(registered, dict):
        known = ", ".join(sorted(doc["parties"]))
        raise BadInput(f"{cfg.source}: no party {party!r} in the cohort's registry (it has {known})")
    mine = bound_keys(cfg)
    wrong = [f"{cfg.source}: {key}: expected {registered.get(key)!r}, the value cohort init gave {party}, "
             f"got {mine.get(key)!r}" for key in sorted(set(mine) | set(registered))
             if mine.get(key) != registered.get(key)]
    if wrong:
        raise BadInput("\n".join(wrong + [(f"{cfg.source}: a service acts only as the party cohort init made "
                                           f"({Path(cfg.cohort_dir) / REGISTRY_FILE})")]))
