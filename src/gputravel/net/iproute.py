"""The one way this package runs iproute2: ``ip`` and ``tc`` with argument lists, never a shell."""

from __future__ import annotations

import subprocess
from typing import Sequence

from gputravel.errors import LocalError

_CMD_TIMEOUT = 30.0


class LinkError(LocalError):
    """Setting up or tearing down shaped links failed (the message names the command, with its stderr)."""


def run_iproute(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LinkError(f"{' '.join(argv)}: {e}") from e
    if check and done.returncode != 0:
        raise LinkError(f"{' '.join(argv)} failed (exit {done.returncode}): "
                        f"{done.stderr.strip() or done.stdout.strip()}")
    return done
