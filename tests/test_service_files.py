"""Root reads and writes files in directories the parties' accounts own (their state, the
orchestrator's run directory): a link, a FIFO or an oversized file a party leaves there must
not send root to another file, stall it, or fill the user's disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gputravel.crypto.pki import pin_peers, self_signed_member
from gputravel.errors import BadInput
from gputravel.files import copy_plain, read_plain
from gputravel.service.launch import ServiceLaunch
from gputravel.service.party import private_dir, publish


def test_plain_file_helpers_follow_no_link_and_never_block_on_a_fifo(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"ROOT ONLY")
    (tmp_path / "link").symlink_to(secret)
    os.mkfifo(tmp_path / "fifo")
    for planted in ("link", "fifo"):
        with pytest.raises(OSError):
            read_plain(tmp_path / planted)
        with pytest.raises(OSError):
            copy_plain(tmp_path / planted, tmp_path / "out")
    (tmp_path / "real").write_bytes(b"data")
    victim = tmp_path / "victim"
    victim.write_bytes(b"VICTIM")
    (tmp_path / "dest").symlink_to(victim)
    copy_plain(tmp_path / "real", tmp_path / "dest")  # replaces the link, never writes through it
    assert victim.read_bytes() == b"VICTIM" and (tmp_path / "dest").read_bytes() == b"data"
    with pytest.raises(OSError, match="over"):
        copy_plain(tmp_path / "real", tmp_path / "big", limit=2)


def test_the_services_follow_no_link_a_party_left_in_its_own_directory(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"ROOT ONLY")
    state = tmp_path / "state"
    state.mkdir()
    (state / "pki").symlink_to(tmp_path)  # a link where its private directory goes
    with pytest.raises(BadInput, match="not a directory of its own"):
        private_dir(state / "pki")
    (state / "holder-north.pem").symlink_to(victim)
    with pytest.raises(OSError):
        publish(state / "holder-north.pem", tmp_path / "public.pem")
    pki = tmp_path / "pki"
    pki.mkdir()
    self_signed_member(pki, "north")
    (pki / "ca.pem").unlink()
    (pki / "ca.pem").symlink_to(victim)
    pin_peers(pki, "north", [])
    assert victim.read_bytes() == b"ROOT ONLY" and b"CERTIFICATE" in (pki / "ca.pem").read_bytes()


def test_the_demo_launcher_copies_back_only_the_run_files_and_no_link(tmp_path: Path, capsys) -> None:
    """What the orchestrator's account left in its run directory and state: only the run's
    own files come back to the user's run directory, as plain files."""
    cohort, inside, state, run = (tmp_path / n for n in ("d/cohort", "inside", "state", "run"))
    for d in (cohort / "public", inside, state):
        d.mkdir(parents=True)
    (cohort / "orchestrator.toml").write_text(f'state_dir = "{state}"\n[job]\nrun_dir = "{inside}"\n')
    secret = tmp_path / "secret"
    secret.write_bytes(b"ROOT ONLY")
    (inside / "metrics.csv").write_text("step,loss\n0,1.0\n")
    (inside / "checkpoint.pt").symlink_to(secret)
    (inside / "big.bin").write_bytes(b"x" * 1000)
    (state / "audit.log").symlink_to(secret)
    (cohort / "public" / "orchestrator.pem").write_text("CERT")
    launch = ServiceLaunch([], {}, run, audit_log=run / "audit.log", certificate=run / "orchestrator.pem")
    launch.dir = tmp_path / "d"
    launch._stage_out()
    assert sorted(p.name for p in run.iterdir()) == ["metrics.csv", "orchestrator.pem"]
    # Each file left behind is said (a link here), not dropped in silence.
    said = capsys.readouterr().err
    assert "checkpoint.pt was not copied back" in said and "audit.log was not copied back" in said


def test_the_live_view_reads_each_step_once_as_rows_are_appended_and_again_after_a_rewrite(tmp_path: Path) -> None:
    """The launcher's poll reads only what was appended, never a half-written row, and starts
    over when metrics.csv is rewritten shorter in place; a step it showed is not shown again."""
    inside = tmp_path / "inside"
    inside.mkdir()
    (tmp_path / "d" / "cohort").mkdir(parents=True)
    (tmp_path / "d" / "cohort" / "orchestrator.toml").write_text(f'state_dir = "{tmp_path}"\n[job]\nrun_dir = "{inside}"\n')
    launch = ServiceLaunch([], {}, tmp_path / "run", audit_log=tmp_path / "a", certificate=tmp_path / "c")
    launch.dir, launch._observed = tmp_path / "d", {}  # nothing to observe here
    metrics, got = inside / "metrics.csv", []
    head = "step,loss,tokens_per_s,holder,travels,stall_share,elapsed_s\n"

    def row(step: int) -> str:
        return f"{step},{1.0 / (step + 1)},100.0,north,1,0.0,{step}.5\n"

    metrics.write_text(head + row(0) + row(1) + "2,0.3")  # the third row is being written
    seen = launch._relay(-1, got.append)
    with metrics.open("a") as f:
        f.write(",100.0,north,1,0.0,2.5\n" + row(3))
    seen = launch._relay(seen, got.append)
    assert [r["step"] for r in got] == [0, 1, 2, 3] and got[2] == {"step": 2, "loss": 0.3, "tokens_per_s": 100.0,
                                                                   "holder": "north", "travels": 1, "stall_share": 0.0,
                                                                   "elapsed_s": 2.5}
    metrics.write_text(head + row(0))  # rewritten (a resume from step 1 truncates, then appends)
    seen = launch._relay(seen, got.append)  # notices the file is shorter
    with metrics.open("a") as f:
        f.write(row(4))
    launch._relay(seen, got.append)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4]


def _service_run_dir(tmp_path: Path, **options) -> tuple[ServiceLaunch, Path]:
    """A launcher whose orchestrator's run directory is `inside`, with nothing started."""
    inside = tmp_path / "inside"
    inside.mkdir()
    (tmp_path / "d" / "cohort").mkdir(parents=True)
    (tmp_path / "d" / "cohort" / "orchestrator.toml").write_text(f'state_dir = "{tmp_path}"\n[job]\nrun_dir = "{inside}"\n')
    launch = ServiceLaunch([], {}, tmp_path / "run", audit_log=tmp_path / "run" / "audit.log",
                           certificate=tmp_path / "run" / "orchestrator.pem", **options)
    launch.dir, launch._observed = tmp_path / "d", {}  # nothing to observe here
    return launch, inside


def _step(step: int, holder: str) -> dict:
    """A metrics.csv row as the training loop writes it (train/loop.StepEvent)."""
    return {"step": step, "loss": 1.0 / (step + 1), "tokens_per_s": 100.0, "holder": holder, "travels": step,
            "stall_share": 0.0, "elapsed_s": step + 0.5}


def test_a_metrics_file_replaced_by_a_longer_one_is_read_from_its_start(tmp_path: Path) -> None:
    """A metrics.csv rewritten whole (os.replace, as train/rundir.py writes) and already longer
    than what was read of the old one: read from its start, each later step once, no row
    made of the old file's offset into the new one's bytes."""
    from gputravel.files import atomic_write_bytes

    launch, inside = _service_run_dir(tmp_path)
    head = "step,loss,tokens_per_s,holder,travels,stall_share,elapsed_s\n"

    def rows(steps, holder: str) -> str:
        return "".join(f"{s},0.5,100.0,{holder},{s},0.0,{s}.5\n" for s in steps)

    got: list[dict] = []
    long = "a-holder-with-a-long-name"
    atomic_write_bytes(inside / "metrics.csv", (head + rows(range(3), long)).encode())
    seen = launch._relay(-1, got.append)
    # Steps 2 on trained again with shorter rows: the old offset lies past the start of step 3's.
    atomic_write_bytes(inside / "metrics.csv", (head + rows(range(2), long) + rows(range(2, 9), "s")).encode())
    launch._relay(seen, got.append)
    assert [(r["step"], r["holder"]) for r in got] == [(0, long), (1, long), (2, long), *((s, "s") for s in range(3, 9))]


def test_a_resumed_run_shows_each_step_it_trains_once_and_keeps_the_earlier_rows(tmp_path: Path) -> None:
    """--resume: the live view shows the steps the job trains now, once, in order; the rows of
    the run it resumes are not replayed as if new (they were shown when they were trained).
    They come back in the run directory's metrics.csv, before the rows trained now."""
    from gputravel.train.rundir import RunDir

    launch, inside = _service_run_dir(tmp_path, resume=True)
    run = RunDir(tmp_path / "run")
    for step in range(8):  # the first run logged steps 0-7; its checkpoint is of step 5
        run.append_metrics(_step(step, "first"))
    run.checkpoint_path.write_bytes(b"checkpoint of step 5")
    earlier = run.metrics_path.read_bytes()
    launch._stage_in()
    assert (inside / "checkpoint.pt").read_bytes() == b"checkpoint of step 5" and not (inside / "metrics.csv").exists()
    launch._stage_out()  # stopped before its first step: the earlier rows stay as they were
    assert run.metrics_path.read_bytes() == earlier
    got: list[dict] = []
    seen = launch._relay(-1, got.append)
    service = RunDir(inside)  # as train/loop.py writes it on a resume from step 5
    service.truncate_metrics(5)
    for step in range(5, 10):
        seen = launch._relay(seen, got.append)
        service.append_metrics(_step(step, "now"))
    launch._relay(seen, got.append)
    assert [(r["step"], r["holder"]) for r in got] == [(s, "now") for s in range(5, 10)]
    launch._stage_out()
    assert [(int(r["step"]), r["holder"]) for r in run.read_metrics()] == \
        [(s, "first") for s in range(5)] + [(s, "now") for s in range(5, 10)]


def test_an_earlier_metrics_file_that_cannot_be_joined_is_set_aside_and_the_new_rows_kept(tmp_path: Path,
                                                                                          capsys) -> None:
    """The earlier metrics.csv is the user's and may be anything: it is read a line at a time
    (a 64 KiB piece at most), a long line never passes as a row, and one of other columns is
    moved to metrics.csv.before, said, with this run's rows kept (hostile review of session
    24: a crafted file was parsed whole, could exhaust memory, or lost the new rows)."""
    from gputravel.train.rundir import RunDir

    launch, inside = _service_run_dir(tmp_path, resume=True)
    run, service = RunDir(tmp_path / "run"), RunDir(inside)
    for step in range(3):
        run.append_metrics(_step(step, "first"))
    head = run.metrics_path.read_bytes().split(b"\n", 1)[0]
    long_row = b"1," + b"x" * ((1 << 16) - 2) + b"0,injected\n"  # one line; its second piece looks like a row
    run.metrics_path.write_bytes(run.metrics_path.read_bytes() + long_row)
    for step in range(2, 4):
        service.append_metrics(_step(step, "now"))
    launch._stage_out()
    rows = run.metrics_path.read_bytes().splitlines()
    assert rows[0] == head and [r.split(b",")[0] for r in rows[1:]] == [b"0", b"1", b"2", b"3"]
    assert b"injected" not in run.metrics_path.read_bytes()
    run.metrics_path.write_bytes(b"step,other,columns\n0,1,2\n")
    launch._stage_out()
    assert (tmp_path / "run" / "metrics.csv.before").read_bytes() == b"step,other,columns\n0,1,2\n"
    assert [int(r["step"]) for r in run.read_metrics()] == [2, 3]
    assert "metrics.csv.before" in capsys.readouterr().err


def test_a_copied_shard_keeps_its_tokenizer_record(tmp_path: Path, monkeypatch) -> None:
    """A single-shard dataset in a closed directory is copied for its holder with the
    tokenizer record beside it (data/tokenizer.py RECORD_NAME), as Placement.dataset hands both."""
    from gputravel.cohort import isolation
    from gputravel.data.tokenizer import RECORD_NAME

    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "shard.bin").write_bytes(b"tokens")
    (home / RECORD_NAME).write_text('{"name": "bytes"}')
    monkeypatch.setattr(isolation, "decide", lambda _: (True, ""))
    monkeypatch.setattr(isolation, "unreachable", lambda p: p)
    launch = ServiceLaunch([], {}, tmp_path / "run", audit_log=tmp_path / "a.log", certificate=tmp_path / "o.pem")
    launch.dir = tmp_path / "d"
    launch.dir.mkdir()
    copied = Path(launch._reachable("north", str(home / "shard.bin")))
    assert copied.read_bytes() == b"tokens" and (copied.parent / RECORD_NAME).read_text() == '{"name": "bytes"}'


def test_several_gpus_need_a_log_and_certificate_for_each_rank(tmp_path) -> None:
    """Fewer places than ranks silently dropped the other ranks' signed logs."""
    with pytest.raises(BadInput, match="2 GPUs need 2"):
        ServiceLaunch([], {}, tmp_path / "run", audit_log=tmp_path / "a", certificate=tmp_path / "c", gpus=2)
