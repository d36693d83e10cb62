"""Shared fixtures, and the two tiers.

The fast tier (`make check`, `pytest -m "not slow"`) is every test that starts no process. A
test or fixture that starts one (a cohort, a service, ranks, the CLI in a subprocess) asks
for the `processes` fixture, which marks it `slow`; any other test that tries to start a
process fails at once, saying so. So a new test cannot land in the wrong tier by forgetting a
marker.
"""

from __future__ import annotations

import os

# The suite oversubscribes the cores (workers, parties, ranks), and a thread that spins waiting for
# work takes a core another process needs. Set before torch or numpy loads; children inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import shutil
import tempfile
import threading
from dataclasses import dataclass, field

import _posixsubprocess
import subprocess

import pytest

import profiles
from gputravel.testing import TIMEOUT_SCALE

profiles.load()  # before any test module builds its settings

SLOW_FIXTURE = "processes"


@pytest.fixture(scope="session")
def processes() -> float:
    """This test starts processes (slow tier). Its value: the factor every wait of the test
    scales by (GPUTRAVEL_TEST_TIMEOUT_SCALE), so a busy machine is given more time."""
    return TIMEOUT_SCALE


_OWN_BASE: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """As root, a session's temporary directories go under a base of its own (0711), not the
    shared /tmp/pytest-of-root: every pytest session makes that one 0700 again when it starts,
    which, with a second suite running beside this one, shut the parties' accounts out of this
    one's cohort directories halfway through. Deleted when the session ends."""
    # xdist hands out files by their number of tests, most first, unless told not to (its
    # --loadscope-reorder is on by default): HEAVY_FIRST's order below would not hold, and
    # heavy files of few tests (test_fl_deploy.py: 2) would start last and end the run alone.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if os.geteuid() == 0 and config.option.basetemp is None and not hasattr(config, "workerinput"):
        # Under xdist the controller makes it and each worker takes basetemp/popen-gwN below.
        base = tempfile.mkdtemp(prefix="gt-")  # short: sockets live below it, and xdist adds popen-gwN
        os.chmod(base, 0o711)
        _OWN_BASE.append(base)
        config.option.basetemp = os.path.join(base, "t")
    if not hasattr(config, "workerinput"):
        _warm_font_cache()


def _warm_font_cache() -> None:
    """Build matplotlib's font cache here, before any guard is on: on a machine without one, its
    first import runs `fc-list`, which the fast tier's guard refuses, failing whichever test plots
    first. The workers then read it (each party builds its own, in its own home)."""
    from matplotlib import font_manager  # noqa: F401  # only for its side effect, the cache


def pytest_unconfigure(config: pytest.Config) -> None:
    for base in _OWN_BASE:
        shutil.rmtree(base, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests that start processes `slow`; give every test pytest-timeout's limit (or
    its own) times GPUTRAVEL_TEST_TIMEOUT_SCALE."""
    base = float(config.getini("timeout") or 0)
    for item in items:
        if SLOW_FIXTURE in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
        own = item.get_closest_marker("timeout")
        limit = float(own.args[0] if own and own.args else own.kwargs.get("timeout", base) if own else base)
        if limit > 0 and TIMEOUT_SCALE != 1.0:
            item.add_marker(pytest.mark.timeout(limit * TIMEOUT_SCALE))
    _heavy_files_first(items)


# The files that hold a worker half a minute or more, heaviest first (`--durations`, 2026-11-29, less
# what the red team's and the epoch machine's fixes took off): xdist's loadfile hands files out in the
# order collected (pytest_configure turns its reordering off), so no worker ends alone on a heavy one.
# test_workloads.py early: five of its in-process tests took 166 s in the fast tier on 2026-11-29 (load 3).
HEAVY_FIRST = ("test_gpus_train.py", "test_workloads.py", "test_fl_deploy.py", "test_training.py", "test_redteam.py",
               "test_service_deploy.py", "test_service_gpus.py", "test_demo_release.py", "test_redteam_records.py",
               "test_train_ranks.py", "test_bench_train_records.py", "test_bench_smoke.py", "test_torchrun.py",
               "test_redteam_jobs.py")


def _heavy_files_first(items: list[pytest.Item]) -> None:
    """Files in HEAVY_FIRST's order, then those that start processes, then the rest; a file's own
    tests keep their order."""
    slow = {item.path.name for item in items if item.get_closest_marker("slow") is not None}

    def rank(item: pytest.Item) -> tuple[int, int]:
        name = item.path.name
        return (HEAVY_FIRST.index(name), 0) if name in HEAVY_FIRST else (len(HEAVY_FIRST), 0 if name in slow else 1)

    items.sort(key=rank)  # stable: within a file, and among equals, the collection order stays


def _refuse_process(*args: object, **kwargs: object) -> None:
    raise AssertionError("this test starts a process but does not ask for the `processes` fixture "
                         "(tests/conftest.py): ask for it, directly or through a fixture, so it runs in the slow tier")


def _guarded(item: pytest.Item):
    """Run a fast test's setup or call with every way to start a process refused."""
    if item.get_closest_marker("slow") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_posixsubprocess, "fork_exec", _refuse_process)  # multiprocessing's spawn
        patch.setattr(subprocess, "_fork_exec", _refuse_process)  # Popen's own reference to it
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            patch.setattr(os, name, _refuse_process)
        yield


# Setup and call only: a module's fixtures are torn down in the teardown of its last test,
# which may be a fast one, and their cleanup (stopping a cohort, deleting its directory with
# rm) must run whatever that test is.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    yield from _guarded(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    yield from _guarded(item)


@dataclass
class HostWithDevice:
    """A real host process loop (in a thread) and a stand-in device that acknowledges every
    attach: enough for CVM-side code that talks to the PCIe MUX without touching the GPU."""

    socket_path: str
    bar: int = -1  # the device's BAR0 memfd and doorbell eventfd, as it gave them to the host
    bell: int = -1
    attached: list[str] = field(default_factory=list)  # the CVMs the device was attached to, in order


@pytest.fixture
def make_host(tmp_path):
    """Start a real host loop (optionally with hooks) and its stand-in device; closed after the test."""
    from gputravel.host.process import HostConfig, HostProcess
    from gputravel.protocol.host import AttachCvm, DeviceAck, DeviceAttach
    from gputravel.transport.unix import connect_unix

    opened = []

    def start(hooks=None) -> HostWithDevice:
        sock = str(tmp_path / f"host{len(opened)}.sock")
        host = HostProcess(HostConfig(socket_path=sock), hooks=hooks)
        threading.Thread(target=host.serve, daemon=True).start()
        device = connect_unix(sock, "device")
        out = HostWithDevice(sock, bar=os.memfd_create("bar"), bell=os.eventfd(0, os.EFD_NONBLOCK))
        os.ftruncate(out.bar, 8192)
        device.send(DeviceAttach(serial="GPU-TEST", bar_bytes=8192), fds=(out.bar, out.bell))
        opened.append((device, out))

        def play_device() -> None:
            while True:
                try:
                    got = device.recv(timeout=30)
                except Exception:
                    return
                for fd in got.fds:
                    os.close(fd)
                if isinstance(got.message, AttachCvm):
                    out.attached.append(got.message.cvm)
                    device.send(DeviceAck(cvm=got.message.cvm))

        threading.Thread(target=play_device, daemon=True).start()
        return out

    yield start
    for device, out in opened:
        device.close()  # the host stops serving once its device is gone
        for fd in (out.bar, out.bell):
            os.close(fd)


@pytest.fixture
def host_with_device(make_host):
    return make_host()


# ----------------------------------------------------------------------------- torch.distributed ranks
def _rank_main(target, rank: int, world: int, port: int, args: tuple):
    """One rank in a child process: join a gloo group on 127.0.0.1, run `target`."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share this machine's cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        return target(rank, world, *args)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def run_ranks(processes):
    """`run_ranks(target, world, *args, timeout=...)`: the list of each rank's return value.

    `target(rank, world, *args)` is a module-level function of a test file; it runs in `world`
    processes joined by torch.distributed (gloo, env://), started by gputravel.ddp.launch.
    Children come from a forkserver that imported torch once, so each launch costs a fork,
    not an interpreter start. A rank that raises, dies or hangs fails the test, named."""
    from gputravel.ddp.launch import ProcessFailed, ProcessesSilent, free_port, run_processes

    def run(target, world: int, *args, timeout: float = 60.0) -> list:
        port = free_port()
        try:
            return run_processes([(_rank_main, (target, r, world, port, args)) for r in range(world)],
                                 timeout * processes,
                                 names=[f"rank {r}" for r in range(world)], method="forkserver",
                                 preload=["torch", "torch.distributed", "gputravel.ddp"], grace=5.0)
        except ProcessFailed as err:
            raise AssertionError(f"{err}\n{err.details}") from None
        except ProcessesSilent as err:
            raise AssertionError(str(err)) from None

    return run


@pytest.fixture(scope="module")
def searchable_tmp(tmp_path_factory):
    """As root, deployed services run each party under its own account, which must reach the
    cohort directory: let other accounts search (not list) pytest's temporary directories."""
    base = tmp_path_factory.getbasetemp()
    if os.geteuid() == 0:
        for d in (base.parent, base):
            os.chmod(d, 0o711)
    return base


@pytest.fixture
def kill_orchestrators(processes):
    """SIGKILL orchestrator CVM processes this test's cohorts started (a crash, not a
    shutdown): every one, or the first `limit` found."""
    import signal
    from pathlib import Path

    def parent(pid: int) -> int:
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return 0

    def ours(pid: int) -> bool:  # started by this test, directly or through a service
        while pid > 1:
            pid = parent(pid)
            if pid == os.getpid():
                return True
        return False

    def kill(limit: int | None = None) -> int:
        killed = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"gputravel.cohort.entry" in argv and b"orchestrator" in argv and ours(int(pid)):
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
                if limit is not None and killed >= limit:
                    break
        return killed

    return kill


RANK_TEXTS = {
    "north": "Now is the winter of our discontent made glorious summer by this sun of York. " * 12,
    "south": "If music be the food of love, play on; give me excess of it, that, surfeiting. " * 10,
    "west": "When shall we three meet again in thunder, lightning, or in rain? " * 14,
}


@pytest.fixture(scope="session")
def write_rank_shares():
    """Three small text holders written into a directory, dealt to two ranks as
    [[north], [south, west]]: (name, path) per holder, per rank."""
    from pathlib import Path

    def write(tmp: Path) -> list[list[tuple[str, str]]]:
        paths = {}
        for name, text in RANK_TEXTS.items():
            (tmp / f"{name}.txt").write_text(text)
            paths[name] = str(tmp / f"{name}.txt")
        return [[("north", paths["north"])], [("south", paths["south"]), ("west", paths["west"])]]

    return write
