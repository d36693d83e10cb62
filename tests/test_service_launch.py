"""The demo's cohort as services (service/launch.py): each party's own service from its own
config, started and owned by the launcher, the run directory staged in and out."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

import pytest

from gputravel.cohort import isolation
from gputravel.errors import BadInput
from gputravel.jobs.training import TrainingJobConfig, resolve
from gputravel.service.launch import ServiceLaunch, boot_rounds
from gputravel.train.loop import TrainConfig

pytestmark = pytest.mark.integration

TINY = TrainConfig(steps=6, batch=2, seq_len=16, buffer_bytes=4096, n_layer=1, n_head=2, n_embd=32,
                   threads=1, sample_tokens=0, warmup_steps=2, checkpoint_every=0)


def _job(tmp: Path) -> TrainingJobConfig:
    closed = tmp / "closed"  # a home no other account can search
    closed.mkdir(mode=0o700)
    for name in ("north", "south"):
        (closed / name).mkdir()
        (closed / name / "book.txt").write_text(f"the {name} holder's words, over and over. " * 80)
    holders = tuple((n, str(closed / n)) for n in ("north", "south"))
    return resolve(TrainingJobConfig(train=TINY, holders=holders, run_dir=str(tmp / "run")))


def _ours() -> list[int]:
    """Services and parties this test started, directly or through a service, still alive
    (other tests' helpers, a multiprocessing resource tracker say, are not this test's)."""
    mine = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"gputravel.cohort.entry" not in argv and b"serve" not in argv:
            continue
        p = int(pid)
        while p > 1:
            try:
                p = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
            if p == os.getpid():
                mine.append(int(pid))
                break
    return mine


def test_the_services_train_and_a_copied_dataset_is_its_holders_alone(processes, tmp_path):
    job = _job(tmp_path)
    steps: list[int] = []
    seen: dict = {}
    launch = ServiceLaunch(job.holders, job.train.to_dict(), tmp_path / "run", audit_log=tmp_path / "run" / "audit.log",
                           certificate=tmp_path / "run" / "orchestrator.pem")
    with launch:
        if isolation.decide(None)[0]:  # as root: each copy belongs to its holder's account alone
            for name in ("north", "south"):
                copy = launch.dir / "data" / name
                uid = launch._config(f"holder-{name}")["uid"]
                seen[name] = (copy.stat().st_uid == uid, stat.S_IMODE(copy.stat().st_mode))
        report = launch.train(lambda row: steps.append(row["step"]))
    assert steps == list(range(TINY.steps)) and len(report["losses"]) == TINY.steps
    assert all(v == (True, 0o700) for v in seen.values()), seen
    run = tmp_path / "run"
    assert {"checkpoint.pt", "metrics.csv", "report.json", "audit.log", "orchestrator.pem"} <= {p.name for p in run.iterdir()}
    assert launch.dir is None and not _ours()  # the cohort directory is gone, no service or party left


def test_a_job_the_job_table_refuses_is_named_before_anything_starts(processes, tmp_path, searchable_tmp):
    job = _job(tmp_path)
    bad = job.train.replace(buffer_bytes=4096 + 512)  # part of a page: the [job] table is refused
    # Its own directory: another worker's launch makes its cohort directory in /tmp meanwhile.
    work = Path(tempfile.mkdtemp(dir=searchable_tmp))
    os.chmod(work, 0o711)
    with pytest.raises(BadInput, match=r"job\.buffer_bytes"):
        with ServiceLaunch(job.holders, bad.to_dict(), tmp_path / "run", audit_log=tmp_path / "a.log",
                           certificate=tmp_path / "o.pem", workdir=str(work)):
            pass
    assert not _ours() and not list(work.iterdir())  # no cohort directory left behind


def _wait_until_none_of_ours() -> None:
    import time

    deadline = time.monotonic() + 20
    while _ours() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _ours()


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-2000:]


def _its_services_started(work: Path, pid: int) -> bool:
    """Whether the launcher `pid` made its cohort directory in `work`, its host is up and a
    holder logs there: a running cohort, not one already failing."""
    for d in work.glob("gputravel-services-*"):
        with contextlib.suppress(OSError):
            if ((d / "launcher.pid").read_text().strip() == str(pid) and list(d.glob("logs/holder-*.log"))
                    and '"event": "up"' in (d / "logs" / "host.log").read_text()):
                return True
    return False


def test_a_demo_stopped_with_sigterm_or_killed_leaves_no_service_and_no_keys(processes, tmp_path):
    """SIGTERM (a `timeout`, a `kill`) unwinds the launch: every service stopped, the cohort
    directory with its keys deleted. Killed outright, its services die with it (PDEATHSIG)
    and the next launch deletes the directory it left."""
    import shutil
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    # The launcher's cohort directory lands in $TMPDIR: a short one, as a Unix socket's path
    # has at most 107 bytes (pytest's tmp_path is too deep for the cohort's sockets: the
    # host's service then failed to bind, and the demo failed by itself, racing the signal).
    work = Path(tempfile.mkdtemp(prefix="gt-", dir="/tmp"))
    os.chmod(work, 0o711)  # the parties' accounts reach the cohort directory by path
    env = {**os.environ, "TMPDIR": str(work)}
    try:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            said = tmp_path / f"demo-{sig}.txt"  # what the demo printed, for the messages
            with open(said, "wb") as out:
                code = "import sys; from gputravel.cli.app import app; sys.exit(app())"
                demo = subprocess.Popen([sys.executable, "-c", code, "demo", "--steps", "2000", "--run-dir",
                                         str(tmp_path / f"run-{sig}")], env=env, stdout=out, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 60
            while not _its_services_started(work, demo.pid):  # in this launcher's own directory
                assert demo.poll() is None, f"the demo ended before its services started: {_tail(said)}"
                assert time.monotonic() < deadline, "the demo's host and holders did not start within 60 s"
                time.sleep(0.2)
            time.sleep(1)  # some services up
            from gputravel.service.launch import _children

            services = [p for p in _children(demo.pid)  # `gputravel serve ROLE` each
                        if b"serve" in Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")]
            # In sessions of their own: a group's signal (Ctrl-C, `timeout`) reaches the launcher alone.
            assert services and all(os.getsid(p) == p != os.getsid(demo.pid) for p in services)
            assert demo.poll() is None and b"error:" not in said.read_bytes(), \
                f"the demo failed by itself before {sig!r}: {_tail(said)}"
            demo.send_signal(sig)
            assert demo.wait(timeout=60) != 0
            _wait_until_none_of_ours()
            if sig == signal.SIGTERM:  # unwound: its directory, keys and all, went at once
                assert not list(work.glob("gputravel-services-*")), _tail(said)
        # SIGTERM's directory went at once; the killed launcher's goes with the next launch.
        assert len(list(work.glob("gputravel-services-*"))) == 1, _tail(said)
        from gputravel.cohort.stopping import sweep
        from gputravel.service.launch import PREFIX

        sweep(str(work), PREFIX)
        assert not list(work.glob("gputravel-services-*"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_a_stopped_service_is_named_with_the_reason_its_log_gives_first(tmp_path: Path) -> None:
    from gputravel.service.launch import _why

    log = tmp_path / "orchestrator.log"
    log.write_text('{"ts": 1, "party": "orchestrator", "event": "up"}\nnot json\n'
                   '{"ts": 2, "party": "orchestrator", "event": "failed", "kind": "BadInput", "why": "--shuffle all: '
                   'raise it"}\n{"ts": 3, "party": "orchestrator", "event": "stopped"}\n')
    assert _why(log) == ": BadInput: --shuffle all: raise it"
    log.write_text('{"ts": 1, "party": "orchestrator", "event": "up"}\n')
    assert _why(log) == "" and _why(tmp_path / "absent.log") == ""


def test_holders_of_different_gpus_boot_together_and_those_of_one_gpu_in_turn() -> None:
    holders = [("a", "/run/gpu-0.lock"), ("b", "/run/gpu-1.lock"), ("c", "/run/gpu-0.lock"), ("d", "/run/gpu-0.lock")]
    assert boot_rounds(holders) == [["a", "b"], ["c"], ["d"]]
    assert boot_rounds(holders[:1] + holders[2:]) == [["a"], ["c"], ["d"]]  # one GPU: one at a time, as listed
    assert boot_rounds([]) == []
