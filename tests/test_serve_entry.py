"""The launcher's own entry into `gputravel serve` (service/serve.py `main`): the command's
behaviour without the command line's imports, which every service of every launch paid."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gputravel.service.launch import SERVE
from gputravel.errors import BadInput, one_line
from gputravel.service.serve import main


def test_a_service_started_by_the_launcher_imports_no_command_line_numpy_or_torch(processes) -> None:
    probe = ("import sys; from gputravel.service.serve import main; "
             "print(sorted(m for m in ('numpy', 'torch', 'typer', 'rich', 'gputravel.orchestrator.cvm') "
             "if m in sys.modules))")
    assert SERVE[0] == "-P" and "gputravel.service.serve import main" in SERVE[2]
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


@pytest.mark.parametrize("exc", [BadInput("holder 'north': no such dataset"),
                                 OSError(18, "Invalid cross-device link", "/a/src", None, "/b/dst"),
                                 RecursionError("maximum recursion depth exceeded")],
                         ids=["typed", "path-pair", "recursion"])
def test_the_entry_ends_as_the_command_ends(monkeypatch, capsys, exc: BaseException) -> None:
    """The same one line and status as `gputravel serve` (cli/output.py Commands), for the same failure."""
    from typer.testing import CliRunner

    from gputravel.cli.app import app
    from gputravel.service import serve as serve_module

    def fails(role: str, path: Path) -> int:
        raise exc

    monkeypatch.setattr(serve_module, "serve", fails)
    assert main(["serve", "host", "--config", "/x.toml"]) == 1
    line = capsys.readouterr().out
    assert line == f"error: {one_line(exc)}\n"
    command = CliRunner().invoke(app, ["serve", "host", "--config", "/x.toml"])
    assert (command.exit_code, command.output) == (1, line)


def test_an_interrupt_ends_it_silently_with_130_and_a_bug_keeps_its_traceback(monkeypatch, capsys) -> None:
    from gputravel.service import serve as serve_module

    for exc in (KeyboardInterrupt(), RuntimeError("a bug"), OSError(5, "Input/output error")):
        def fails(role: str, path: Path, exc: BaseException = exc) -> int:
            raise exc

        monkeypatch.setattr(serve_module, "serve", fails)
        if isinstance(exc, KeyboardInterrupt):
            assert main(["serve", "gpu", "--config", "/x.toml"]) == 130
            assert capsys.readouterr() == ("", "")
        else:
            with pytest.raises(type(exc)):
                main(["serve", "gpu", "--config", "/x.toml"])


def test_a_commands_traceback_shows_no_locals(processes) -> None:
    """A bug keeps its traceback, but typer's pretty one printed every frame's locals by default (keys
    and holders' data among them, in a command that handles them): off in every command group."""
    code = ("import sys\nfrom gputravel.cli.app import app\nfrom gputravel.service import serve\n"
            "def boom(role, path):\n    secret_value = 'CANARY-5f3a'\n    raise RuntimeError('a bug')\n"
            "serve.serve = boom\nsys.argv = ['gputravel', 'serve', 'host', '--config', '/x.toml']\napp()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "RuntimeError" in done.stdout + done.stderr
    assert "CANARY-5f3a" not in done.stdout + done.stderr


def test_no_service_or_party_imports_a_module_planted_in_its_working_directory(processes, tmp_path: Path) -> None:
    """`python -c` and `-m` put the working directory first on sys.path: a numpy/ planted in the
    directory a launcher runs in would run as every party, as root's children too (the review of this stop)."""
    from gputravel.cohort.isolation import party_env

    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text("raise SystemExit('planted numpy imported')\n")
    probe = "import numpy; print('the real numpy')"
    for argv, env in (([sys.executable, SERVE[0], "-c", probe], None),
                      ([sys.executable, "-c", probe], party_env("holder"))):
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert done.stdout.strip() == "the real numpy", done.stderr


def test_a_peers_control_characters_are_shown_not_obeyed() -> None:
    """A typed error may carry a peer's words (a Failed reason, a log line, a path): an escape sequence
    in them is printed as text, never sent to the operator's terminal (the second review of this stop)."""
    assert one_line(BadInput("holder said \x1b[2J\x1b]0;pwned\x07 done\nnext\tline é")) == \
        "holder said \\x1b[2J\\x1b]0;pwned\\x07 done\nnext\tline é"
    assert one_line(OSError(2, "No such file", "/data/\x1b[31mred")) == "No such file: /data/\\x1b[31mred"
