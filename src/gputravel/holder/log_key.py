"""A data holder's travel-log key: the secret that keys its chunks' digests in the public log.

The orchestrator's travel log is public (every party and the host may read it), so it never
shows a chunk's bare digest, which anyone who can guess the chunk could recompute; it shows
``protocol.manifest.chunk_mac`` under this key. The holder makes the key once, ``LOG_KEY_BYTES``
random bytes in its own private directory (its pki directory, mode 0600), keeps it across
restarts and rejoins, and sends it only to the orchestrator it attested, in its hello (every
join, so a restarted orchestrator has it again). With it, and its own data, the holder can
check its own entries (`gputravel status`); without it, an entry says only which holder, which
offset, how many bytes and when.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

from gputravel.errors import BadInput
from gputravel.files import read_plain
from gputravel.protocol.manifest import LOG_KEY_BYTES

__all__ = ["LOG_KEY_FILE", "own_log_key", "read_log_key"]

LOG_KEY_FILE = "travel-log-mac.secret"  # in the holder's pki directory (not a .key: that is its TLS key)


def read_log_key(directory: Path) -> bytes:
    """The key kept in ``directory``; BadInput (never its value) if it is not one. A link or a
    FIFO left in its place is not followed."""
    path = Path(directory) / LOG_KEY_FILE
    try:
        key = read_plain(path, LOG_KEY_BYTES + 1)
    except FileNotFoundError:
        raise BadInput(f"no travel-log key at {path}") from None
    except OSError as exc:
        raise BadInput(f"the travel-log key at {path} is unreadable ({type(exc).__name__})") from None
    if len(key) != LOG_KEY_BYTES:
        raise BadInput(f"{path} is not a travel-log key ({LOG_KEY_BYTES} bytes)")
    return key


def own_log_key(directory: Path) -> bytes:
    """Run by the holder itself: its key in ``directory``, made there (0600) on first use or,
    after a restart, the one it made before. The file appears whole or not at all (written
    beside it, then linked under its name), so a crash never leaves a short key."""
    directory = Path(directory)
    path = directory / LOG_KEY_FILE
    if os.path.lexists(path):
        return read_log_key(directory)
    key = secrets.token_bytes(LOG_KEY_BYTES)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{LOG_KEY_FILE}.", suffix=".tmp")  # 0600
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(key)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.close(fd)
        fd = -1
        try:
            os.link(tmp, path)  # fails if another start made one meanwhile: that one is kept
        except FileExistsError:
            return read_log_key(directory)
        return key
    finally:
        if fd >= 0:
            os.close(fd)
        Path(tmp).unlink(missing_ok=True)
