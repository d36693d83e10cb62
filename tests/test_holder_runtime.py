"""The data holder's runtime (holder/cvm.py) against a real host loop and a stand-in
device: what it does with a context it cannot import, and with an orchestrator link that
carries garbage. Neither may take the holder process down or keep the GPU."""

from __future__ import annotations

import os
import selectors
import socket

import pytest

from gputravel.driver.link import PcieMuxClient, register_with_host
from gputravel.protocol.travel import TravelRefused, TravelRequest
from gputravel.holder.cvm import DataHolder, HolderConfig, _serve_orchestrator
from gputravel.holder.steps import Attest, Attested
from gputravel.protocol.parties import ORCHESTRATOR
from gputravel.testing import TEST_LAYOUT
from gputravel.transport.memory import memory_pair
from gputravel.transport.stream import HEADER, StreamTransport
from gputravel.transport.unix import connect_unix


@pytest.fixture
def alice(tmp_path, host_with_device):
    data = tmp_path / "alice.bin"
    data.write_bytes(os.urandom(4 * TEST_LAYOUT.record_bytes))
    holder = DataHolder.from_config(HolderConfig(name="alice", dataset_path=str(data), host_socket=host_with_device.socket_path,
                                     pki_dir=str(tmp_path), layout=TEST_LAYOUT, device_timeout=5))
    attested(holder, age_s=0, valid_s=1e9)  # no attestation in this test: there is no orchestrator CVM
    yield holder
    holder.driver.link.close()


def attested(holder: DataHolder, age_s: float, valid_s: float) -> None:
    """As if the holder had attested the orchestrator ``age_s`` ago, under a policy allowing ``valid_s``."""
    then = holder._clock() - age_s
    holder.sm.handle(Attest(joining=False), then)
    holder.sm.handle(Attested(valid_s), then)


@pytest.fixture
def orchestrator_mux(host_with_device):
    conn = connect_unix(host_with_device.socket_path, ORCHESTRATOR)
    link = register_with_host(conn, ORCHESTRATOR, TEST_LAYOUT)
    mux = PcieMuxClient(conn, ORCHESTRATOR)
    mux.switch(ORCHESTRATOR, timeout=5)
    yield mux
    link.close()


def test_a_context_that_will_not_import_is_refused_and_the_gpu_still_goes_home(alice, orchestrator_mux,
                                                                               host_with_device) -> None:
    ours, theirs = memory_pair("orchestrator", "alice")
    alice.orchestrator = theirs
    orchestrator_mux.request("alice")  # as a travel does: the request goes out while the MUX switches
    orchestrator_mux.switched(timeout=5)
    garbage = b"\x00not a context blob\xff" * 8
    alice.serve_travel(TravelRequest(1, 0, 2 * alice.piece_bytes, 0, garbage))
    reply = ours.recv(timeout=5).message
    assert isinstance(reply, TravelRefused) and reply.travel_id == 1
    assert reply.context == garbage  # handed back untouched
    assert "ContextBlobError" in reply.reason and "corrupted" in reply.reason
    assert orchestrator_mux.attached(timeout=5).target == ORCHESTRATOR  # and the GPU came home
    assert host_with_device.attached == [ORCHESTRATOR, "alice", ORCHESTRATOR]
    assert alice.sm.phase.value == "idle"  # ready for the next travel


def test_garbage_from_the_orchestrator_leaves_the_cohort_but_not_the_process(alice) -> None:
    raw, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    alice.orchestrator = StreamTransport(other, "orchestrator")
    sel = selectors.DefaultSelector()
    sel.register(alice.orchestrator.fileno(), selectors.EVENT_READ, "orchestrator")
    raw.sendall(HEADER.pack(4, 0) + b"\xc1\xc1\xc1\xc1")  # a frame whose payload is not a message
    assert _serve_orchestrator(alice, sel) is True  # the process goes on (it may be told to join again)
    assert alice.orchestrator is None and not sel.get_map()
    raw.close()


def test_a_travel_that_fails_on_the_holders_side_leaves_the_cohort_but_not_the_process(alice, monkeypatch) -> None:
    from gputravel.errors import ProtocolError
    from gputravel.protocol.codec import encode

    raw, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    alice.orchestrator = StreamTransport(other, "orchestrator")
    sel = selectors.DefaultSelector()
    sel.register(alice.orchestrator.fileno(), selectors.EVENT_READ, "orchestrator")

    def host_refuses(req):
        raise ProtocolError("host could not switch the GPU to orchestrator: no such CVM")

    monkeypatch.setattr(alice, "serve_travel", host_refuses)
    body = encode(TravelRequest(1, 0, 2 * alice.piece_bytes, 0, b"ctx"))
    raw.sendall(HEADER.pack(len(body), 0) + body)
    assert _serve_orchestrator(alice, sel) is True
    assert alice.orchestrator is None and not sel.get_map()
    raw.close()


def test_a_travel_past_the_attestation_age_limit_is_refused_before_the_context_is_touched(alice) -> None:
    """The orchestrator asks a holder to re-attest (AttestDue) with the GPU home, once half the
    holder's limit has passed. One that never asks gets no travel after the full limit: the
    holder leaves (its process goes on) without importing the context it was sent."""
    from gputravel.protocol.codec import encode

    raw, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    alice.orchestrator = StreamTransport(other, "orchestrator")
    sel = selectors.DefaultSelector()
    sel.register(alice.orchestrator.fileno(), selectors.EVENT_READ, "orchestrator")
    attested(alice, age_s=11, valid_s=10.0)
    body = encode(TravelRequest(1, 0, 2 * alice.piece_bytes, 0, b"ctx"))
    raw.sendall(HEADER.pack(len(body), 0) + body)
    assert _serve_orchestrator(alice, sel) is True
    assert alice.orchestrator is None and not sel.get_map() and alice.sm.phase.value == "idle"
    raw.close()


def test_no_baseline_chunk_leaves_past_the_attestation_age_limit(alice) -> None:
    """The TLS baseline sends plaintext to the orchestrator: only within the holder's age limit
    of its attestation, as a travel (review finding: SendChunk skipped the check)."""
    from gputravel.protocol.travel import SendChunk

    ours, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    alice.orchestrator = StreamTransport(other, "orchestrator")
    sel = selectors.DefaultSelector()
    sel.register(alice.orchestrator.fileno(), selectors.EVENT_READ, "orchestrator")
    attested(alice, age_s=11, valid_s=10.0)
    orch = StreamTransport(ours, "alice")
    orch.send(SendChunk(1, 0, alice.piece_bytes))
    assert _serve_orchestrator(alice, sel) is True
    assert alice.orchestrator is None and not sel.get_map()  # it left instead of sending
    ours.settimeout(1)
    assert ours.recv(1 << 20) == b""  # not one byte of the chunk: the link was closed
    ours.close()


# ============================================================================ the orchestrator's door
@pytest.mark.parametrize("named", ["h2", "h1"])
def test_a_hello_must_name_the_holder_of_the_tls_certificate(named: str) -> None:
    """h1, holding h1's certificate, cannot enrol as h2: the hello's name must be the
    certificate's (the listener reports the peer from the verified certificate)."""
    from types import SimpleNamespace

    from gputravel.errors import ProtocolError
    from gputravel.protocol.travel import Bye, HolderHello, Welcome
    from gputravel.orchestrator.machine import Buffer, OrchestratorTravel
    from gputravel.orchestrator.cvm import Orchestrator, OrchestratorConfig

    ours, theirs = memory_pair("orchestrator", "h1")
    config = OrchestratorConfig(host_socket="", pki_dir="", layout=TEST_LAYOUT, buffer_bytes=TEST_LAYOUT.record_bytes)
    # Only the door: the listener hands over our end of the pair as h1's; no device, host or TLS.
    orch = Orchestrator(config, host=None, driver=None, mux=None, device=None, log_key=b"",
                        listener=SimpleNamespace(accept=lambda timeout: (ours, "h1")))
    orch.attester = SimpleNamespace(serve_challenge=lambda conn, driver, timeout, now: None)
    orch.travel_sm = OrchestratorTravel(Buffer(0, 4096))
    theirs.send(HolderHello(named, 4096, 4096, (b"\x00" * 32,), "", "", 0, 0, True, bytes(32)))
    if named == "h1":
        assert orch.accept_holder(timeout=1) == "h1" and isinstance(theirs.recv(timeout=1).message, Welcome)
        return
    with pytest.raises(ProtocolError, match="did not introduce itself"):
        orch.accept_holder(timeout=1)
    assert isinstance(theirs.recv(timeout=1).message, Bye)
    assert orch.holders == {} and orch.travel_sm.holders == {}


# ============================================================================ untrusted inputs to the host and device
def test_the_host_outlives_a_cvm_that_hangs_up_before_its_answer(host_with_device) -> None:
    from gputravel.protocol.host import SwitchRequest

    for _ in range(2):  # an error answer (unknown CVM) to a peer that already left, twice
        gone = connect_unix(host_with_device.socket_path, "gone")
        gone.send(SwitchRequest(target="nobody"))
        gone.close()
    conn = connect_unix(host_with_device.socket_path, ORCHESTRATOR)  # the host still serves
    link = register_with_host(conn, ORCHESTRATOR, TEST_LAYOUT)
    try:
        assert PcieMuxClient(conn, ORCHESTRATOR).switch(ORCHESTRATOR, timeout=5).target == ORCHESTRATOR
    finally:
        link.close()


def test_a_holder_push_with_an_out_of_range_release_faults_its_channel_not_the_device() -> None:
    """A holder has the user keys during its travel, so what it pushes is input: a release
    value that cannot be a semaphore value faults the channel; the device goes on."""
    from gputravel.protocol.layout import PushChannel
    from gputravel.protocol.push import SemaphoreRelease
    from gputravel.testing import InProcessGpu

    gpu = InProcessGpu()
    orch, holders = gpu.boot("alice")
    gpu.switch("alice")
    alice = holders["alice"]
    alice.import_context(orch.export_for_travel())
    alice.submit(PushChannel.USER, SemaphoreRelease(release=-1, interrupt=False))
    assert alice.faulted(PushChannel.USER) and "out of range" in gpu.core.stats.faults[-1]
    gpu.switch(ORCHESTRATOR)
    orch.import_returned(alice.export_context())
    orch.rotate()  # the rotation resets the faulted channel, as for any bad push
    assert not orch.faulted(PushChannel.USER)
