"""A recipient's X25519 key pair for HPKE (RFC 9180): the private key as PKCS8 PEM (0600, made once),
the public key as 64 hex digits, which a job manifest names and a release is sealed to."""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from gputravel.crypto.pki import MEMBER_NAME
from gputravel.errors import BadInput
from gputravel.files import atomic_write_bytes, read_plain

PUBLIC_KEY_BYTES = 32
RECIPIENT_NAME = MEMBER_NAME  # as the manifest names recipients; files are named by it, as a member's are
MAX_KEY_FILE_BYTES = 4 << 10  # a PKCS8 PEM of an X25519 key is 119 bytes


def check_recipient(name: object) -> str:
    if not isinstance(name, str) or not RECIPIENT_NAME.fullmatch(name):
        raise BadInput(f"recipient name {name!r} is invalid: use 1-32 characters from a-z, 0-9 and '-'")
    return name


def raw_public(key: X25519PrivateKey | X25519PublicKey) -> bytes:
    """The 32 raw bytes of the public half."""
    public = key.public_key() if isinstance(key, X25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def keygen(name: str, out: Path) -> tuple[Path, Path]:
    """Write out/NAME.key (PKCS8 PEM, 0600) and out/NAME.pub (hex); refused if either exists."""
    out = Path(out)
    key_path, pub_path = out / f"{check_recipient(name)}.key", out / f"{name}.pub"
    for path in (key_path, pub_path):
        if path.exists() or path.is_symlink():
            raise BadInput(f"{path} already exists: a recipient's key is made once; choose another name or directory")
    out.mkdir(parents=True, exist_ok=True)
    key = X25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    # O_EXCL: never over a file (or a link) that appeared since the check; 0600 from creation.
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    atomic_write_bytes(pub_path, (raw_public(key).hex() + "\n").encode("ascii"))
    return key_path, pub_path


def load_private_key(path: Path) -> X25519PrivateKey:
    """The recipient's private key from its PKCS8 PEM file; BadInput naming the file otherwise."""
    try:
        pem = read_plain(Path(path), MAX_KEY_FILE_BYTES + 1)
    except FileNotFoundError:
        raise BadInput(f"recipient key {path} does not exist") from None
    except OSError as exc:
        raise BadInput(f"recipient key {path} cannot be read ({exc.strerror or 'not a plain file'})") from None
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError):
        key = None
    if not isinstance(key, X25519PrivateKey):
        raise BadInput(f"{path} is not an X25519 private key in unencrypted PKCS8 PEM (gputravel model keygen)")
    return key


def public_key_from_hex(text: object, where: str) -> bytes:
    """32 bytes from 64 hex digits; BadInput naming `where` (a file, a manifest field) otherwise."""
    value = b""
    if isinstance(text, str):
        try:
            value = bytes.fromhex(text.strip())
        except ValueError:
            value = b""
    if len(value) != PUBLIC_KEY_BYTES:
        raise BadInput(f"{where}: a recipient's public key is {2 * PUBLIC_KEY_BYTES} hex digits (X25519)")
    return value


def load_public_key(path: Path) -> bytes:
    """The 32 raw bytes of the recipient's public key from its .pub file."""
    try:
        text = read_plain(Path(path), MAX_KEY_FILE_BYTES + 1).decode("ascii", "replace")
    except FileNotFoundError:
        raise BadInput(f"recipient public key {path} does not exist") from None
    except OSError as exc:
        raise BadInput(f"recipient public key {path} cannot be read ({exc.strerror or 'not a plain file'})") from None
    return public_key_from_hex(text, str(path))
