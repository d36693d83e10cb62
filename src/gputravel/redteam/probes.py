"""Reading what another party holds from the attacker's own process (/proc, descriptors, key files) and
asking the TDX module for a quote: what the adversaries run under the uid the launcher gave them, so
that they get what process isolation lets through, and the rows that order it (issue 12)."""

from __future__ import annotations

import ctypes
import errno
import os
import time
from collections.abc import Iterable
from pathlib import Path

from gputravel.errors import GputravelError
from gputravel.firmware.tdx_module import request_quote
from gputravel.protocol.parties import ORCHESTRATOR
from gputravel.redteam.arena import ALICE, BOB, MALLORY, Arena, row
from gputravel.redteam.bus import AskQuote, Did, Event, ProbePaths, ProbeTarget, event, happened
from gputravel.redteam.evidence import Probed
from gputravel.redteam.loot import Loot

MAX_READ = 4 << 20  # per range: enough to hold a record's worth of markers
PUBLIC = ("cmdline", "status")  # /proc files any process may read: reported, not held against isolation


# ----------------------------------------------------------------------------- in the attacker's process
def probe(t: ProbeTarget, loot: Loot) -> Event:
    head = f"probe {t.owner}'s {t.what}"
    try:
        if t.how == "fork":
            got, pid = _fork_control(loot)
            return event(Did.FORK_CONTROL, f"read {got} bytes of a dumpable fork of itself (pid {pid}, same uid) "
                         f"through /proc/{pid}/mem", nbytes=got)
        if t.how == "list":
            n = len(os.listdir(t.path))
            return event(Did.PROBED, f"{head}: listed {n} entries", party=t.owner, place=t.what, count=n)
        got = _read(t.path, t.ranges or ((0, MAX_READ),), loot)
        return event(Did.PROBED, f"{head}: read {got} bytes", party=t.owner, place=t.what, nbytes=got)
    except OSError as exc:
        code = errno.errorcode.get(exc.errno or 0, "error")
        return event(Did.PROBED, f"{head}: denied ({code})", party=t.owner, place=t.what, error=code)


def _fork_control(loot: Loot) -> tuple[int, int]:
    """The control: the same /proc/PID/mem reads on a dumpable fork of ourselves succeed, so what stops
    the reads of other parties is their uid and non-dumpability, not the probe."""
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
        ranges = [(start, end - start) for start, end, name in _maps(pid) if _holds_data(name)]
        return _read(f"/proc/{pid}/mem", ranges, loot), pid
    finally:
        os.close(w)
        os.waitpid(pid, 0)


def _read(path: str, ranges: Iterable[tuple[int, int]], loot: Loot) -> int:
    """Read each (offset, length) of ``path`` into the loot; the bytes read."""
    got = 0
    with open(path, "rb", buffering=0) as f:
        for offset, length in ranges:
            f.seek(offset)
            data = f.read(min(length, MAX_READ))
            loot.keep("peek", data)
            got += len(data)
    return got


def ask_quote(order: AskQuote, loot: Loot) -> Event:
    head = "asked the TDX module for a quote over its own report data"
    try:
        quote = request_quote(order.socket_path, order.report_data, timeout=10)
    except (GputravelError, OSError) as exc:
        name = type(exc).__name__
        return event(Did.QUOTE, f"{head}: {name}: {exc}", place=str(exc), error=name)
    loot.keep("quote", quote)
    return event(Did.QUOTE, f"{head}: got a quote of {len(quote)} bytes", nbytes=len(quote))


# A holder's tokens or records are laid out once at boot in shared anonymous memory (holder/cvm.py Dataset)
LAID_OUT = "/dev/zero (deleted)"


def _holds_data(name: str) -> bool:
    """A mapping that holds a party's secrets or data: memfds (VRAM, bounce buffers), a raw dataset's
    file, a laid-out dataset."""
    return name.startswith("/memfd:") or name.endswith(".bin") or name == LAID_OUT


def _maps(pid: int) -> list[tuple[int, int, str]]:
    """A process's readable mappings: (start, end, name)."""
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) >= 2 and parts[1].startswith("r"):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end, parts[5] if len(parts) > 5 else ""))
    return out


# ----------------------------------------------------------------------------- the rows
def _targets_of(key: str, pid: int) -> list[ProbeTarget]:
    """Everything of party ``key`` worth stealing; the launcher reads where to look (addresses,
    descriptors) as root: the attacker is given more than it could learn."""
    proc = f"/proc/{pid}"
    t = [ProbeTarget(key, what, f"{proc}/{what}", "read", ()) for what in (*PUBLIC, "maps", "environ")]
    t += [ProbeTarget(key, f"{what} directory", f"{proc}/{what}", "list", ()) for what in ("fd", "map_files")]
    # the first mapping of each that holds a party's secrets or data: memfds (VRAM, bounce buffers), datasets, heap
    first = {name: (start, end) for start, end, name in reversed(_maps(pid)) if _holds_data(name) or name == "[heap]"}
    t += [ProbeTarget(key, f"memory ({name})", f"{proc}/mem", "read", ((start, min(end - start, MAX_READ)),))
          for name, (start, end) in first.items()]
    for fd in sorted(os.listdir(f"{proc}/fd"), key=int):
        try:
            link = os.readlink(f"{proc}/fd/{fd}")
        except OSError:
            continue
        if link.startswith(("/memfd:", "/")) and not link.startswith(("/dev/", "/proc/")):
            t.append(ProbeTarget(key, f"descriptor {fd} ({link})", f"{proc}/fd/{fd}", "read", ()))
    return t


def _files_of(a: Arena, key: str) -> list[ProbeTarget]:
    """A party's key files and dataset, by the paths the parties use, and a holder's dataset by its own path."""
    c = a.cohort
    assert c.dir is not None
    paths = [("dataset link", link) for link in sorted((c.dir / "parties" / key / "dataset").glob("*"))]
    if key in (ORCHESTRATOR, ALICE, BOB, MALLORY):
        paths.append(("TLS key", c.dir / "pki" / key / f"{key}.key"))
    if key == "device":
        paths.append(("firmware key", c.trust.device_dir / "device-firmware.key"))
    t = [ProbeTarget(key, what, c.child_path(p), "read", ()) for what, p in paths]
    return t + [ProbeTarget(key, "dataset by its path", h.dataset, "read", ()) for h in c.config.holders
                if h.name == key]


#: The control: the attacker forks a dumpable copy of itself and reads it the same way.
FORK_CONTROL = ProbeTarget("itself", "the same reads on a dumpable process of its own uid", "", "fork", ())


def _probe(a: Arena, attacker: str, targets: list[ProbeTarget]) -> tuple[Event, ...]:
    order = ProbePaths(tuple(targets))
    if attacker == "host":
        a.host.order(order)
        return a.host.news().events
    return a.mallory.order(order, timeout=120).events


def _probed(a: Arena, attacker: str, victims: tuple[str, ...], events: tuple[Event, ...]) -> tuple[int, int, int]:
    """(denied, read, bytes read) among the targets of other parties, public files left out."""
    probed = happened(events, Did.PROBED)
    denied = [e for e in probed if e.error]
    read = [e for e in probed if not e.error and e.place not in PUBLIC]
    got = sum(e.nbytes for e in read)
    iso = a.cohort.isolation
    uids = ", ".join(f"{k} {u}" for k, u in sorted(iso.uids.items()))
    a.keep(Probed(attacker=attacker, victims=victims, isolation=iso.on, uids=uids, denied=len(denied),
                  read=len(read), nbytes=got))
    return len(denied), len(read), got


def _isolation_row(a: Arena, attacker: str, victims: tuple[str, ...]) -> bool:
    pids = a.cohort.pids()
    events = _probe(a, attacker, [t for key in victims for t in (*_targets_of(key, pids[key]), *_files_of(a, key))])
    a.stage = "control"
    control = _probe(a, attacker, [FORK_CONTROL])
    a.stage = ""
    denied, read, got = _probed(a, attacker, victims, events)
    own = sum(e.nbytes for e in happened(control, Did.FORK_CONTROL))
    return a.cohort.isolation.on and denied > 0 and not read and got == 0 and own > 0


@row("holder-reads-peer-memory", "holder", needs_isolation=True, tried="from its own process, mallory tried to read "
     "the memory (/proc/PID/mem at the mappings that hold datasets, bounce buffers and VRAM), maps, environment and "
     "descriptors (the VRAM memfd included) of alice, bob, the orchestrator, the device, the host and the TDX "
     "module, and their key files and datasets (told where to look by the launcher)", stopped_by="process isolation "
     "(cohort/isolation.py): mallory's process runs under a uid of its own with no groups, and every other party is "
     "non-dumpable under its own uid, so /proc refused mallory their memory, maps, environment and descriptors (the "
     "VRAM memfd included), and their key files and datasets lie in directories only their own uid may enter")
def holder_reads_peer_memory(a: Arena) -> bool:
    return _isolation_row(a, MALLORY, (ALICE, BOB, ORCHESTRATOR, "device", "host", "tdx-module"))


@row("host-reads-cvm-memory", "host", needs_isolation=True, tried="from the host process, the host tried the same on "
     "alice, bob, mallory, the orchestrator, the device and the TDX module", stopped_by="process isolation: the host "
     "process has only what it is handed (bounce buffers, BAR0, the MUX); every CVM, the device and the TDX module "
     "run under uids of their own, non-dumpable, so /proc refused the host their memory and descriptors (the VRAM "
     "memfd included) and their key files")
def host_reads_cvm_memory(a: Arena) -> bool:
    return _isolation_row(a, "host", (ALICE, BOB, MALLORY, ORCHESTRATOR, "device", "tdx-module"))


@row("orchestrator-self-quote", "host+holder", tried="the host and mallory each asked the TDX module for a quote over "
     "report data of their own (binding a TLS key of theirs, to pass for the orchestrator), and mallory tried to "
     "read the module's memory and descriptors, where its quoting key lives", stopped_by="the TDX module "
     "(firmware/tdx_module.py, its own process): it quotes only for the pid and uid the launcher registered as the "
     "orchestrator it launched (SO_PEERCRED), over report data only, with the measurement the launcher computed; "
     "the host's and mallory's requests were refused (QuotingRefused), and its quoting key, in its own memory, was "
     "out of mallory's reach")
def orchestrator_self_quote(a: Arena) -> bool:
    # A quote would let the host pass for the orchestrator to the holders whose links it intercepts.
    assert a.cohort.dir is not None
    sock = a.cohort.child_path(a.cohort.dir / "tdx" / "quote.sock")
    report = bytes(range(64))  # any report data of the attacker's choosing: a hash of its own TLS key
    a.host.order(AskQuote(sock, report))
    asked = happened(a.host.news().events + a.mallory.order(AskQuote(sock, report), timeout=60).events, Did.QUOTE)
    on = a.cohort.isolation.on
    events = _probe(a, MALLORY, _targets_of("tdx-module", a.cohort.pids()["tdx-module"])) if on else ()
    denied, read, got = _probed(a, MALLORY, ("tdx-module",), events)
    # Refused for who asks (the module's reason), not for a malformed request.
    refused = [e for e in asked if e.error == "QuotingRefused" and "is not the CVM this module launched" in e.place]
    quoted = [e for e in asked if not e.error]
    ok = a.carry_on(ALICE)
    return len(refused) == 2 and not quoted and (denied > 0 or not on) and not read and got == 0 and ok
