"""Bad input on the command line is answered, never crashed on (audit finding 5): each value is
checked before anything starts, against what this machine can carry, and the refusal is one
line naming the flag, with no traceback. Nothing here starts a process (the fast tier), but
for the one test that runs the real entry point to see what a user sees."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import tomllib
from importlib import import_module
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from gputravel.bench import codec as codec_bench
from gputravel.bench import compare
from gputravel.cli import audit as audit_cli
from gputravel.cli.app import app
from gputravel.cohort import capacity
from gputravel.service import init as service_init

prepare_module = import_module("gputravel.data.prepare")  # the package's `prepare` is its function

DEEP = 5000  # far past Python's recursion limit: tomllib and json recurse once a level


def refused(args: list[str], *says: str) -> str:
    """Run the command line in-process: it must exit non-zero, saying each of `says`, with no
    exception escaping (one that escapes is a traceback on a user's terminal)."""
    res = CliRunner().invoke(app, args)
    out = " ".join(res.output.replace("│", " ").split())  # rich wraps long lines, in a box for usage errors
    assert res.exit_code != 0, out
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    for words in says:
        assert words in out, out
    return out


@pytest.fixture
def fifo(tmp_path: Path):
    """A FIFO, and a guard: if a command opens it to read (which blocks until a writer comes),
    a writer comes after 10 s and closes at once, so the test fails instead of hanging."""
    path = tmp_path / "fifo"
    os.mkfifo(path)
    done = threading.Event()

    def unblock() -> None:
        if not done.wait(10):
            with open(path, "wb"):
                pass

    guard = threading.Thread(target=unblock, daemon=True)
    guard.start()
    yield path
    done.set()
    guard.join()


@pytest.fixture
def deep_toml(tmp_path: Path) -> Path:
    path = tmp_path / "deep.toml"
    path.write_text("a = " + "[" * DEEP + "]" * DEEP + "\n")
    return path


@pytest.fixture
def deep_json(tmp_path: Path) -> Path:
    path = tmp_path / "deep.json"
    path.write_text("[" * DEEP + "]" * DEEP)
    return path


# ----------------------------------------------------------------------------- demo
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1", "1e300", "1000000"])
def test_demo_refuses_a_buffer_that_is_no_size_or_above_the_cap(tmp_path: Path, value: str) -> None:
    refused(["demo", "--buffer-mib", value, "--run-dir", str(tmp_path / "run")], "--buffer-mib", "finite number")


def test_demo_refuses_a_buffer_of_part_of_a_page(tmp_path: Path) -> None:
    refused(["demo", "--buffer-mib", "0.001", "--run-dir", str(tmp_path / "run")],
            "--buffer-mib must be a multiple of 0.00390625 (4 KiB)", "got 0.001")


def test_demo_refuses_a_buffer_the_machine_cannot_hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Below the cap, the GPU's VRAM (the buffer and 64 MiB more, populated) must fit in memory."""
    monkeypatch.setattr(capacity, "available_mib", lambda: 1000)
    refused(["demo", "--buffer-mib", "512", "--run-dir", str(tmp_path / "run")],
            "--buffer-mib 512", "MemAvailable 1000 MiB")


def test_demo_refuses_a_sequence_its_buffer_or_memory_cannot_hold(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    refused(["demo", "--seq-len", "100000000", "--run-dir", run], "--seq-len 100000000", "--buffer-mib")
    # A buffer that holds the batch, and a model whose position embedding alone is 100 GB:
    # refused before the orchestrator tries to allocate it.
    refused(["demo", "--seq-len", "100000000", "--batch", "1", "--buffer-mib", "1024", "--run-dir", run],
            "--seq-len 100000000", "MiB of memory")
    refused(["demo", "--seq-len", "100000000", "--batch", "1", "--buffer-mib", "1024", "--loader", "local",
             "--run-dir", run], "--seq-len 100000000", "MiB of memory")


def test_demo_refuses_a_batch_the_memory_cannot_hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capacity, "available_mib", lambda: 2000)
    refused(["demo", "--seq-len", "4096", "--buffer-mib", "1", "--run-dir", str(tmp_path / "run")],
            "--batch 8 x --seq-len 4096", "MemAvailable 2000 MiB")


@pytest.mark.parametrize("args, flag", [
    (["--threads", "1000000"], "--threads"),
    (["--seed", str(10 ** 23)], "--seed"),
    (["--server-mbit", "nan", "--gpus", "2", "--servers"], "--server-mbit"),
])
def test_demo_refuses_numbers_torch_or_a_link_cannot_take(tmp_path: Path, args: list[str], flag: str) -> None:
    refused(["demo", *args, "--run-dir", str(tmp_path / "run")], flag)


def test_demo_refuses_a_run_directory_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    refused(["demo", "--run-dir", str(tmp_path / "file")], "--run-dir", "is not a directory")
    refused(["demo", "--run-dir", str(tmp_path / "file" / "run")], "--run-dir", "is not a directory")
    refused(["demo", "--run-dir", str(tmp_path / "run"), "--json", str(tmp_path)], "--json", "is a directory")


def test_demo_refuses_a_fifo_as_data(tmp_path: Path, fifo: Path) -> None:
    refused(["demo", "--holder-data", f"a={fifo}", "--run-dir", str(tmp_path / "run")],
            "data of holder 'a'", "is not a regular file or directory")


def test_travel_refuses_a_workdir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    refused(["travel", "--workdir", str(tmp_path / "file")], "--workdir", "is not a directory")


# ----------------------------------------------------------------------------- data, cohort, services
def test_a_fifo_is_no_data_for_prepare_or_cohort_init(tmp_path: Path, fifo: Path) -> None:
    refused(["data", "prepare", "--input", str(fifo), "--out", str(tmp_path / "out")],
            f"input {fifo} is not a regular file or directory")
    refused(["cohort", "init", str(tmp_path / "cohort"), "--holder", f"a={fifo}"],
            "--holder", "is not a regular file or directory")


def test_cohort_init_refuses_a_buffer_above_the_cap(tmp_path: Path) -> None:
    (tmp_path / "data.txt").write_text("text")
    for kib in ("6", str(10 ** 12)):
        refused(["cohort", "init", str(tmp_path / "cohort"), "--holder", f"a={tmp_path / 'data.txt'}",
                 "--buffer-kib", kib], "--buffer-kib must be a multiple of 4")


def test_a_service_config_nested_too_deeply_or_a_fifo_is_refused(deep_toml: Path, fifo: Path) -> None:
    refused(["status", "--config", str(deep_toml)], f"{deep_toml}: not valid TOML: nested too deeply")
    refused(["serve", "host", "--config", str(deep_toml)], f"{deep_toml}: not valid TOML: nested too deeply")
    refused(["status", "--config", str(fifo)], f"{fifo}: not a regular file")


def test_json_nested_too_deeply_is_refused(deep_json: Path) -> None:
    refused(["attest", "measure", "--config", str(deep_json)], str(deep_json), "invalid JSON")
    refused(["attest", "verify", "--evidence", str(deep_json), "--nonce", "00", "--policy", str(deep_json)],
            str(deep_json), "invalid JSON")


# ----------------------------------------------------------------------------- plan and benchmarks
PLAN = ["plan", "--source", "paper", "--hardware", "paper-h100", "--dataset", "1GiB"]


@pytest.mark.parametrize("args, flag", [
    (["--tokens-per-s", "nan"], "--tokens-per-s"),
    (["--tokens-per-s", "inf"], "--tokens-per-s"),
    (["--step-s", "inf", "--tokens-per-step", "10"], "--step-s"),
    (["--step-s", "nan", "--tokens-per-step", "10"], "--step-s"),
    (["--tokens-per-s", "10", "--bytes-per-token", "nan"], "--bytes-per-token"),
    (["--tokens-per-s", "10", "--model-size", "1e300GiB"], "--model-size"),
])
def test_plan_refuses_numbers_that_are_no_numbers(args: list[str], flag: str) -> None:
    refused([*PLAN, *args], flag)


def test_plan_refuses_results_it_cannot_read(deep_json: Path, fifo: Path) -> None:
    refused([*PLAN, "--tokens-per-s", "10", "--results", str(fifo)], "--results", "is not a regular file or directory")
    # A JSON nested too deeply is no benchmark's: skipped as an invalid one is, so no constants.
    refused(["plan", "--source", "results", "--dataset", "1GiB", "--tokens-per-s", "10", "--results", str(deep_json)],
            "no `bench travel` JSON")


@pytest.mark.parametrize("args, flag", [
    (["bench", "codec", "--repeat", "0"], "--repeat"),
    (["bench", "fl-sweep", "--rounds", "0"], "--rounds"),
    (["bench", "fl-sweep", "--holder-tokens", "1e5"], "--holder-tokens"),
    (["bench", "compare", "--max-transfer-s", "nan"], "--max-transfer-s"),
    (["bench", "compare", "--link-check-s", "-1"], "--link-check-s"),
    (["bench", "train", "--buffer-kib", str(10 ** 14)], "--buffer-kib"),
    (["bench", "train", "--buffer-kib", "6"], "--buffer-kib"),
])
def test_benchmarks_refuse_numbers_before_anything_starts(args: list[str], flag: str) -> None:
    refused(args, flag)


def test_benchmark_sizes_are_checked_against_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capacity, "available_mib", lambda: 2000)
    refused(["bench", "travel", "--sizes", "4,2048"], "--sizes", "MemAvailable 2000 MiB")


def test_an_os_error_on_a_path_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """Past every command's own checks, an OSError on a path still ends as one line."""
    (tmp_path / "file").write_text("")
    refused(["bench", "codec", "--repeat", "1", "--json", str(tmp_path / "file" / "codec.json")],
            "error:", str(tmp_path / "file"))


# ----------------------------------------------------------------------------- what a user sees
def test_the_real_entry_point_prints_no_traceback(tmp_path: Path, deep_toml: Path, processes: float) -> None:
    entry = [sys.executable, "-c", "import sys; from gputravel.cli.app import app; sys.exit(app())"]
    for args, says in ((["demo", "--buffer-mib", "nan", "--run-dir", str(tmp_path / "run")], "--buffer-mib"),
                       (["status", "--config", str(deep_toml)], "nested too deeply")):
        done = subprocess.run([*entry, *args], capture_output=True, text=True, timeout=120 * processes)
        out = " ".join((done.stdout + done.stderr).split())
        assert done.returncode == 1 and says in out and "Traceback" not in out, out


# ----------------------------------------------------------------------------- review 2: bad input that hung or ran on
def started(*_args: object, **_kwargs: object) -> None:
    """Put where a command's real work starts: a refusal must come before it."""
    raise AssertionError("the command started instead of refusing its input")


def sigterm_self(*_args: object, **_kwargs: object) -> None:
    """A SIGTERM to this process midway, as `timeout` sends it; only once the command made it
    unwind (by default it would end the test run itself)."""
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, "SIGTERM would end the process unwinding nothing"
    os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture
def cohort_tmp(searchable_tmp: Path, tmp_path: Path) -> Path:
    os.chmod(tmp_path, 0o711)  # init refuses, as root, a directory the parties could not reach
    (tmp_path / "data.txt").write_text("text")
    return tmp_path


@pytest.fixture
def key_and_log(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "key.pem").write_text("")
    (tmp_path / "audit.log").write_bytes(b"")
    return tmp_path / "key.pem", tmp_path / "audit.log"


def test_audit_verify_reads_no_fifo_device_or_giant_as_the_log(tmp_path: Path, fifo: Path,
                                                                key_and_log: tuple[Path, Path]) -> None:
    key, _ = key_and_log
    big = tmp_path / "big.log"
    big.write_bytes(b"")
    os.truncate(big, audit_cli.MAX_LOG_BYTES + 1)  # sparse: nothing written
    for log, says in ((fifo, "is not a regular file"), (Path("/dev/zero"), "is not a regular file"),
                      (big, f"above the {audit_cli.MAX_LOG_BYTES:,}")):
        refused(["audit", "verify", str(log), "--key", str(key)], f"audit log {log}", says)


def test_audit_verify_reads_no_fifo_device_or_giant_as_the_key(tmp_path: Path, fifo: Path,
                                                                key_and_log: tuple[Path, Path]) -> None:
    _, log = key_and_log
    big = tmp_path / "big.pem"
    big.write_bytes(b"")
    os.truncate(big, audit_cli.MAX_KEY_BYTES + 1)
    # /dev/null stands for /dev/urandom: a device is refused alike, and it ends if it is read.
    for key, says in ((fifo, "is not a regular file"), (Path("/dev/null"), "is not a regular file"),
                      (big, f"above the {audit_cli.MAX_KEY_BYTES:,}")):
        refused(["audit", "verify", str(log), "--key", str(key)], f"--key {key}", says)


def test_cohort_init_caps_gpus_by_the_uid_block_and_memory(cohort_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp_path = cohort_tmp
    monkeypatch.setattr(service_init, "_provision", started)
    def args(holders: int) -> list[str]:
        each = [f"--holder=h{i}={tmp_path / 'data.txt'}" for i in range(holders)]
        return ["cohort", "init", str(tmp_path / "cohort"), *each, "--gpus"]

    # Each GPU is a stack of 4 parties (host route, GPU, orchestrator, TDX module) and a share of
    # one holder at least: (1023 - 300) // 4 = 180 stacks beside 300 holders.
    refused([*args(1), "2"], "--gpus must be between 1 and 1", "each GPU travels to a share", "got 2")
    refused([*args(300), "100000"], "--gpus must be between 1 and 180", "block of 1024 uids", "got 100000")
    monkeypatch.setattr(capacity, "available_mib", lambda: 1000)
    refused([*args(20), "20"], "--gpus 20", "MemAvailable 1000 MiB")
    assert not (tmp_path / "cohort").exists()


def test_a_sigterm_during_cohort_init_leaves_nothing(cohort_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp_path = cohort_tmp
    monkeypatch.setattr(service_init, "write_registry", sigterm_self)  # the last step: most is written
    refused(["cohort", "init", str(tmp_path / "cohort"), "--holder", f"a={tmp_path / 'data.txt'}"],
            "stopped by SIGTERM; cohort init was undone")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.txt"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # as it was before the command


def test_prepare_refuses_shards_of_a_few_tokens(tmp_path: Path) -> None:
    (tmp_path / "text.txt").write_text("x" * 5000)
    refused(["data", "prepare", "--input", str(tmp_path / "text.txt"), "--out", str(tmp_path / "out"),
             "--tokenizer", "bytes", "--shard-tokens", "1"],
            "--shard-tokens 1 would cut the input's up to 5,001 tokens into more than 1,024 shards",
            "use --shard-tokens 5 or more")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.txt"]


def test_a_sigterm_during_prepare_leaves_no_temporary_directory(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepare_module, "write_tokenizer_record", sigterm_self)  # after the shards
    (tmp_path / "text.txt").write_text("x" * 5000)
    refused(["data", "prepare", "--input", str(tmp_path / "text.txt"), "--out", str(tmp_path / "out"),
             "--tokenizer", "bytes", "--shard-tokens", "100"], "stopped by SIGTERM; nothing was written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.txt"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_demo_and_codec_refuse_counts_that_never_finish(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec_bench, "_median_us", started)
    huge = "99999999999999999999"
    refused(["bench", "codec", "--repeat", huge], "--repeat must be between 1", f"and 1000, got {huge}")
    import gputravel.jobs.training as training  # torch: only here

    monkeypatch.setattr(training, "run_training_job", started)
    refused(["demo", "--steps", huge, "--run-dir", str(tmp_path / "run")], f"--steps must be at most 10,000,000, got {huge}")
    assert not (tmp_path / "run").exists()


def test_demo_refuses_a_run_directory_it_cannot_write_before_training(monkeypatch: pytest.MonkeyPatch) -> None:
    import gputravel.jobs.training as training  # torch: only here

    monkeypatch.setattr(training, "run_training_job", started)
    refused(["demo", "--run-dir", "/proc/self"], "--run-dir /proc/self: cannot write there")


def test_compare_refuses_a_directory_as_the_plot_and_plots_to_the_path_named(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compare, "run", started)
    refused(["bench", "compare", "--plot", str(tmp_path)], f"--plot {tmp_path} is a directory")
    cell = {"bandwidth_mbit": None, "size_mib": 4, "travel_ms": 1.0, "baseline_ms": 2.0, "extrapolated": False,
            "speedup": 2.0}
    assert compare.plot({"cells": [cell], "link": "token-bucket"}, tmp_path / "figure") == tmp_path / "figure"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figure"]  # not figure.png


def test_a_cohort_dir_with_a_trailing_slash_is_named_so(cohort_tmp: Path) -> None:
    tmp_path = cohort_tmp
    service_init.init_cohort(tmp_path / "cohort", [("a", str(tmp_path / "data.txt"))])
    config = tmp_path / "cohort" / "host.toml"
    text = config.read_text()
    config.write_text(text.replace(f'cohort_dir = "{tmp_path / "cohort"}"', f'cohort_dir = "{tmp_path / "cohort"}/"'))
    refused(["status", "--config", str(config)],
            "cohort_dir: expected the cohort directory's path without a trailing slash")


def test_cohort_init_of_record_holders_names_the_workload_to_choose(cohort_tmp: Path) -> None:
    from gputravel.data.demo_records import demo_holders

    holders = [f"--holder=a{n[-1]}={p}" for n, p in demo_holders("tabular", 2, cohort_tmp / "data")]
    refused(["cohort", "init", str(cohort_tmp / "c1"), *holders], "job.workload: expected one that trains on records")
    refused(["cohort", "init", str(cohort_tmp / "c2"), *holders, "--workload", "nope"], "--workload takes one of")
    res = CliRunner().invoke(app, ["cohort", "init", str(cohort_tmp / "c3"), *holders, "--workload", "tabular"])
    assert res.exit_code == 0, res.output
    job = tomllib.loads((cohort_tmp / "c3" / "orchestrator.toml").read_text())["job"]
    assert job["workload"] == "tabular" and "features" in job["record_schema"]


def test_every_commands_help_is_reflowed_into_whole_paragraphs() -> None:
    """typer's rich help keeps a docstring's line breaks past its first paragraph, which wrapped at
    the terminal's width left ragged lines (cli/output.reflow)."""
    seen: list[str] = []

    def walk(cmd, path: str) -> None:
        if cmd.help:
            seen.append(path)
            for paragraph in cmd.help.split("\n\n"):
                assert "\n" not in paragraph, f"{path}: a line break inside a paragraph: {paragraph!r}"
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(typer.main.get_command(app), "gputravel")
    assert {"gputravel demo", "gputravel bench travel", "gputravel cohort init"} <= set(seen)
    out = CliRunner().invoke(app, ["demo", "--help"]).output
    assert "A local cohort runs" in out and "the model released by a quorum" in out
