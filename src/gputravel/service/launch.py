"""The demo's cohort as a consortium deploys one (issue 16): `cohort init`, then each party's
service as a child of this launcher, which leaves none behind. The run directory is staged in
and copied back whatever the end, with each rank's signed travel log; data other accounts
cannot reach is copied into a directory its holder's alone.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import shutil
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gputravel.processes import Children
from gputravel.cohort import isolation, stopping
from gputravel.data.tokenizer import RECORD_NAME
from gputravel.errors import BadInput, PeerTimeout, RemoteError
from gputravel.files import atomic_write, copy_plain, open_plain, read_plain
from gputravel.service.config import AUDIT_LOG, BROKER, host_party, orchestrator_party
from gputravel.service.config import HolderService, load_service
from gputravel.service.init import carry_state, check_own_keys, init_cohort, write_service
from gputravel.service.job import make_identity, published_parties, set_job

if TYPE_CHECKING:
    from gputravel.manifest import JobManifest

__all__ = ["ServiceLaunch", "StepRow", "boot_rounds"]

# `gputravel serve` through its own entry: the command line's imports cost each service 0.16 s.
# -P: `-c` would put the working directory first on sys.path (a module planted there would run as root).
SERVE = ("-P", "-c", "import sys; from gputravel.service.serve import main; sys.exit(main(sys.argv[1:]))", "serve")
BOOT_TIMEOUT_S = 120.0  # every service up, the orchestrator's holders joined
STOP_GRACE_S = 20.0  # a stopping service finishes its step or its goodbye within this
POLL_S = 0.05
MAX_METRICS_READ = 4 << 20  # of metrics.csv a poll reads at most (the rest, the next poll)
MAX_METRICS_LINE = 1 << 16  # of one metrics.csv row: a longer line is read in pieces, none of them a row
MAX_REPORT_BYTES = 64 << 20
MAX_COPY_BYTES = 16 << 30  # a run directory file larger than any checkpoint of ours is not copied back
# What the orchestrator's run directory gives back to the user's (train/rundir.py), no more; with a
# manifest the checkpoint and model.sealed are sealed, model.release is sealed to the recipients
# (orchestrator/release.py SEALED_MODEL, RELEASE_FILE).
RUN_FILES = ("checkpoint.pt", "metrics.csv", "report.json", "loss.png", "eval.png", "sample.txt", "model.sealed",
             "model.release")
PREFIX = "gputravel-services-"
# A step's row in metrics.csv (train/loop.StepEvent): the type of each column.
STEP_COLUMNS: Mapping[str, type] = {"step": int, "loss": float, "tokens_per_s": float, "holder": str, "travels": int,
                                    "stall_share": float, "elapsed_s": float}

StepRow = dict  # one metrics.csv row, typed by STEP_COLUMNS


class ServiceLaunch:
    """A local cohort of services on `gpus` GPUs; `rank_audit`: where each rank's log and certificate go.
    `manifest`: the job's, approved for the holders in `approve` (None: all), signed by all but `decline`;
    `keep_dir`: where the keys a sealed checkpoint depends on outlive the cohort (a resume reopens with them)."""

    def __init__(self, holders: Sequence[tuple[str, str]], job: Mapping[str, object], run_dir: Path, *,
                 audit_log: Path, certificate: Path, hardware: str = "emulated", resume: bool = False,
                 workdir: str | None = None, gpus: int = 1, shares: Sequence[Sequence[str]] | None = None,
                 rank_audit: Sequence[tuple[Path, Path]] = (), manifest: JobManifest | None = None,
                 approve: Sequence[str] | None = None, decline: Sequence[str] = (),
                 keep_dir: Path | None = None, caps: Mapping[str, float] | None = None) -> None:
        self.holders, self.job, self.run_dir, self.resume = list(holders), dict(job), Path(run_dir), resume
        self.manifest, self.decline, self.keep_dir = manifest, tuple(decline), keep_dir
        self.caps = dict(caps or {})  # holder -> the epsilon_cap the demo sets for it, standing for it
        self.approve = [n for n, _ in self.holders] if approve is None else list(approve)
        self.hardware, self.workdir = hardware, workdir
        self.gpus, self.shares = gpus, None if shares is None else [list(s) for s in shares]
        self.rank_audit = list(rank_audit) or [(audit_log, certificate)]
        if len(self.rank_audit) != gpus:  # each rank's log comes back, or none is dropped unsaid
            raise BadInput(f"rank_audit names {len(self.rank_audit)} ranks' log and certificate; {gpus} GPUs need {gpus}")
        self.rank_reports: list[dict] = []  # each rank's own report, once trained (rank 0's is train's)
        self.dir: Path | None = None
        # Each party's service, by party; close() stops the orchestrators first, then the rest.
        self.children = Children(STOP_GRACE_S)
        self._metrics_at, self._metrics_head = 0, ""  # how far metrics.csv was read, its header
        self._metrics_id: tuple[int, int] | None = None  # which file that was (device, inode)
        self._observed: dict | None = None
        self._orchestrator: dict | None = None  # its config, read once: the run loop polls paths in it
        self._undo_term: Callable[[], None] = lambda: None

    def __enter__(self) -> ServiceLaunch:
        self._undo_term = stopping.catch_term("the cohort's services were stopped")
        with contextlib.ExitStack() as undo:  # a start that fails stops what it started
            undo.callback(self.close)
            self.start()
            undo.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _set_job(self, holders: list[str]) -> None:
        """The manifest's job, naming the identities each holder and the broker made (carried ones kept),
        as each party would make its own; the demo approves for those in `approve`."""
        assert self.manifest is not None
        for party in [*(f"holder-{n}" for n in holders), BROKER]:
            make_identity(self.cohort / f"{party}.toml")
        if not self.manifest.release.certificates and not self.manifest.broker.identity:  # else set_job checks them
            self.manifest = self.manifest.with_parties(*published_parties(self.cohort, self.manifest.release.holders))
        for name, cap in self.caps.items():  # the holder's own budget, before it is asked to approve
            path = self.cohort / f"holder-{name}.toml"
            holder = load_service(path, "holder")
            assert isinstance(holder, HolderService)
            write_service(path, holder.model_copy(update={"policy": holder.policy.model_copy(
                update={"epsilon_cap": cap})}))
        set_job(self.cohort, self.manifest, job=self.job, approve=self.approve, decline=self.decline)

    @property
    def cohort(self) -> Path:
        assert self.dir is not None
        return self.dir / "cohort"

    @property
    def service_run_dir(self) -> Path:
        if self._orchestrator is None:
            self._orchestrator = self._config("orchestrator")
        return Path(self._orchestrator["job"]["run_dir"])

    def start(self) -> None:
        """Init, stage in, then the key broker, host, GPU, holders (each probes the GPU in turn: paper 4.1),
        orchestrator."""
        stopping.sweep(self.workdir, PREFIX)  # what a launcher killed outright left: its keys among it
        self.dir = Path(tempfile.mkdtemp(prefix=PREFIX, dir=self.workdir))
        stopping.claim(self.dir)
        if isolation.decide(None)[0]:
            os.chmod(self.dir, 0o711)  # each party's account reaches its own files by path
        holders = [(name, self._reachable(name, path)) for name, path in self.holders]
        carried = None
        if self.keep_dir is not None and os.path.lexists(self.keep_dir):
            if not self.resume:  # a fresh run makes fresh keys: whatever lies there is not carried on
                check_own_keys(self.keep_dir)  # nor deleted, if it is not ours
                shutil.rmtree(self.keep_dir)
            else:
                check_own_keys(self.keep_dir)
                carried = self.keep_dir
        init_cohort(self.cohort, holders, job=self.job, hardware=self.hardware, gpus=self.gpus, shares=self.shares,
                    carry=carried)
        if self.manifest is not None:
            self._set_job([n for n, _ in holders])
        if self.keep_dir is not None:  # kept before anything runs: a run killed now resumes with them
            carry_state(Path(self._config(BROKER)["state_dir"]).parent, self.keep_dir, [n for n, _ in holders])
        self._hand_copies()
        self._stage_in()
        self._serve(BROKER)  # up before the orchestrator, which asks it for its keys; nobody else needs it
        for k in range(self.gpus):
            self._serve(host_party(k))
        for k in range(self.gpus):
            self._serve(f"gpu-{k}")
        for batch in boot_rounds([(n, self._config(f"holder-{n}")["boot_lock"]) for n, _ in holders]):
            for name in batch:
                self._serve(f"holder-{name}")
            for name in batch:  # one a GPU at a time: each probes its GPU at boot
                self._await(f"holder-{name}", "up")
        self._await(BROKER, "up")
        for k in range(self.gpus):
            self._serve(orchestrator_party(k))

    def close(self) -> None:
        """Stop every service (the orchestrator first: it checkpoints), copy the run directory
        back, delete the cohort directory. Never raises, and no signal cuts it short."""
        with stopping.uninterrupted():
            try:
                # The orchestrators first, each in turn (it checkpoints); then the rest together: one
                # at a time, a 4-holder cohort of two GPUs took 7 s to stop, together under 2 s.
                for party in reversed([p for p in self.children if p.startswith("orchestrator")]):
                    self.children.stop([party])
                self.children.close()  # SIGTERM (a service stops cleanly on it), then SIGKILL
                if self.dir is not None and (self.cohort / "orchestrator.toml").exists():
                    self._stage_out()
            except Exception as exc:  # noqa: BLE001 - the copy back is best effort, said; the deletion is not
                print(f"gputravel: the run directory was not copied back: {type(exc).__name__}: {exc}", file=sys.stderr)
            finally:
                if self.dir is not None:
                    # A party outliving its killed service dies by PDEATHSIG a moment later.
                    stopping.delete(self.dir, wait=5.0)
                self.dir, self._orchestrator = None, None
        self._undo_term()
        self._undo_term = lambda: None

    def train(self, on_step: Callable[[StepRow], None] | None = None, timeout: float = 24 * 3600.0) -> dict:
        """Wait for every rank's orchestrator to exit, relaying rank 0's steps; its report, or why it stopped."""
        ranks = [self.children[orchestrator_party(k)] for k in range(self.gpus)]
        orchestrator, seen = ranks[0], -1
        deadline = time.monotonic() + timeout
        while any(r.poll() is None for r in ranks):
            if self._observed is None and self._up(orchestrator_party(0)):
                self._observed = self._observe()  # every party is up once the orchestrator is: a resume may train none
            seen = self._relay(seen, on_step)
            self._check_alive()
            if time.monotonic() > deadline:
                raise PeerTimeout(f"the orchestrator's service did not finish in {timeout:.0f} s")
            time.sleep(POLL_S)
        self._relay(seen, on_step)
        self._check_alive()  # a rank that failed, named
        self.rank_reports = [self._report(k) for k in range(self.gpus)]
        report = self.rank_reports[0]
        if orchestrator.returncode != 0 or not all(isinstance(r, dict) for r in self.rank_reports):
            logs = self.children.logs
            refusals = "".join(f"\n {party}:{_tail(log, 4)}" for party, log in logs.items()
                               if '"event": "refused"' in log.read_text(errors="replace"))
            first = logs[orchestrator_party(0)]
            raise RemoteError(f"the orchestrator's service stopped (exit {orchestrator.returncode}){_why(first)}"
                              f"{_tail(first)}{refusals}")
        return report

    def _up(self, party: str) -> bool:
        return '"event": "up"' in self.children.logs[party].read_text(errors="replace")

    def _report(self, rank: int) -> dict | None:
        path = Path(self._config(orchestrator_party(rank))["job"]["run_dir"]) / "report.json"
        try:
            found = json.loads(read_plain(path, MAX_REPORT_BYTES))
        except (OSError, ValueError):
            return None
        return found if isinstance(found, dict) else None

    def isolation(self) -> dict:
        """Each party's account and dumpability as /proc showed them while training, against its config's uid."""
        planned = {p.stem: self._config(p.stem).get("uid", -1) for p in sorted(self.cohort.glob("*.toml"))}
        seen = self._observed or {}
        on = all(u >= 0 for u in planned.values()) and bool(seen) and all(
            not got["dumpable"] and got["uid"] == planned.get(party, -2) for party, got in seen.items())
        reason = "" if on else ("not root: every party runs as the launcher's user"
                                if any(u < 0 for u in planned.values()) else "not every party was seen isolated")
        return {"on": on, "reason": reason, "parties": seen}

    def _serve(self, party: str) -> None:
        assert self.dir is not None
        log = self.dir / "logs" / f"{party}.log"
        log.parent.mkdir(exist_ok=True)
        role = party.split("-")[0]
        self.children.start(party, [sys.executable, *SERVE, role, "--config", str(self.cohort / f"{party}.toml")],
                            log=log, preexec_fn=isolation.die_with_parent,  # a launcher killed outright takes them along
                            # A group's signal reaches the launcher alone, which stops them in order.
                            start_new_session=True)

    def _await(self, party: str, event: str) -> None:
        log, deadline = self.children.logs[party], time.monotonic() + BOOT_TIMEOUT_S
        while f'"event": "{event}"' not in log.read_text(errors="replace"):
            self._check_alive()
            if time.monotonic() > deadline:
                raise PeerTimeout(f"{party}'s service was not {event} in {BOOT_TIMEOUT_S:.0f} s{_tail(log)}")
            time.sleep(POLL_S)

    def _check_alive(self) -> None:
        """Name a service that failed (with several GPUs a rank's orchestrator too: its peers would wait)."""
        for party, log in self.children.logs.items():
            proc = self.children[party]
            if (self.gpus > 1 or party != "orchestrator") and proc.poll() not in (None, 0):
                raise RemoteError(f"{party}'s service stopped (exit {proc.returncode}){_why(log)}{_tail(log)}")

    def _relay(self, seen: int, on_step: Callable[[StepRow], None] | None) -> int:
        """Every whole metrics.csv row appended after step `seen`, in order; the last step relayed."""
        try:
            new = self._read_metrics()
        except OSError:
            return seen
        complete = new[: new.rfind(b"\n") + 1]
        self._metrics_at += len(complete)  # bytes, as read: an undecodable byte changes no offset
        text = complete.decode(errors="replace")
        if not self._metrics_head and text:
            head, _, text = text.partition("\n")
            self._metrics_head = head + "\n"
        for row in csv.DictReader(io.StringIO(self._metrics_head + text)):
            try:
                typed = {k: cast(row[k]) for k, cast in STEP_COLUMNS.items()}
            except (KeyError, TypeError, ValueError):
                continue
            if typed["step"] > seen:
                seen = typed["step"]
                if on_step is not None:
                    on_step(typed)
        return seen

    def _read_metrics(self) -> bytes:
        """What metrics.csv gained since the last read; a file replaced or shorter is read from its start."""
        with os.fdopen(open_plain(self.service_run_dir / "metrics.csv"), "rb") as f:
            st = os.fstat(f.fileno())
            if (st.st_dev, st.st_ino) != self._metrics_id or st.st_size < self._metrics_at:
                self._metrics_id, self._metrics_at, self._metrics_head = (st.st_dev, st.st_ino), 0, ""
            f.seek(self._metrics_at)
            return f.read(MAX_METRICS_READ)

    def _observe(self) -> dict:
        """Each party process's uid and dumpability as /proc shows them, by its service's party."""
        out = {}
        for party in self.children:
            for pid in _children(self.children[party].pid):
                with contextlib.suppress(OSError, KeyError, ValueError, IndexError):
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    if b"gputravel.cohort.entry" in argv and argv[argv.index(b"gputravel.cohort.entry") + 1] != b"tdx-module":
                        got = isolation.read_party(pid)
                        out[party] = {"uid": got.uid, "dumpable": got.dumpable}
        return out

    def _config(self, party: str) -> dict:
        return tomllib.loads((self.cohort / f"{party}.toml").read_text())

    def _reachable(self, name: str, path: str) -> str:
        """`path`, or a copy when other accounts cannot read it: a holder's service reads it as its account."""
        src = Path(path).resolve()
        if not isolation.decide(None)[0] or (isolation.unreachable(src) is None and
                                              isolation.readable_by_others(src) is None):
            return str(src)
        assert self.dir is not None
        data = self.dir / "data"
        data.mkdir(mode=0o711, exist_ok=True)  # searchable, not listable
        (data / name).mkdir(mode=0o700)  # closed before a byte is copied in: root's, then its holder's
        dest = data / name / src.name
        if src.is_dir():
            shutil.copytree(src, dest, symlinks=True)  # a link is copied as a link, never followed by root
        else:
            shutil.copyfile(src, dest, follow_symlinks=False)
            record = src.parent / RECORD_NAME  # a shard's tokenizer record sits beside it (data/tokenizer.py)
            if record.is_file():
                shutil.copyfile(record, data / name / RECORD_NAME, follow_symlinks=False)
        return str(dest)

    def _hand_copies(self) -> None:
        """A copied dataset is its holder's alone: its account's, closed to every other party."""
        data = self.dir / "data" if self.dir is not None else None
        if data is None or not data.is_dir():
            return
        for copy in data.iterdir():
            uid = self._config(f"holder-{copy.name}").get("uid", -1)
            if uid >= 0:
                isolation.give(copy, uid, 0o700)

    def _stage_in(self) -> None:
        """A checkpoint to resume into every rank's run directory; never an old report or metrics,
        which could pass for this run's (earlier rows are joined back at the end)."""
        for k in range(self.gpus):  # every rank resumes the same checkpoint, or none does
            inside = Path(self._config(orchestrator_party(k))["job"]["run_dir"])
            inside.mkdir(parents=True, exist_ok=True)
            if self.resume:
                with contextlib.suppress(FileNotFoundError):
                    copy_plain(self.run_dir / "checkpoint.pt", inside / "checkpoint.pt")

    def _stage_out(self) -> None:
        """Rank 0's run directory back to the user's, with every rank's signed travel log and certificate."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        inside = self.service_run_dir
        copies = [(inside / name, self.run_dir / name) for name in RUN_FILES]
        for k, (log, cert) in enumerate(self.rank_audit):
            party = orchestrator_party(k)
            state = Path(self._config(party)["state_dir"])
            copies += [(state / AUDIT_LOG, log), (self.cohort / "public" / f"{party}.pem", cert)]
        for src, dest in copies:
            try:
                if src.name == "metrics.csv" and self.resume and dest.exists():
                    _join_metrics(dest, src)
                else:
                    copy_plain(src, dest, MAX_COPY_BYTES)
            except FileNotFoundError:
                continue  # the run never made it
            except OSError as exc:  # too big, not a plain file (a link, a FIFO), or no room: not copied, said
                print(f"gputravel: {src.name} was not copied back to {dest}: {exc}", file=sys.stderr)


def boot_rounds(holders: Sequence[tuple[str, str]]) -> list[list[str]]:
    """The holders (name, its GPU's boot lock) in rounds that boot together: the k-th holder of each
    GPU in round k. A holder that finds its GPU's lock taken joins late, so no two of one GPU share a round."""
    by_gpu: dict[str, list[str]] = {}
    for name, lock in holders:
        by_gpu.setdefault(lock, []).append(name)
    depth = max(map(len, by_gpu.values()), default=0)
    return [[names[k] for names in by_gpu.values() if k < len(names)] for k in range(depth)]


def _join_metrics(dest: Path, new: Path) -> None:
    """A resumed run's metrics.csv: the earlier rows before its first step, then its own; the earlier
    file, of any size or shape, is read line by line, or moved aside to metrics.csv.before, said."""
    with os.fdopen(open_plain(new), "rb") as fresh:
        head, first = fresh.readline(MAX_METRICS_LINE), fresh.readline(MAX_METRICS_LINE)
        step = _step_of(first)
        if step is None:
            return  # no row of its own
        try:
            old = os.fdopen(open_plain(dest), "rb")
        except OSError as exc:
            return _set_aside(dest, new, f"it is not a plain file ({exc.strerror or exc})")
        with old:
            if old.readline(MAX_METRICS_LINE) != head:
                return _set_aside(dest, new, "its columns are not this run's")

            def write(out) -> None:
                out.write(head)
                whole = True  # the piece read starts a line (a longer one comes in pieces)
                for piece in iter(lambda: old.readline(MAX_METRICS_LINE), b""):
                    starts, whole = whole, piece.endswith(b"\n")
                    seen = _step_of(piece) if starts and whole else None
                    if seen is not None and seen < step:
                        out.write(piece)
                out.write(first)
                shutil.copyfileobj(fresh, out)

            atomic_write(dest, write)


def _step_of(row: bytes) -> int | None:
    try:
        return int(row.split(b",", 1)[0])
    except ValueError:
        return None


def _set_aside(dest: Path, new: Path, why: str) -> None:
    aside = dest.with_name(dest.name + ".before")
    os.replace(dest, aside)
    copy_plain(new, dest, MAX_COPY_BYTES)
    print(f"gputravel: the earlier {dest.name} was not joined with this run's ({why}); it is now {aside}",
          file=sys.stderr)


def _children(pid: int) -> list[int]:
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _why(log: Path) -> str:
    """The reason a service's last "failed" event gives (service/party.py log lines), first: the tail
    that follows is its context."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if '"event": "failed"' in line:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("why"):
                return f": {event.get('kind', 'error')}: {event['why']}"
    return ""


def _tail(log: Path, lines: int = 12) -> str:
    """The last lines of a service's log, or why there are none: a failure never goes unexplained."""
    try:
        text = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError as exc:
        return f"\n  (its log {log} could not be read: {exc.strerror or exc})"
    return "\n  " + "\n  ".join(text) if text else f"\n  (its log {log} is empty)"
