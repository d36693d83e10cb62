"""The supervisor of one Flower deployment: it owns the links and every Flower process.

The SuperLink (TLS, the hub's address) runs in the orchestrator's namespace, one SuperNode in
each holder's (cohort/links.py, netns-tc only), so the SuperNodes' traffic is all the capped links
carry. Nothing is left behind: children die with this process, ``close`` stops them, deleting
the namespaces kills the rest, and a SIGTERM unwinds into ``close``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from gputravel.processes import Children
from gputravel.cohort import stopping
from gputravel.cohort.isolation import die_with_parent
from gputravel.cohort.links import CohortLinks
from gputravel.errors import BadInput, RemoteError
from gputravel.fl.bundle import CONNECTION, write_app, write_cli_config, write_tls
from gputravel.net import LINK_NETNS, LinkError, netns_available
from gputravel.net.counters import LinkBytes, link_bytes
from gputravel.net.iproute import run_iproute
from gputravel.protocol.parties import ORCHESTRATOR

PORT = 9092  # the SuperLink's one HTTPS port (Fleet, Control and Runtime APIs), on the hub's address
BOOT_TIMEOUT_S = 60.0
_READY = "Application startup complete"


class FlowerDeployment:
    def __init__(self, holders: Mapping[str, str], bandwidth_mbit: float | None, directory: Path) -> None:
        ok, why = netns_available()
        if not ok:
            raise LinkError(f"the FL baseline runs Flower's processes in the links' network namespaces, but {why}")
        self.holders = dict(sorted(holders.items()))
        if not self.holders:
            raise BadInput("a Flower deployment needs at least one holder")
        self.links = CohortLinks(LINK_NETNS, tuple(self.holders), bandwidth_mbit)
        self.dir = directory
        self.children = Children(5)  # Flower's processes, each with its log
        self._undo_term: Callable[[], None] = lambda: None

    def __enter__(self) -> FlowerDeployment:
        # SIGTERM and SIGHUP unwind it into close(), as Ctrl-C does (cohort/stopping.py).
        self._undo_term = stopping.catch_term("the Flower deployment was taken down")
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.links.open()
        host = self.links.listen_host
        self.ca, cert, key = write_tls(self.dir / "tls", host)
        write_cli_config(self._home("cli"), f"{host}:{PORT}", self.ca)
        self._spawn(ORCHESTRATOR, "superlink", ["flower-superlink", "--ssl-ca-certfile", str(self.ca),
                                                "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                                                "--host", host, "--port", str(PORT), "--isolation", "subprocess",
                                                "--disable-runtime-dependency-installation"])
        self._await_log("superlink", _READY)
        for index, (name, data) in enumerate(self.holders.items()):
            node_config = f'holder="{name}" index={index} data="{data}"'
            self._spawn(name, name, ["flower-supernode", "--root-certificates", str(self.ca),
                                     "--superlink", f"{host}:{PORT}", "--isolation", "subprocess",
                                     "--node-config", node_config])

    def close(self) -> None:
        """Stop every process, then delete the namespaces, which kills what Flower started in them
        (LinkError if one is left); a second SIGTERM cannot cut this short."""
        try:
            with stopping.uninterrupted():
                self.children.close()
                self.links.close()
        finally:
            self._undo_term()
            self._undo_term = lambda: None

    def _home(self, who: str) -> Path:
        home = self.dir / "home" / who
        home.mkdir(parents=True, exist_ok=True)
        return home

    def _env(self, who: str) -> dict[str, str]:
        bindir = str(Path(sys.executable).parent)
        return {**os.environ, "FLWR_HOME": str(self._home(who)), "PATH": f"{bindir}:{os.environ.get('PATH', '')}",
                "PYTHONUNBUFFERED": "1"}

    def _argv(self, member: str, argv: list[str]) -> list[str]:
        return [*self.links.prefix(member), str(Path(sys.executable).parent / argv[0]), *argv[1:]]

    def _spawn(self, member: str, key: str, argv: list[str]) -> None:
        self.children.start(key, self._argv(member, argv), log=self.dir / f"{key}.log", env=self._env(key),
                            preexec_fn=die_with_parent, cwd=self.dir)

    def _await_log(self, key: str, line: str) -> None:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while line not in self.children.logs[key].read_text(errors="replace"):
            if self.children[key].poll() is not None:
                raise RemoteError(f"{key} exited while starting:{self.log_tail(key)}")
            if time.monotonic() > deadline:
                raise RemoteError(f"{key} did not start in {BOOT_TIMEOUT_S:g} s:{self.log_tail(key)}")
            time.sleep(0.1)

    def log_tail(self, key: str, lines: int = 15) -> str:
        try:
            text = self.children.logs[key].read_text(errors="replace").strip().splitlines()[-lines:]
        except (KeyError, OSError):
            return ""
        return ("\n  " + "\n  ".join(text)) if text else ""

    def _flwr(self, args: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
        """The Flower CLI from the orchestrator's namespace, and its JSON reply ({} if none)."""
        argv = self._argv(ORCHESTRATOR, ["flwr", *args, "--format", "json"])
        done = subprocess.run(argv, env=self._env("cli"), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, preexec_fn=die_with_parent, cwd=self.dir)
        try:
            return done, json.loads(done.stdout[done.stdout.index("{"):])
        except ValueError:
            return done, {}

    def submit(self, app_dir: Path, job_path: Path) -> str:
        """`flwr run`; the run's id."""
        write_app(app_dir)
        done, reply = self._flwr(["run", str(app_dir), CONNECTION, "--run-config", f'job="{job_path}"'], 120)
        if done.returncode != 0 or not reply.get("success"):
            why = reply.get("error-message") or done.stderr.strip() or done.stdout.strip()
            raise RemoteError(f"`flwr run` failed: {why}{self.log_tail('superlink')}")
        return str(reply["run-id"])

    def wait(self, status_path: Path, timeout_s: float, on_poll: Callable[[], None] | None = None) -> dict:
        """Until the ServerApp writes its status; RemoteError if the SuperLink dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        while not status_path.exists():
            if self.children["superlink"].poll() is not None:
                raise RemoteError(f"the SuperLink exited during the run:{self.log_tail('superlink')}")
            if time.monotonic() > deadline:
                raise RemoteError(f"the FedAvg run did not finish in {timeout_s:g} s:{self.log_tail('superlink')}")
            if on_poll is not None:
                on_poll()
            time.sleep(0.2)
        return json.loads(status_path.read_text())

    def runs(self) -> list[dict]:
        """`flwr ls`: Flower's own account of the runs (status, its traffic count, compute time)."""
        return self._flwr(["ls", CONNECTION], 60)[1].get("runs", [])

    def link_bytes(self) -> dict[str, LinkBytes]:
        assert self.links.shaped is not None
        return link_bytes(self.links.shaped)

    def drop(self, holder: str, mode: str) -> None:
        """A holder drops out now: crash kills its namespace's processes (no goodbye); leave stops its
        SuperNode, which tells the SuperLink."""
        if mode == "leave":
            self.children[holder].terminate()
            return
        assert self.links.shaped is not None
        ns = self.links.shaped.namespace(holder)
        for pid in run_iproute(["ip", "netns", "pids", ns]).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

