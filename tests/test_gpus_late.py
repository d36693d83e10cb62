"""Issue 14 with changing membership (paper 4.5 on several GPUs): a late holder is placed in one
share and enrolled at boot on that GPU's cohort only, so it joins, leaves, rejoins and restarts
there and nowhere else: a holder serves one GPU by construction, and each chunk of each holder
reaches exactly one rank, once."""

from __future__ import annotations

import os
import ssl
import threading
from pathlib import Path

import pytest

from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.gpus import GpuCohorts, place_late
from gputravel.crypto.pki import CohortPki
from gputravel.errors import BadInput, ProtocolError, RemoteError, TransportClosed
from gputravel.orchestrator.audit.entries import AuditEvent
from gputravel.orchestrator.audit.verify import verify_log
from gputravel.holder.log_key import read_log_key
from gputravel.protocol.manifest import chunk_digest, chunk_mac
from gputravel.protocol.parties import ORCHESTRATOR
from gputravel.train.schedule import partition
from gputravel.transport.tls import TlsListener, connect_tls

MIB = 1 << 20
# alice and bob boot; carol and dave join late. dave's first run dies half-way through a copy.
SIZES = {"alice": 2 * MIB, "bob": MIB, "carol": 2 * MIB, "dave": MIB}
LATE = ("carol", "dave")


@pytest.fixture
def datasets(tmp_path: Path) -> dict[str, tuple[str, bytes]]:
    out = {}
    for name, size in SIZES.items():
        data = os.urandom(size)
        (tmp_path / f"{name}.bin").write_bytes(data)
        out[name] = (str(tmp_path / f"{name}.bin"), data)
    return out


def base(datasets) -> CohortConfig:
    spec = lambda n: HolderSpec(n, datasets[n][0], die_mid_copy_on_travel=int(n == "dave"))  # noqa: E731
    return CohortConfig(holders=tuple(spec(n) for n in SIZES if n not in LATE),
                        late_holders=tuple(spec(n) for n in LATE), buffer_bytes=MIB)


def test_the_shares_place_every_late_holder_once_beside_one_present_at_boot(datasets) -> None:
    cfg = base(datasets)
    for shares, why in [((("alice", "carol", "dave"), ("bob", "carol")), "carol in several shares"),
                        ((("alice", "dave"), ("bob",)), r"missing \['carol'\]"),
                        ((("alice", "bob"), ("carol", "dave")), "GPU 1's share has only late holders")]:
        with pytest.raises(BadInput, match=why):
            GpuCohorts(cfg, shares)
    # Late holders go where the fewest bytes are, largest first: carol (2 MiB) to bob's GPU.
    shares = place_late(partition({n: SIZES[n] for n in ("alice", "bob")}, 2), SIZES, LATE)
    assert shares == (("alice", "dave"), ("bob", "carol"))
    assert [GpuCohorts(cfg, shares).gpu_of(n) for n in SIZES] == [0, 1, 1, 0]
    for late, why in [(("alice",), "already in one"), (("carol", "carol"), "once"), (("erin",), "erin")]:
        with pytest.raises(BadInput, match=why):
            place_late((("alice",), ("bob",)), SIZES, late)


@pytest.mark.integration
def test_late_holders_join_leave_rejoin_and_restart_on_their_own_gpu_each_chunk_once(processes, datasets) -> None:
    shares = (("alice", "dave"), ("bob", "carol"))
    delivered: list[tuple[int, str, int]] = []

    def travel(holder: str, offset: int) -> None:
        k = gpus.gpu_of(holder)
        report = gpus.cohorts[k].travel(holder, offset)
        assert report.refused is None and report.chunk is not None
        assert report.chunk.digest == chunk_digest(datasets[holder][1][offset:offset + MIB])
        delivered.append((k, holder, offset))

    with GpuCohorts(base(datasets), shares) as gpus:
        first, second = gpus.cohorts
        assert [[h.name for h in c.config.late_holders] for c in gpus.cohorts] == [["dave"], ["carol"]]
        travel("alice", 0)
        travel("bob", 0)
        # A late holder of GPU 0 is unknown to GPU 1: no enrolment, no policy, refused there.
        for command in (second.add_holder, second.restart_holder):
            with pytest.raises(BadInput, match="'dave' is not a"):
                command("dave")
        assert not (second.dir / "pki" / "dave").exists() and not second.trust.holder_dir("dave").exists()
        # carol joins GPU 1 late (probe on the lent GPU, then attestation) and travels there.
        assert gpus.add_holder("carol") == 2 * MIB
        assert second.attestations["carol"].measurement == second.trust.pinned[0]
        travel("carol", 0)
        # alice leaves GPU 0, is offline there, rejoins with fresh attestation and travels again.
        gpus.leave("alice", reason="back after lunch")
        with pytest.raises(RemoteError, match="offline"):
            first.travel("alice", MIB)
        travel("carol", MIB)  # GPU 1 goes on meanwhile
        assert gpus.rejoin("alice") == 2 * MIB
        travel("alice", MIB)
        # dave joins GPU 0 late, dies mid-copy (nothing delivered), restarts there and travels.
        assert gpus.add_holder("dave") == MIB
        with pytest.raises(RemoteError, match="dave"):
            first.travel("dave", 0)
        assert first.children["dave"].proc.wait(timeout=10) == 70
        with pytest.raises(BadInput):  # GPU 1 never started dave: it has nothing to restart
            second.restart_holder("dave")
        assert gpus.restart_holder("dave") == MIB
        travel("dave", 0)
        assert set(first.dataset_bytes) == {"alice", "dave"} and set(second.dataset_bytes) == {"bob", "carol"}

        # Every chunk of every holder exactly once, each on its holder's GPU ...
        want = sorted((h, o) for h, size in SIZES.items() for o in range(0, size, MIB))
        assert sorted((h, o) for _, h, o in delivered) == want
        assert all(k == gpus.gpu_of(h) for k, h, _ in delivered)
        # ... and so say the two orchestrators' signed travel logs, digests included (each
        # keyed with its holder's travel-log key, from that holder's own pki directory).
        logged = []
        for k, cohort in enumerate(gpus.cohorts):
            for e in verify_log(cohort.audit_log_path, cohort.orchestrator_certificate()).entries:
                assert gpus.gpu_of(e.chunk.holder) == k
                if e.event == AuditEvent.TRAVEL:
                    data, c = datasets[e.chunk.holder][1], e.chunk
                    key = read_log_key(cohort.dir / "pki" / c.holder)
                    assert e.chunk_mac == chunk_mac(key, e.job, c.holder, c.dataset_offset, c.nbytes,
                                                    chunk_digest(data[c.dataset_offset:c.dataset_offset + MIB]))
                    logged.append((e.chunk.holder, e.chunk.dataset_offset))
        assert sorted(logged) == want

        _refused_by_the_other_gpus_orchestrator(first.dir, second.dir)


def _refused_by_the_other_gpus_orchestrator(gpu0: Path, gpu1: Path) -> None:
    """Red team: dave's certificate, from GPU 0's cohort CA, presented to a listener built as
    GPU 1's orchestrator builds its own (orchestrator/cvm.py: its cohort PKI's server context)
    by a client that trusts GPU 1's CA: the handshake is refused. bob, GPU 1's own, gets in."""
    orchestrator = CohortPki.load(gpu1 / "pki" / ORCHESTRATOR)
    assert orchestrator.ca_pem != (gpu0 / "pki" / ORCHESTRATOR / "ca.pem").read_bytes()  # one CA per GPU
    dave = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    dave.minimum_version = ssl.TLSVersion.TLSv1_3
    dave.load_verify_locations(cadata=orchestrator.ca_pem.decode("ascii"))  # it trusts GPU 1's orchestrator...
    dave.load_cert_chain(gpu0 / "pki" / "dave" / "dave.pem", gpu0 / "pki" / "dave" / "dave.key")  # ...with GPU 0's
    with TlsListener("127.0.0.1", 0, orchestrator.server_context(ORCHESTRATOR)) as listener:
        seen: dict[str, object] = {}

        def client() -> None:
            try:
                seen["recv"] = connect_tls("127.0.0.1", listener.port, dave, ORCHESTRATOR, timeout=5).recv(timeout=5)
            except Exception as exc:  # noqa: BLE001 - recorded for the assertion
                seen["error"] = exc

        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        with pytest.raises(ProtocolError, match=r"(?i)certificate"):
            listener.accept(timeout=5)
        thread.join(5)
        assert isinstance(seen.get("error"), (ProtocolError, TransportClosed)), seen

        bob = CohortPki.load(gpu1 / "pki" / "bob").client_context("bob")
        thread = threading.Thread(target=lambda: seen.update(
            bob=connect_tls("127.0.0.1", listener.port, bob, ORCHESTRATOR, timeout=5)), daemon=True)
        thread.start()
        conn, cn = listener.accept(timeout=5)
        thread.join(5)
        assert cn == "bob"
        conn.close()
        seen["bob"].close()
