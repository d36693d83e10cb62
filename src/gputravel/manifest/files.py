"""A job manifest on disk: TOML read with tomllib, written with tomli_w, whole or not at all."""

from __future__ import annotations

import tomllib
from pathlib import Path

import tomli_w

from gputravel.errors import BadInput
from gputravel.files import atomic_write_bytes
from gputravel.manifest.model import JobManifest

MAX_MANIFEST_BYTES = 4 << 20  # a manifest is a page or two; a larger file is not one


def manifest_from_toml(text: str, source: str = "<manifest>") -> JobManifest:
    """The manifest in `text`; BadInput naming `source` and each bad key, one a line."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"{source}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once a level
        raise BadInput(f"{source}: not valid TOML: nested too deeply") from None
    try:
        return JobManifest(**raw)
    except BadInput as exc:
        raise BadInput("\n".join(f"{source}: {line}" for line in str(exc).splitlines())) from None


def load_manifest(path: str | Path) -> JobManifest:
    path = Path(path)
    if path.exists() and not path.is_file():  # a FIFO would block the read
        raise BadInput(f"{path}: not a regular file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise BadInput(f"{path}: not found") from None
    except OSError as exc:
        raise BadInput(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise BadInput(f"{path}: {len(data):,} bytes, more than a job manifest's {MAX_MANIFEST_BYTES:,}")
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise BadInput(f"{path}: not UTF-8 text") from None
    return manifest_from_toml(text, str(path))


def manifest_toml(m: JobManifest) -> str:
    """The manifest as TOML; read back, it has the same digest."""
    return tomli_w.dumps(m.model_dump())


def write_manifest(path: str | Path, m: JobManifest, *, force: bool = False) -> None:
    """Write `m` to `path` atomically; an existing file is replaced only with `force`."""
    path = Path(path)
    if path.exists() and not force:
        raise BadInput(f"{path}: exists; choose another path or replace it (--force)")
    if path.is_dir():
        raise BadInput(f"{path}: is a directory")
    atomic_write_bytes(path, manifest_toml(m).encode())
