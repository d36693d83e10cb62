"""Reading what another party holds, from the attacker's own process: /proc, descriptors,
key files; and asking the TDX module for a quote (the rows holder-reads-peer-memory,
host-reads-cvm-memory and orchestrator-self-quote).

Both the malicious host and the malicious holder run these from their own process, under the
uid the launcher gave it, so what they get is what process isolation lets through
(cohort/isolation.py). Whatever is read goes to the loot, which the red team searches for
the holders' markers; the events say, per target, "denied" or how many bytes were read.
"""

from __future__ import annotations

import ctypes
import errno
import os
import time

from gputravel.firmware.tdx_module import request_quote
from gputravel.errors import GputravelError
from gputravel.redteam.loot import Loot
from gputravel.redteam.messages import AskQuote, ProbePaths, ProbeTarget

MAX_READ = 4 << 20  # per range: enough to hold a record's worth of markers


def probe(order: ProbePaths, loot: Loot) -> list[str]:
    return [_one(t, order.note, loot) for t in order.targets]


def _one(t: ProbeTarget, note: str, loot: Loot) -> str:
    head = f"probe {note} {t.label}"
    try:
        if t.how == "fork":
            return f"{head}: " + _fork_control(loot)
        if t.how == "list":
            return f"{head}: listed {len(os.listdir(t.path))} entries"
        got = 0
        fd = os.open(t.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for offset, length in t.ranges or ((0, MAX_READ),):
                data = os.pread(fd, min(length, MAX_READ), offset)
                loot.keep("peek", data)
                got += len(data)
        finally:
            os.close(fd)
        return f"{head}: read {got} bytes"
    except OSError as exc:
        return f"{head}: denied ({errno.errorcode.get(exc.errno or 0, 'error')})"


def _fork_control(loot: Loot) -> str:
    """The control: the same /proc/PID/mem reads, on a process of our own uid that is dumpable
    (a fork of ourselves, sharing our mappings). They succeed: so what stops the reads of other
    parties is their uid and their non-dumpability, not the probe."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before the fork
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one call, then wait for the parent to be done
        os.close(w)
        prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        deadline = time.monotonic() + 2.0
        while os.stat(f"/proc/{pid}/status").st_uid != os.geteuid() and time.monotonic() < deadline:
            time.sleep(0.005)  # its /proc files become its own once it is dumpable
        got = 0
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read().splitlines()
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            for line in maps:
                parts = line.split(maxsplit=5)
                name = parts[5] if len(parts) > 5 else ""
                if parts[1].startswith("r") and (name.startswith("/memfd:") or name.endswith(".bin")):
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    mem.seek(start)
                    data = mem.read(min(end - start, MAX_READ))
                    loot.keep("peek", data)
                    got += len(data)
        return f"read {got} bytes of a dumpable fork of itself (pid {pid}, same uid) through /proc/{pid}/mem"
    finally:
        os.close(w)
        os.waitpid(pid, 0)


def ask_quote(order: AskQuote, loot: Loot) -> str:
    try:
        quote = request_quote(order.socket_path, order.report_data, timeout=10)
    except (GputravelError, OSError) as exc:
        return f"asked the TDX module for a quote over its own report data: {type(exc).__name__}: {exc}"
    loot.keep("quote", quote)
    return f"asked the TDX module for a quote over its own report data: got a quote of {len(quote)} bytes"
