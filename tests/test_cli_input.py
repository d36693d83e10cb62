"""Bad input on the command line is answered, never crashed on (audit finding 5): each value is
checked before anything starts, against what this machine can carry, and the refusal is one
line naming the flag, with no traceback. Nothing here starts a process (the fast tier), but
for the one test that runs the real entry point to see what a user sees."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gputravel.cli.app import app
from gputravel.cohort import capacity

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
