"""Integration: the real processes (host, device, orchestrator, holders), the full travel cycle."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from gputravel.jobs.travel import plan
from gputravel.errors import BadInput
from gputravel.protocol.manifest import chunk_digest
from gputravel.cohort.config import RESERVED_NAMES, CohortConfig, HolderSpec
from gputravel.cohort.local import Cohort
from gputravel.cohort.supervisor import TRUSTED_ROLES, PartySpec, Supervisor

pytestmark = pytest.mark.integration
MIB = 1 << 20
CANARY = b"\xc4NARY-holder-%d-"  # 16 bytes once formatted with a digit


def canary(i: int) -> bytes:
    return CANARY % i


def make_data(path: Path, nbytes: int, i: int) -> bytes:
    """Random bytes with a canary every 4 KiB: any plaintext leak shows up in a scan."""
    data = bytearray(os.urandom(nbytes))
    c = canary(i)
    for off in range(0, nbytes - len(c), 4096):
        data[off : off + len(c)] = c
    path.write_bytes(data)
    return bytes(data)


@pytest.fixture
def datasets(tmp_path: Path) -> dict[str, tuple[str, bytes]]:
    out = {}
    for i, size in enumerate((3 * MIB, 2 * MIB + 12345, 1 * MIB), start=1):
        path = tmp_path / f"h{i}.bin"
        out[f"h{i}"] = (str(path), make_data(path, size, i))
    return out


def config(datasets, **kw) -> CohortConfig:
    specs = tuple(HolderSpec(name, path) for name, (path, _) in datasets.items())
    return CohortConfig(holders=specs, buffer_bytes=MIB, **kw)


def test_host_view_holds_no_plaintext(processes, datasets) -> None:
    """Everything the host can read (every CVM's bounce buffers, all TLS bytes) is scanned."""
    cfg = config(datasets, snoop=True, tap=True, workdir=str(Path(next(iter(datasets.values()))[0]).parent))
    with Cohort(cfg) as cohort:
        for holder, offset in plan(cohort.dataset_bytes, MIB):
            cohort.travel(holder, offset)
        run_dir, snoop = cohort.dir, cohort.snoop_path
    snooped = snoop.read_bytes()
    tapped = (run_dir / "tap.bin").read_bytes()
    assert len(snooped) > 10 * MIB and len(tapped) > 1000  # the adversary really watched
    for i in (1, 2, 3):
        assert canary(i) in datasets[f"h{i}"][1]  # control: the scan would find plaintext
        assert canary(i) not in snooped
        assert canary(i) not in tapped


def test_teardown_leaves_no_process_socket_or_directory(processes, datasets) -> None:
    cohort = Cohort(config(datasets))
    with cohort:
        pids = cohort.pids()
        run_dir = cohort.dir
        assert len(pids) == 7  # host, TDX module, device, 3 holders, orchestrator
        cohort.travel("h2", 0)
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert run_dir is not None and not run_dir.exists()


def test_config_is_validated(datasets, tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="multiple of"):
        config(datasets).__class__(holders=config(datasets).holders, buffer_bytes=MIB + 1)
    with pytest.raises(BadInput, match="not found"):
        CohortConfig(holders=(HolderSpec("x", str(tmp_path / "missing")),), buffer_bytes=MIB)
    with pytest.raises(BadInput, match="unique"):
        CohortConfig(holders=(HolderSpec("x", datasets["h1"][0]),) * 2, buffer_bytes=MIB)
    with pytest.raises(BadInput, match="at least one"):
        CohortConfig(holders=(), buffer_bytes=MIB)


@pytest.mark.parametrize("name", ["device", "host", "tdx-module", "orchestrator", "ca", "orchestrator-1",
                                  "orchestrator-12", "../device", "Carol", "a b", "", "x" * 33])
def test_a_holder_cannot_be_named_as_another_party_or_outside_the_holders_rule(datasets, name: str) -> None:
    """Red team (security row 49): a holder's name keys its uid, directories and certificate; one
    named "device" would run under the emulated GPU's uid and read its firmware key. Refused,
    present at boot or late, before anything is made for it."""
    from gputravel.cohort.quoting import KEY as TDX_MODULE  # the supervisor's key for the module

    assert TDX_MODULE in RESERVED_NAMES
    spec = HolderSpec(name, datasets["h1"][0])
    with pytest.raises(BadInput, match="is invalid"):
        CohortConfig(holders=(spec,), buffer_bytes=MIB)
    with pytest.raises(BadInput, match="is invalid"):
        CohortConfig(holders=(HolderSpec("h1", datasets["h1"][0]),), late_holders=(spec,), buffer_bytes=MIB)


def test_leaving_or_rejoining_an_unknown_holder_is_refused_with_the_reason(processes, datasets) -> None:
    with Cohort(config(datasets)) as cohort:
        for act in (cohort.leave, cohort.rejoin):
            with pytest.raises(BadInput, match="not a data holder of this cohort"):
                act("nobody")


def test_a_failing_child_tears_everything_down(processes, datasets, tmp_path: Path) -> None:
    """A holder whose dataset vanishes before boot fails; the supervisor stops all the others."""
    path, _ = datasets["h3"]
    cfg = config(datasets)
    os.unlink(path)  # validated at config time, gone at boot time
    cohort = Cohort(cfg)
    with pytest.raises(BadInput, match="does not exist"):
        with cohort:
            pass
    assert cohort.children == {}


def test_each_cvm_holds_only_its_own_tls_key(processes, datasets, tmp_path: Path) -> None:
    """Each member made its own key in its own directory; isolated (root), the key is 0600
    and owned by that member's uid (tests/test_isolation.py probes it as every other party)."""
    members = ("orchestrator", "h1", "h2", "h3")
    with Cohort(config(datasets, workdir=str(tmp_path))) as cohort:
        pki = cohort.dir / "pki"
        keys = {p.relative_to(pki).as_posix() for p in pki.rglob("*.key")}
        owners = {m: (pki / m / f"{m}.key").stat() for m in members}
        iso = cohort.isolation
        cohort.travel("h1", 0)  # and the cohort works with those keys only
    assert keys == {f"{m}/{m}.key" for m in members}
    assert all(st.st_mode & 0o777 == 0o600 for st in owners.values())
    if iso.on:
        assert {m: st.st_uid for m, st in owners.items()} == {m: iso.uids[m] for m in members}


def _holds(pid: int, name: str) -> bool:
    """Does process ``pid`` hold a descriptor of, or a mapping of, the memfd called ``name``?"""
    fds = Path(f"/proc/{pid}/fd")
    for fd in fds.iterdir():
        try:
            if name in os.readlink(fd):
                return True
        except OSError:
            pass
    return name in Path(f"/proc/{pid}/maps").read_text()


def test_vram_reaches_only_the_device_and_the_orchestrator(processes, datasets) -> None:
    with Cohort(config(datasets)) as cohort:
        cohort.travel("h1", 0)
        pids = cohort.pids()
        holding = {role for role, pid in pids.items() if _holds(pid, "gputravel-vram")}
        sysmem_of_h1 = {role for role, pid in pids.items() if _holds(pid, "gputravel-sysmem-h1")}
    assert holding == {"device", "orchestrator"}
    # The holder's unprotected memory: itself, the host (hypervisor) and the device (DMA).
    assert sysmem_of_h1 == {"h1", "host", "device"}


def _launch_holding(path: str, tmpdir: Path):
    """A launcher process (a local cohort of one holder, in $TMPDIR `tmpdir`) that prints its
    parties' pids and its cohort directory, then waits; and what it printed."""
    import subprocess
    import sys

    script = (
        "import time\n"
        "from gputravel.cohort.config import CohortConfig, HolderSpec\n"
        "from gputravel.cohort.local import Cohort\n"
        f"with Cohort(CohortConfig(holders=(HolderSpec('h1', {path!r}),), buffer_bytes={MIB})) as c:\n"
        "    print(' '.join(str(p) for p in c.pids().values()), c.dir, flush=True)\n"
        "    time.sleep(120)\n"
    )
    sup = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env={**os.environ, "TMPDIR": str(tmpdir)})
    *pids, directory = sup.stdout.readline().split()
    assert len(pids) == 5, sup.stderr.read()  # host, TDX module, device, h1, orchestrator
    return sup, [int(p) for p in pids], Path(directory)


def _all_gone(pids: list[int]) -> bool:
    import time

    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]]
    return alive == []


def test_a_supervisor_stopped_by_any_signal_leaves_no_party_and_no_key(processes, datasets, tmp_path: Path) -> None:
    """Killed outright, its parties die with it (PDEATHSIG) and the next launcher deletes the
    directory it left, keys and all. SIGTERM (a `timeout`, a `kill`) unwinds it: every party
    stopped, the directory deleted. The parties run in sessions of their own, so a terminal's
    Ctrl-C or a `timeout` signalling the launcher's group reaches the launcher alone, which
    stops them in order (cohort/stopping.py)."""
    import signal

    tmpdir = tmp_path / "t"
    tmpdir.mkdir()
    killed, pids, left = _launch_holding(datasets["h1"][0], tmpdir)
    session = os.getsid(killed.pid)
    assert all(os.getsid(p) not in (session, killed.pid) for p in pids)  # not the launcher's session
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert _all_gone(pids)
    assert (left / "launcher.pid").exists() and list(left.glob("pki/*/*.key"))  # left, with its keys

    termed, pids, directory = _launch_holding(datasets["h1"][0], tmpdir)
    assert not left.exists()  # the next launcher swept it
    termed.send_signal(signal.SIGTERM)
    said = termed.stderr.read()
    assert termed.wait(timeout=60) != 0 and "Terminated: stopped by SIGTERM; the cohort was stopped" in said
    assert _all_gone(pids) and not directory.exists() and not list(tmpdir.glob("gputravel-*"))


def test_a_signal_someone_else_handles_is_left_to_them_and_the_other_still_unwinds(processes) -> None:
    """Under `nohup` SIGHUP is ignored: it stays ignored, and SIGTERM still unwinds the
    launcher (the review of session 24: both were left, and SIGTERM killed it outright)."""
    import signal

    from gputravel.cohort import stopping
    from gputravel.errors import Terminated

    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    undo = stopping.catch_term("the cohort was stopped")
    try:
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        with pytest.raises(Terminated, match="stopped by SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0.1)
    finally:
        undo()
        signal.signal(signal.SIGHUP, old)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_deletion_that_fails_keeps_the_lock_file_and_goes_keys_first(processes, tmp_path: Path, monkeypatch) -> None:
    """remove_tree deletes the keys first, and the lock file and the directory only once
    nothing else is left: a deletion that fails leaves a directory the next sweep finds."""
    from gputravel.cohort import stopping

    d = tmp_path / "gputravel-x"
    for sub in ("pki", "trust", "parties", "logs"):
        (d / sub).mkdir(parents=True)
    (d / "launcher.pid").write_text("1\n")
    calls: list[list[str]] = []
    real = stopping._rm

    def failing_on_parties(paths: list[str]) -> bool:
        calls.append(sorted(Path(p).name for p in paths))
        return real(paths) and not any(p.endswith("parties") for p in paths)

    monkeypatch.setattr(stopping, "_rm", failing_on_parties)
    assert not stopping.remove_tree(d)
    assert calls == [["pki", "trust"], ["logs", "parties"]]
    assert (d / "launcher.pid").exists() and not (d / "pki").exists()
    monkeypatch.setattr(stopping, "_rm", real)
    assert stopping.remove_tree(d) and not d.exists()


def test_a_directory_that_cannot_be_deleted_is_said_once_and_left_to_the_sweep(processes, tmp_path: Path, monkeypatch,
                                                                                capsys) -> None:
    """delete() tries again for its wait, then says once what is left (not once a try), lets
    go of the lock, and leaves the directory claimed for the next sweep."""
    from gputravel.cohort import stopping

    d = tmp_path / "gputravel-stuck"
    (d / "pki").mkdir(parents=True)
    stopping.claim(d)
    monkeypatch.setattr(stopping, "_rm", lambda paths: False)
    assert not stopping.delete(d, wait=0.3)
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and "could not delete all of" in said[0] and "next launch deletes it" in said[0]
    assert d not in stopping._held and (d / "launcher.pid").exists()
    monkeypatch.undo()
    stopping.sweep(str(tmp_path), "gputravel-")
    assert not d.exists()


def test_a_launcher_closed_off_the_main_thread_leaves_signals_as_they_were(processes) -> None:
    """A rank's thread may close the cohorts (cohort/gpus.py): the main thread's handler can
    only be reset there, so until then it acts as the default would, and a SIGTERM after the
    close ends the process (hostile review of session 24: it raised Terminated for ever)."""
    import subprocess
    import sys

    script = ("import os, signal, threading; from gputravel.cohort import stopping\n"
              "undo = stopping.catch_term('the cohort was stopped')\n"
              "t = threading.Thread(target=undo); t.start(); t.join()\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "signal.sigtimedwait([], 1)\n"
              "print('survived')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == -15 and "survived" not in done.stdout and "Terminated" not in done.stderr


def test_the_sweep_deletes_only_directories_of_launchers_that_are_gone(processes, tmp_path: Path) -> None:
    """A directory is swept only when no live launcher holds its lock: a launcher that exited
    let go of it (whatever became of its pid), one alive (in any pid namespace) did not.
    Never one claimed by nobody, nor what a link points to. A party's tree deeper than
    Python's recursion limit goes too, keys first (hostile review of session 24: rmtree raised
    RecursionError, leaving the keys and breaking every later sweep)."""
    import subprocess
    import sys

    from gputravel.cohort import stopping

    claim = "import sys, time; from pathlib import Path; from gputravel.cohort import stopping; " \
            "stopping.claim(Path(sys.argv[1])); print('claimed', flush=True); time.sleep(float(sys.argv[2]))"
    for name in ("gputravel-dead", "gputravel-live", "gputravel-unclaimed"):
        (tmp_path / name).mkdir()
    subprocess.run([sys.executable, "-c", claim, str(tmp_path / "gputravel-dead"), "0"], check=True, capture_output=True)
    live = subprocess.Popen([sys.executable, "-c", claim, str(tmp_path / "gputravel-live"), "60"], stdout=subprocess.PIPE)
    try:
        assert live.stdout.readline() == b"claimed\n"
        (tmp_path / "gputravel-dead" / "parties").mkdir()
        fd = os.open(tmp_path / "gputravel-dead" / "parties", os.O_RDONLY)
        for _ in range(1200):  # deeper than Python's recursion limit, as a party may nest its own
            os.mkdir("d", dir_fd=fd)
            fd, up = os.open("d", os.O_RDONLY, dir_fd=fd), fd
            os.close(up)
        os.close(fd)
        (tmp_path / "gputravel-dead" / "pki").mkdir()
        (tmp_path / "gputravel-dead" / "pki" / "h1.key").write_text("a key")
        target = tmp_path / "elsewhere"
        target.mkdir()
        (tmp_path / "gputravel-link").symlink_to(target)
        stopping.sweep(str(tmp_path), "gputravel-")
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == ["elsewhere", "gputravel-link", "gputravel-live", "gputravel-unclaimed"]
    finally:
        live.kill()
        live.wait()
    stopping.sweep(str(tmp_path), "gputravel-")  # its launcher is gone now
    assert not (tmp_path / "gputravel-live").exists()


def test_sigterm_and_sighup_unwind_a_launcher_and_its_teardown_is_not_cut_short(processes) -> None:
    """cohort/stopping.py in-process: while a launcher runs, SIGTERM and SIGHUP raise
    Terminated; a handler someone else set is left alone; the teardown ignores both."""
    import signal

    from gputravel.cohort import stopping
    from gputravel.errors import Terminated

    undo = stopping.catch_term("the cohort was stopped")
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            with pytest.raises(Terminated, match=f"stopped by {sig.name}; the cohort was stopped"):
                os.kill(os.getpid(), sig)
                signal.sigtimedwait([], 0.1)  # the handler runs at the next bytecode: wait for it here
        stopping.catch_term("an inner launcher")()  # opened and closed while the outer one runs
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0.1)
        with stopping.uninterrupted():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 0.1)  # ignored, both
    finally:
        undo()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL


def test_records_smaller_than_a_mib_and_several_per_buffer_verify(tmp_path: Path) -> None:
    """Manifest pieces follow the record size; the orchestrator must hash VRAM with the
    holder's piece size, not a default (a buffer of three 512 KiB records). The real
    orchestrator and holder on the in-process cohort: the check is the travel's, not the
    processes'."""
    from gputravel.protocol.layout import Layout
    from gputravel.testing.cohort import InProcessCohort

    data = make_data(tmp_path / "h.bin", 4 * MIB, 1)
    with InProcessCohort({"h1": tmp_path / "h.bin"}, buffer_bytes=3 * 512 * 1024, workdir=tmp_path,
                         layout=Layout(record_bytes=512 * 1024)) as cohort:
        for offset in (0, 3 * 512 * 1024):
            report = cohort.orchestrator.travel("h1", offset)
            assert report.chunk is not None
            assert report.chunk.digest == chunk_digest(data[offset : offset + 3 * 512 * 1024], 512 * 1024)


def test_a_holder_killed_mid_copy_is_dropped_and_can_rejoin(processes, datasets) -> None:
    from dataclasses import replace

    from gputravel.errors import RemoteError

    cfg = config(datasets)
    cfg = replace(cfg, holders=(replace(cfg.holders[0], die_mid_copy_on_travel=1),) + cfg.holders[1:])
    with Cohort(cfg) as cohort:
        with pytest.raises(RemoteError, match="h1"):
            cohort.travel("h1", 0)
        assert cohort.children["h1"].proc.wait(timeout=10) == 70  # it died half-way through the copy
        assert cohort.travel("h2", 0).chunk is not None  # GPU back, keys rotated, others go on
        with pytest.raises(RemoteError, match="offline"):
            cohort.travel("h1", 0)
        assert cohort.restart_holder("h1") == len(datasets["h1"][1])  # boots, probes, attests, joins
        report = cohort.travel("h1", MIB)
        assert report.chunk is not None and report.chunk.digest == chunk_digest(datasets["h1"][1][MIB : 2 * MIB])
        # Every attempt is in the orchestrator's signed log, the failed ones as aborted.
        from gputravel.orchestrator.audit import verify_log

        log = verify_log(cohort.audit_log_path, cohort.orchestrator_certificate())
        assert [(e.event, e.holder) for e in log.entries] == [
            ("aborted", "h1"), ("travel", "h2"), ("aborted", "h1"), ("travel", "h1")]
        assert log.entries[0].epoch_after == log.entries[0].epoch_before + 1  # recovery rotated the keys


def test_a_launch_hook_cannot_change_a_trusted_party_nor_who_a_party_is(datasets) -> None:
    """The orchestrator is measured (and holders pin it) before it starts, so a launch hook
    that changed how it starts would run code or configuration the holders never accepted.
    A hook may start an untrusted party (the host, a holder) another way, as the red team
    does, but never under another name or enrolment."""
    def launched(spec: PartySpec, **changes) -> PartySpec:
        hook = lambda s: dataclasses.replace(s, **changes)  # noqa: E731
        return Supervisor(config(datasets), launch=hook)._launched_as(spec)

    orchestrator = PartySpec("orchestrator", "orchestrator", {"verify": True, "enroll": "orchestrator"})
    for role in TRUSTED_ROLES:
        spec = dataclasses.replace(orchestrator, role=role, key=role)
        with pytest.raises(BadInput, match="trusted"):
            launched(spec, config={**spec.config, "verify": False})
        with pytest.raises(BadInput, match="trusted"):
            launched(spec, entry="somewhere.else")
        assert launched(spec) == spec
    holder = PartySpec("holder", "mallory", {"name": "mallory", "enroll": "mallory"})
    with pytest.raises(BadInput, match="who 'mallory' is"):
        launched(holder, config={**holder.config, "enroll": "alice"})
    with pytest.raises(BadInput, match="who 'mallory' is"):
        launched(holder, key="alice")
    assert launched(holder, entry="gputravel.redteam.entry").entry == "gputravel.redteam.entry"
