"""The launcher of data-parallel ranks (ddp/launch.py): one result a process, and a named
error for a process that raised, died without a word or stayed silent."""

from __future__ import annotations

import os
import time

import pytest

from gputravel.ddp.launch import ProcessFailed, ProcessesSilent, run_processes
from gputravel.errors import PeerTimeout, RemoteError

pytestmark = pytest.mark.usefixtures("processes")  # every test here starts processes

FAST = {"method": "forkserver", "preload": ["gputravel.ddp.launch"], "grace": 2.0}  # a fork a process


def twice(x: int) -> int:
    return 2 * x


def boom() -> None:
    raise ValueError("boom")


def vanish() -> None:
    os._exit(3)  # no answer, no exception: as a rank the kernel killed


def hang() -> None:
    time.sleep(60)


def test_each_process_returns_its_result_in_order() -> None:
    assert run_processes([(twice, (i,)) for i in range(3)], 30, **FAST) == [0, 2, 4]


def test_a_process_that_raises_is_named_with_its_error() -> None:
    with pytest.raises(ProcessFailed) as err:
        run_processes([(twice, (1,)), (boom, ())], 30, names=["rank 0", "rank 1"], **FAST)
    assert isinstance(err.value, RemoteError)
    assert str(err.value) == "rank 1 failed: ValueError: boom"
    assert "in boom" in err.value.details  # the traceback is kept, out of the message


def test_a_process_that_dies_without_a_word_is_named_before_the_deadline() -> None:
    t0 = time.monotonic()
    with pytest.raises(ProcessesSilent) as err:
        run_processes([(twice, (1,)), (vanish, ())], 30, names=["rank 0", "rank 1"], **FAST)
    assert time.monotonic() - t0 < 15  # not the 30 s deadline
    assert isinstance(err.value, PeerTimeout) and err.value.names == ("rank 1",)
    assert "rank 1 (exit code 3) died without a word" in str(err.value)


def test_a_silent_process_is_named_at_the_deadline_and_killed() -> None:
    with pytest.raises(ProcessesSilent) as err:
        run_processes([(twice, (1,)), (hang, ())], 1.0, names=["rank 0", "rank 1"], **FAST)
    assert err.value.names == ("rank 1",) and "said nothing within 1 s" in str(err.value)


def test_no_process_imports_a_module_planted_in_the_working_directory(tmp_path, monkeypatch) -> None:
    """multiprocessing starts its children with `python -c`, which puts the working directory first,
    and they import multiprocessing before it sets their path: a planted one ran in every local rank
    (the second review of this stop). run_processes starts them with PYTHONSAFEPATH=1."""
    planted = tmp_path / "multiprocessing"
    planted.mkdir()
    marker = tmp_path / "planted-ran"
    (planted / "__init__.py").write_text(f"open({str(marker)!r}, 'a').write('ran')\nraise SystemExit(9)\n")
    monkeypatch.chdir(tmp_path)
    assert run_processes([(twice, (i,)) for i in range(2)], 60, method="spawn", grace=2.0) == [0, 2]
    assert not marker.exists() and "PYTHONSAFEPATH" not in os.environ  # and the launcher's own env as it was
