"""What the key broker keeps in its state directory: its 32-byte secret (the keys it releases derive
from it) and its identity, a P-384 key that signs every grant, so an orchestrator told the public
half at launch (measured in its config) can tell this broker from another on the same socket path.

Both are made once, 0600, written whole and linked into place; a loose or malformed one is refused.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.errors import BadInput

__all__ = ["IDENTITY_FILE", "SECRET_FILE", "broker_identity", "broker_public_key", "broker_secret", "public_key_hex"]

SECRET_FILE = "broker.secret"
IDENTITY_FILE = "broker.key"
SECRET_BYTES = 32
_IDENTITY_LIMIT = 4096  # a P-384 PKCS8 PEM is about 300 bytes


def broker_secret(state_dir: Path) -> bytes:
    """The broker's 32-byte secret in `state_dir` (0600), made once; refused if loose or malformed."""
    path = _made(Path(state_dir) / SECRET_FILE, lambda: os.urandom(SECRET_BYTES))
    secret = _read_private(path, SECRET_BYTES + 1, "secret")
    if len(secret) != SECRET_BYTES:
        raise BadInput(f"{path} is malformed: a key broker secret is {SECRET_BYTES} bytes; restore it from a copy")
    return secret


def broker_identity(state_dir: Path) -> ec.EllipticCurvePrivateKey:
    """The broker's P-384 signing key in `state_dir` (PKCS8 PEM, 0600), made once; refused if loose or malformed."""
    path = _made(Path(state_dir) / IDENTITY_FILE, _new_identity_pem)
    pem = _read_private(path, _IDENTITY_LIMIT, "identity key")
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError):  # not PEM, encrypted, or not a key at all
        key = None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP384R1):
        raise BadInput(f"{path} is malformed: a key broker identity is an unencrypted P-384 key in PKCS8 PEM")
    return key


def broker_public_key(state_dir: Path) -> str:
    """The public half of the broker's identity (made if absent): SubjectPublicKeyInfo DER, hex."""
    return public_key_hex(broker_identity(state_dir))


def public_key_hex(key: ec.EllipticCurvePrivateKey) -> str:
    der = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return der.hex()


def _new_identity_pem() -> bytes:
    key = ec.generate_private_key(ec.SECP384R1())
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _made(path: Path, make: Callable[[], bytes]) -> Path:
    """`path`, made first if absent: written whole (mkstemp's 0600, fsync) and linked into place, so
    two starts never both write it and neither reads half of one."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.path.lexists(path):
        return path
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(make())
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another start made it first: that one is kept
    finally:
        os.unlink(tmp)
    return path


def _read_private(path: Path, limit: int, what: str) -> bytes:
    """At most `limit` bytes of a plain file only its owner may read; no link followed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise BadInput(f"{path}: cannot read the key broker's {what} ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise BadInput(f"{path} is not a plain file")
        if st.st_mode & 0o077:
            raise BadInput(f"{path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}): chmod 600 it")
        return f.read(limit)
