"""The emulated TDX module as its own process (firmware/tdx_module.py, cohort/quoting.py).

red team: orchestrator-self-quote. The review found the measurement self-quoted: the quoting
key sat in the orchestrator's trust directory and the measurement was whatever the caller
passed. Here the module makes its own key, the launcher certifies it and registers the one
CVM it launched (pid, uid, measurement); whoever else asks, or asks for a measurement, gets
no quote."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import msgpack
import pytest

from gputravel.attest import Authority, EmulatedQuoteVerifier, TrustStore
from gputravel.attest.roots import TEE_QUOTING_ROOT_CN
from gputravel.firmware.tdx_module import Launch, Peer, QuotingRefused, TdxModule, request_quote
from gputravel.crypto.certs import new_key as _new_key
from gputravel.errors import ProtocolError, TransportClosed
from gputravel.protocol.control import Ready
from gputravel.cohort.quoting import QuotingLaunch
from gputravel.cohort.trust import CohortTrust
from gputravel.transport.stream import HEADER, StreamTransport
from gputravel.transport.unix import connect_unix

MEASURED = bytes(range(48))  # what the launcher measured
# A CVM stand-in: asks the module for a quote over the report data it is given, prints the outcome.
CVM = ("import sys\nfrom gputravel.firmware.tdx_module import request_quote, QuotingRefused\n"
       "try:\n    print(request_quote(sys.argv[1], bytes.fromhex(sys.argv[2]), 30).hex())\n"
       "except QuotingRefused as e:\n    print('refused:', e)\n")


class Module:
    """A TDX module process, with this test as its launcher."""

    def __init__(self, tmp_path: Path, hold_s: float = 30.0) -> None:
        self.socket = str(tmp_path / "quote.sock")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        config = json.dumps({"socket_path": self.socket, "hold_s": hold_s})
        self.proc = subprocess.Popen([sys.executable, "-m", "gputravel.cohort.entry", "tdx-module", config,
                                      str(theirs.fileno())], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self.control = StreamTransport(ours, "tdx-module")
        assert isinstance(self.control.recv(timeout=30).message, Ready)
        self.root = Authority.self_signed(TEE_QUOTING_ROOT_CN)
        trust = CohortTrust(tmp_path, "GPU", "driver", tee_root=self.root)
        # The launcher certifies the key the module made, and drops the root key.
        assert QuotingLaunch.certify(self.control, trust, timeout=10).tee_root is None
        self.verifier = EmulatedQuoteVerifier(TrustStore((), (self.root.cert_der,)), [MEASURED])

    def register(self, pid: int, uid: int | None = None) -> None:
        QuotingLaunch.register(self.control, pid, uid, MEASURED, timeout=10)

    def cvm(self) -> tuple[subprocess.Popen, bytes]:
        report_data = os.urandom(64)
        proc = subprocess.Popen([sys.executable, "-c", CVM, self.socket, report_data.hex()], stdout=subprocess.PIPE,
                                text=True)
        return proc, report_data

    def close(self) -> None:
        self.control.close()  # the launcher is gone: so is the module
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def module(tmp_path):
    m = Module(tmp_path)
    yield m
    m.close()


def _output(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=60)
    return out.strip()


def test_the_launched_cvm_is_quoted_with_the_measurement_its_launcher_registered(processes, module) -> None:
    cvm, report_data = module.cvm()  # it asks at once: the module holds the request ...
    module.register(cvm.pid)  # ... until the launcher names it
    quote = bytes.fromhex(_output(cvm))
    claims = module.verifier.verify(quote, report_data, datetime.now(timezone.utc))
    assert claims.measurement == MEASURED and claims.report_data == report_data


def test_orchestrator_self_quote_nobody_but_the_launched_cvm_is_quoted(processes, module) -> None:
    launched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        module.register(launched.pid)
        # This process (another pid) asks: refused at once, a launch being registered.
        with pytest.raises(QuotingRefused, match="not the CVM this module launched"):
            request_quote(module.socket, os.urandom(64), timeout=10)
        probe, _ = module.cvm()  # another process, same uid
        assert _output(probe).startswith("refused:")
        # Asking for a measurement of one's own: the request has no such field, so the
        # module reads garbage and hangs up without a quote.
        conn = connect_unix(module.socket, "probe")
        payload = msgpack.packb({"t": "attest.tdx.quote_request",
                                 "f": {"report_data": os.urandom(64), "mr_td": MEASURED}}, use_bin_type=True)
        os.write(conn.fileno(), HEADER.pack(len(payload), 0) + payload)
        with pytest.raises(TransportClosed):
            conn.recv(timeout=10)
        conn.close()
    finally:
        launched.kill()
        launched.wait()


def test_orchestrator_self_quote_the_launched_pid_under_another_uid_is_refused(processes, module) -> None:
    cvm, _ = module.cvm()
    module.register(cvm.pid, uid=os.geteuid() + 4242)  # the launcher started its CVM under another uid
    assert "uid" in _output(cvm)


def test_a_request_before_any_launch_is_held_then_refused(processes, tmp_path) -> None:
    module = Module(tmp_path, hold_s=0.5)
    try:
        with pytest.raises(QuotingRefused, match="no CVM launch was registered in time"):
            request_quote(module.socket, os.urandom(64), timeout=10)
    finally:
        module.close()


def test_the_core_quotes_one_launch_and_only_for_a_living_cvm() -> None:
    root = Authority.self_signed(TEE_QUOTING_ROOT_CN)
    core = TdxModule()
    with pytest.raises(ProtocolError):  # a certificate for another key
        core.certified((root.issue("q", _new_key().public_key(), is_ca=False), root.cert_der))
    assert core.decide(Peer(10, 0, 500), os.urandom(64)) is None  # not ready: held
    core.certified((root.issue("q", core.key.public_key(), is_ca=False), root.cert_der))
    core.register(Launch(10, 0, MEASURED, 500))
    with pytest.raises(ProtocolError, match="one CVM per module"):
        core.register(Launch(11, 0, MEASURED, 600))
    assert core.decide(Peer(10, 0, 500), os.urandom(64))
    with pytest.raises(QuotingRefused):
        core.decide(Peer(10, 0, 500), os.urandom(63))
    # The launched pid, but another process: one that connected before the launch and held
    # the connection while its pid went to the orchestrator (review finding), or one gone.
    for other in (Peer(10, 0, 499), Peer(10, 0, None)):
        with pytest.raises(QuotingRefused, match="another process"):
            core.decide(other, os.urandom(64))
    core.ended = True  # its process exited (a pidfd said so): its pid may be someone else's now
    with pytest.raises(QuotingRefused, match="ended"):
        core.decide(Peer(10, 0, 500), os.urandom(64))


def test_a_connection_made_before_the_launch_gets_no_quote_once_its_pid_is_reused(processes, tmp_path) -> None:
    """The attack the review found: a child connects and exits, its parent keeps the connected
    socket, and the child's pid later goes to the orchestrator. The kernel's pidfd of whoever
    connected (SO_PEERPIDFD) says that process exited, and its start time is gone with it."""
    from gputravel.firmware.tdx_module import _exited, process_start

    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "q.sock"))
    listener.listen(1)
    held = socket.socket(socket.AF_UNIX)
    pid = os.fork()
    if pid == 0:  # the child connects the socket it shares with its parent, then exits
        held.connect(str(tmp_path / "q.sock"))
        os._exit(0)
    os.waitpid(pid, 0)
    accepted, _ = listener.accept()
    assert _exited(accepted)
    assert process_start(pid) is None
    live = socket.socket(socket.AF_UNIX)
    live.connect(str(tmp_path / "q.sock"))
    accepted2, _ = listener.accept()
    assert not _exited(accepted2) and process_start(os.getpid()) is not None
    for sock in (listener, held, accepted, live, accepted2):
        sock.close()


def test_once_the_launched_cvm_has_ended_nobody_is_quoted(processes, module) -> None:
    """The module holds a pidfd of the launched process: when it exits, its pid (which the
    kernel may hand to anyone next) is quoted no more."""
    cvm, _ = module.cvm()
    module.register(cvm.pid)
    assert not _output(cvm).startswith("refused")  # quoted while it lived
    cvm.wait()
    with pytest.raises(QuotingRefused, match="has ended"):
        request_quote(module.socket, os.urandom(64), timeout=10)
