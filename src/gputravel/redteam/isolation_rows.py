"""Red-team rows on process isolation and the quoting process (issue 12): the attackers'
own processes try to read their peers' memory, descriptors and key files, and to get a quote.
"""

from __future__ import annotations

import os
from pathlib import Path

from gputravel.protocol.parties import ORCHESTRATOR
from gputravel.redteam.arena import ALICE, BOB, MALLORY, Arena, Verdict, news_lines
from gputravel.redteam.messages import AskQuote, ProbePaths, ProbeTarget

PUBLIC = "(public)"  # /proc files any process may read: reported, not held against isolation
PEEK_RANGE = 4 << 20  # bytes read from each interesting mapping or descriptor


def _maps(pid: int) -> list[tuple[int, int, str]]:
    """The launcher's (root's) view of a party's mappings: (start, end, name)."""
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) >= 2 and parts[1].startswith("r"):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end, parts[5] if len(parts) > 5 else ""))
    return out


def _worth_reading(name: str) -> bool:
    """Mappings that hold a party's secrets or data: memfds (VRAM, bounce buffers), datasets, heap."""
    return name.startswith("/memfd:") or name.endswith(".bin") or name == "[heap]"


def _targets_of(key: str, pid: int) -> list[ProbeTarget]:
    """Everything of party ``key`` worth stealing, named as the attacker's process reaches it.
    Where the attacker needs to know where to look (addresses, descriptor numbers), the
    launcher reads them as root and tells it: the attacker is given more than it could learn."""
    proc = f"/proc/{pid}"
    t = [ProbeTarget(f"{key}'s {what} {PUBLIC}", f"{proc}/{what}", "read", ()) for what in ("cmdline", "status")]
    t += [ProbeTarget(f"{key}'s {what}", f"{proc}/{what}", "read", ()) for what in ("maps", "environ")]
    t += [ProbeTarget(f"{key}'s {what} directory", f"{proc}/{what}", "list", ()) for what in ("fd", "map_files")]
    seen = set()
    for start, end, name in _maps(pid):
        if _worth_reading(name) and name not in seen:
            seen.add(name)
            t.append(ProbeTarget(f"{key}'s memory ({name or 'anonymous'})", f"{proc}/mem", "read",
                                 ((start, min(end - start, PEEK_RANGE)),)))
    for fd in sorted(os.listdir(f"{proc}/fd"), key=int):
        try:
            link = os.readlink(f"{proc}/fd/{fd}")
        except OSError:
            continue
        if link.startswith(("/memfd:", "/")) and not link.startswith(("/dev/", "/proc/")):
            t.append(ProbeTarget(f"{key}'s descriptor {fd} ({link})", f"{proc}/fd/{fd}", "read", ()))
    return t


def _files_of(a: Arena, key: str) -> list[ProbeTarget]:
    """A party's key files and dataset, by the paths the parties use (the cohort directory
    through the launcher's descriptor), and a holder's dataset by its original path."""
    c = a.cohort
    paths: dict[str, Path] = {}
    if key in ("orchestrator", ALICE, BOB, MALLORY):
        paths[f"{key}'s TLS key"] = c.dir / "pki" / key / f"{key}.key"
    if key == "device":
        paths["the device's firmware key"] = c.trust.device_dir / "device-firmware.key"
    t = [ProbeTarget(label, c.child_path(p), "read", ()) for label, p in paths.items()]
    spec = {h.name: h for h in c.config.holders}.get(key)
    if spec is not None:
        t.append(ProbeTarget(f"{key}'s dataset by its path", spec.dataset, "read", ()))
        for link in sorted((c.dir / "parties" / key / "dataset").glob("*")):
            t.append(ProbeTarget(f"{key}'s dataset link", c.child_path(link), "read", ()))
    return t


#: The control: the attacker forks a dumpable copy of itself and reads it the same way.
FORK_CONTROL = ProbeTarget("the same reads on a dumpable process of its own uid", "", "fork", ())


def _probe_results(events: tuple[str, ...], note: str) -> tuple[list[str], list[str], int]:
    """(denied, read, bytes read) among the probe events of one batch, public files left out."""
    mine = [e for e in events if e.startswith(f"probe {note} ")]
    denied = [e for e in mine if ": denied (" in e]
    read = [e for e in mine if ": denied (" not in e and PUBLIC not in e]
    got = sum(int(e.rsplit(": read ", 1)[1].split()[0]) for e in read if ": read " in e)
    return denied, read, got


def _isolation_row(a: Arena, attacker: str, victims: tuple[str, ...]) -> tuple[bool, list[str]]:
    pids = a.cohort.pids()
    targets = [t for key in victims for t in (*_targets_of(key, pids[key]), *_files_of(a, key))]
    control = [FORK_CONTROL]
    link = a.host if attacker == "host" else a.mallory
    if attacker == "host":
        link.order(ProbePaths(tuple(targets), "peer"))
        link.order(ProbePaths(tuple(control), "control"))
        events = link.news().events
    else:
        events = link.order(ProbePaths(tuple(targets), "peer"), timeout=120).events
        events += link.order(ProbePaths(tuple(control), "control"), timeout=120).events
    denied, read, got = _probe_results(events, "peer")
    _, own, own_bytes = _probe_results(events, "control")
    iso = a.cohort.isolation
    uids = ", ".join(f"{k} {u}" for k, u in sorted(iso.uids.items()))
    summary = [f"process isolation on: each party under its own uid ({uids}), non-dumpable",
               (f"{attacker}'s own process tried {len(denied) + len(read)} targets of "
                f"{', '.join(victims)}: {len(denied)} denied, {len(read)} read ({got} bytes)"),
               (f"control: the same /proc/PID/mem reads got {own_bytes} bytes from a dumpable fork of {attacker} "
                "(same uid)")]
    stopped = iso.on and bool(denied) and not read and got == 0 and own_bytes > 0
    return stopped, [*summary, *(e for e in events if e.startswith("probe "))]


def holder_reads_peer_memory(a: Arena) -> Verdict:
    stopped, evidence = _isolation_row(a, MALLORY, (ALICE, BOB, ORCHESTRATOR, "device", "host", "tdx-module"))
    return Verdict(stopped, "process isolation (cohort/isolation.py): mallory's process runs under a uid of its "
                   "own with no groups, and every other party is non-dumpable under its own uid, so /proc refused "
                   "mallory their memory, maps, environment and descriptors (the VRAM memfd included), and their "
                   "key files and datasets lie in directories only their own uid may enter", tuple(evidence))


def host_reads_cvm_memory(a: Arena) -> Verdict:
    stopped, evidence = _isolation_row(a, "host", (ALICE, BOB, MALLORY, ORCHESTRATOR, "device", "tdx-module"))
    return Verdict(stopped, "process isolation: the host process has only what it is handed (bounce buffers, BAR0, "
                   "the MUX); every CVM, the device and the TDX module run under uids of their own, non-dumpable, "
                   "so /proc refused the host their memory and descriptors (the VRAM memfd included) and their "
                   "key files", tuple(evidence))


def orchestrator_self_quote(a: Arena) -> Verdict:
    """The host (which could then impersonate the orchestrator to holders it MITMs) and mallory
    ask the TDX module for a quote over report data of their own: a TLS key of theirs."""
    sock = a.cohort.child_path(a.cohort.dir / "tdx" / "quote.sock")
    report = bytes(range(64))  # any report data of the attacker's choosing: a hash of its own TLS key
    a.host.order(AskQuote(sock, report))
    host = a.host.news()
    mine = a.mallory.order(AskQuote(sock, report), timeout=60)
    if a.cohort.isolation.on:
        module = _targets_of("tdx-module", a.cohort.pids()["tdx-module"])
        peek = a.mallory.order(ProbePaths(tuple(module), "peer"), timeout=120)
        denied, read, got = _probe_results(peek.events, "peer")
        probed = (f"mallory tried {len(denied) + len(read)} targets of the TDX module's process: {len(denied)} "
                  f"denied, {len(read)} read ({got} bytes)")
    else:
        denied, read, got = ["-"], [], 0
        probed = "process isolation is off (not root): the TDX module's memory was not probed"
    asked = [e for e in (*host.events, *mine.events) if e.startswith("asked the TDX module")]
    refused = [e for e in asked if "QuotingRefused" in e and "is not the CVM this module launched" in e]
    quoted = [e for e in asked if "got a quote" in e]
    ok, after = a.carry_on(ALICE)
    stopped = len(refused) == 2 and not quoted and bool(denied) and not read and got == 0 and ok
    return Verdict(stopped, "the TDX module (firmware/tdx_module.py, its own process): it quotes only for the pid and "
                   "uid the launcher registered as the orchestrator it launched (SO_PEERCRED), over report data "
                   "only, with the measurement the launcher computed; the host's and mallory's requests were "
                   "refused (QuotingRefused), and its quoting key, in its own memory, was out of mallory's reach",
                   (*news_lines(host, "host"), *news_lines(mine, "mallory"),
                    probed, after))
