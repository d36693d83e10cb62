"""The cohort's registry (`D/cohort.registry`, init's and writable by nobody else): a service
runs as root from whatever config it is given, so it checks that config against the registry
on every key saying who the party is, where it acts and whom it serves.
"""

from __future__ import annotations

import functools
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
# The emulated vendors' material, root's alone (0700), never in a party's tree, where the party
# could rename or relink it (issue 30's second review); found from cohort_dir, which is bound.
VENDOR_DIR, PLATFORM_DIR = "vendor", "platform"
MAX_REGISTRY_BYTES = 1 << 20
# What says who a party is, where it acts and whom it serves ("job.run_dir": the [job] table's key).
_BOUND = ("name", "index", "uid", "tdx_uid", "orchestrator_uid", "state_dir", "socket", "host_socket", "link_socket",
          "gpu_link_socket", "boot_lock", "trust_dir", "public_dir", "job.run_dir", "rank", "shares", "orchestrator")


def vendor_dir(cfg: Any) -> Path:
    return Path(cfg.cohort_dir) / VENDOR_DIR / f"gpu-{cfg.index}"


def platform_dir(cohort_dir: Path, rank: int) -> Path:
    """The CPU-TEE root that certifies rank `rank`'s TDX module's key once (each rank its own copy)."""
    return cohort_dir / (PLATFORM_DIR if rank == 0 else f"{PLATFORM_DIR}-{rank}")


def bound_keys(cfg: Any) -> dict[str, Any]:
    values = {k: functools.reduce(lambda obj, part: getattr(obj, part, None), k.split("."), cfg) for k in _BOUND}
    return {k: v for k, v in values.items() if v is not None}


def write_registry(directory: Path, parties: dict[str, Any]) -> Path:
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
    parties = _read(cfg.cohort_dir)["parties"]
    entry = parties.get(party)
    if not isinstance(entry, dict):
        raise BadInput(f"{cfg.source}: no party {party!r} in the cohort's registry (it has {', '.join(sorted(parties))})")
    return entry


def bind(cfg: Any, party: str) -> None:
    """Refuse `cfg`, by key, unless its cohort's registry names `party` with exactly these bound keys."""
    theirs, mine = registered(cfg, party), bound_keys(cfg)
    wrong = [f"{cfg.source}: {key}: expected {theirs.get(key)!r}, the value cohort init gave {party}, "
             f"got {mine.get(key)!r}" for key in sorted(set(mine) | set(theirs)) if mine.get(key) != theirs.get(key)]
    if wrong:
        raise BadInput("\n".join(wrong + [(f"{cfg.source}: a service acts only as the party cohort init made "
                                           f"({Path(cfg.cohort_dir) / REGISTRY_FILE})")]))
