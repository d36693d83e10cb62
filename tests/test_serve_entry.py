"""The launcher's own entry into `gputravel serve` (service/serve.py `main`): the command's
behaviour without the command line's imports, which every service of every launch paid."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gputravel.service.launch import SERVE
from gputravel.service.serve import main


def test_a_service_started_by_the_launcher_imports_no_command_line_numpy_or_torch(processes) -> None:
    probe = ("import sys; from gputravel.service.serve import main; "
             "print(sorted(m for m in ('numpy', 'torch', 'typer', 'rich', 'gputravel.orchestrator.cvm') "
             "if m in sys.modules))")
    assert "gputravel.service.serve import main" in SERVE[1]
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_a_malformed_argv_is_refused_with_its_usage(capsys) -> None:
    for argv in ([], ["serve", "mallory", "--config", "x"], ["serve", "host", "--conf", "x"], ["host", "--config", "x"]):
        assert main(argv) == 2
    assert "usage: serve {host,gpu,holder,orchestrator,broker} --config FILE" in capsys.readouterr().err


def test_a_bad_config_ends_as_one_error_line_and_status_1(tmp_path: Path, capsys) -> None:
    assert main(["serve", "host", "--config", str(tmp_path / "missing.toml")]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("error: ") and "missing.toml" in out[0]


@pytest.mark.parametrize("text", ["[[[", "role = 'holder'\n"])
def test_a_config_that_is_not_a_hosts_is_refused_as_the_command_refuses_it(tmp_path: Path, capsys, text: str) -> None:
    path = tmp_path / "host.toml"
    path.write_text(text)
    assert main(["serve", "host", "--config", str(path)]) == 1
    assert capsys.readouterr().out.startswith("error: ")
