"""A data holder's travel-log key. The public travel log shows ``chunk_mac`` under this key, never
a bare digest anyone guessing the chunk could recompute. Made once in the holder's pki directory
(0600), kept across restarts, sent only to the attested orchestrator in each hello; with it the
holder checks its own entries (`gputravel status`).
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
    """The key kept in ``directory``; BadInput (never its value) if not one. A link or FIFO is not followed."""
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
    """The holder's key in ``directory``, made (0600) on first use. Written beside, then linked:
    a crash never leaves a short key."""
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
