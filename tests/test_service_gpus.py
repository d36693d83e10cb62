"""Several GPUs on the deployed services (`cohort init --gpus N`, issue 26): one stack per GPU
(its host route, the GPU, rank K's orchestrator with its TDX module), each holder in exactly
one GPU's share, bound by the registry, and the ranks attesting one another before any
gradient moves, as the supervisor's ranks do (cohort/gpus.py).
"""

from __future__ import annotations

import json
import os
import signal
import tomllib
from pathlib import Path

import pytest
import tomli_w

from gputravel.attest.roots import TEE_ROOT_KEY
from gputravel.errors import BadInput, RemoteError
from gputravel.jobs.training import default_holders
from gputravel.orchestrator.audit import verify_log
from gputravel.service import launch as service_launch
from gputravel.service.config import GpuService, HolderService, HostService, OrchestratorService, load_service
from gputravel.service.init import init_cohort
from gputravel.service.launch import ServiceLaunch
from gputravel.service.registry import bind
from gputravel.service.status import cohort_status, party_name
from gputravel.train.job import TrainConfig
from gputravel.train.rundir import checkpoint_extra

# 3 windows a visit (a 4 KiB buffer holds 2048 tokens, a batch 513): every holder is visited in 8 steps
TINY = TrainConfig(steps=8, batch=8, seq_len=64, buffer_bytes=4096, n_layer=1, n_head=2, n_embd=32,
                   threads=1, sample_tokens=0, warmup_steps=2)


@pytest.fixture
def cohort(searchable_tmp: Path, tmp_path: Path) -> Path:
    os.chmod(tmp_path, 0o755)  # as root, init refuses a directory the parties' accounts cannot reach
    data = tmp_path / "data"
    data.mkdir()
    for name, size in (("north", 4000), ("south", 3000), ("east", 2000)):
        (data / f"{name}.txt").write_text("x" * size)
    init_cohort(tmp_path / "D", [(n, str(data / f"{n}.txt")) for n in ("north", "south", "east")], gpus=2,
                steps=3, buffer_bytes=4096)
    return tmp_path / "D"


def _rewrite(src: Path, dest: Path, **changes: object) -> Path:
    doc = tomllib.loads(src.read_text())
    doc.update(changes)
    dest.write_text(tomli_w.dumps(doc))
    return dest


def test_init_makes_a_stack_per_gpu_and_deals_each_holder_to_one(cohort: Path) -> None:
    ranks = [load_service(cohort / f) for f in ("orchestrator.toml", "orchestrator-1.toml")]
    assert all(isinstance(o, OrchestratorService) for o in ranks)
    shares = ranks[0].shares
    # partition: largest first, each to the GPU with the fewest bytes so far
    assert shares == ranks[1].shares == [["north"], ["east", "south"]]
    for k, orch in enumerate(ranks):
        assert isinstance(orch, OrchestratorService)
        assert (orch.rank, orch.world_size, sorted(orch.holders)) == (k, 2, sorted(shares[k]))
        host = load_service(cohort / ("host.toml" if k == 0 else f"host-{k}.toml"))
        gpu = load_service(cohort / f"gpu-{k}.toml")
        assert isinstance(host, HostService) and isinstance(gpu, GpuService)
        assert orch.host_socket == host.socket == gpu.host_socket and host.index == gpu.index == k
        assert orch.gpu_link_socket == gpu.link_socket and gpu.orchestrator_uid == orch.uid
        assert (cohort / ("platform" if k == 0 else f"platform-{k}") / TEE_ROOT_KEY).exists()  # its TDX module's
    assert ranks[0].ranks_port == ranks[1].ranks_port and ranks[0].ranks_context == ranks[1].ranks_context
    assert ranks[0].job.run_dir != ranks[1].job.run_dir and ranks[0].listen_port != ranks[1].listen_port
    for name in ("north", "south", "east"):
        holder = load_service(cohort / f"holder-{name}.toml")
        assert isinstance(holder, HolderService)
        k = next(k for k, share in enumerate(shares) if name in share)
        orch = ranks[k]
        assert holder.orchestrator == party_name(orch) and holder.orchestrator_port == orch.listen_port
        assert (holder.host_socket, holder.boot_lock) == (orch.host_socket, orch.boot_lock)
        assert holder.policy.orchestrator_measurements == load_service(cohort / "holder-north.toml").policy.orchestrator_measurements  # type: ignore[union-attr]


@pytest.mark.parametrize("file, changes, key", [
    # a holder told to serve the other GPU: its orchestrator, its host route and lock are bound
    ("holder-north.toml", {"orchestrator": "orchestrator-1"}, "orchestrator"),
    ("holder-north.toml", {"boot_lock": "GPU1"}, "boot_lock"),
    # an orchestrator told other shares (a holder moved, or in both): the shares are fixed
    ("orchestrator-1.toml", {"shares": [["north", "south"], ["east"]], "holders": ["east"]}, "shares"),
    ("orchestrator.toml", {"shares": [["north", "east"], ["south"]], "holders": ["north", "east"]}, "shares"),
])
def test_a_party_moved_to_another_gpu_is_refused_by_the_registry(cohort: Path, tmp_path: Path, file: str,
                                                                 changes: dict, key: str) -> None:
    if changes.get("boot_lock") == "GPU1":
        changes = {"boot_lock": str(cohort / "run" / "gpu-1.lock")}
    cfg = load_service(_rewrite(cohort / file, tmp_path / file, **changes))
    with pytest.raises(BadInput, match=f"{key}: expected"):
        bind(cfg, party_name(cfg))


@pytest.mark.parametrize("changes, says", [
    ({"holders": ["north", "east"]}, "holders: expected this rank's share"),
    ({"shares": [["north", "east"], ["east", "south"]]}, "a holder in one share only"),
    ({"shares": [["north", "east", "south"]]}, "one share for each of 2 or more ranks"),
    ({"ranks_context": ""}, "ranks_port: expected rank 0's port and a ranks_context"),
])
def test_an_orchestrator_serves_its_own_share_only(cohort: Path, tmp_path: Path, changes: dict, says: str) -> None:
    with pytest.raises(BadInput, match=says):
        load_service(_rewrite(cohort / "orchestrator-1.toml", tmp_path / "o.toml", **changes))


@pytest.mark.parametrize("planted", ["symlink", "hardlink"])
def test_status_reads_no_other_partys_state_through_a_link_planted_in_its_own(cohort: Path, planted: str) -> None:
    """`gputravel status` runs as root: a holder's operator who left, as its own status.json, a
    link to rank 1's private status (its loss), or to any JSON file root reads, had status print
    that file (the hostile review of --gpus). A link, or a file of another's, is not read."""
    private = cohort / "state" / "orchestrator-1" / "status.json"
    private.write_text(json.dumps({"phase": "training", "loss": 1.2345, "rank_1_private": True}))
    os.chmod(private, 0o600)
    planted_at = cohort / "state" / "holder-north" / "status.json"
    os.symlink(private, planted_at) if planted == "symlink" else os.link(private, planted_at)
    out = cohort_status(load_service(cohort / "holder-north.toml"))
    assert "rank_1_private" not in out and "loss" not in out
    assert out["status_file"].startswith(f"not read: {planted_at}")
    planted_at.unlink()  # its own file, as its service writes it, is read
    planted_at.write_text(json.dumps({"phase": "admitting"}))
    assert cohort_status(load_service(cohort / "holder-north.toml"))["phase"] == "admitting"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: status runs as root and reads as the holder's account")
def test_status_checks_a_holders_chunks_only_against_data_its_own_account_reads(cohort: Path, tmp_path: Path) -> None:
    """The review of --gpus: status, as root, opened whatever `data` a holder's config named (the
    registry does not bind it), so a holder's operator learned the size of another holder's
    dataset and whether chunks of it equal its own. It now opens the data as the holder's account."""
    from types import SimpleNamespace

    from gputravel.holder.log_key import own_log_key
    from gputravel.service import status
    from gputravel.service.party import as_party, own_state, private_dir

    cfg = load_service(cohort / "holder-north.toml")
    assert isinstance(cfg, HolderService) and cfg.uid > 0
    state = own_state(private_dir(cfg.state_dir), cfg.uid)
    with as_party(cfg.uid):
        own_log_key(private_dir(state / "pki"))  # its key is there and its own: only the data is refused
    theirs = tmp_path / "another-holders-data.txt"
    theirs.write_text("y" * 5000)
    os.chmod(theirs, 0o600)  # root's: not the holder's to read
    travel = SimpleNamespace(chunk_mac=b"\x01" * 32, chunk=None)
    out = status._my_chunks(cfg.model_copy(update={"data": str(theirs)}), [travel])  # type: ignore[list-item]
    assert out["my_chunks"].startswith("not checked") and "Permission denied" in out["my_chunks"], out


def test_a_ranks_platform_key_is_deleted_even_when_its_service_died_after_certifying(processes, cohort: Path,
                                                                                     monkeypatch) -> None:
    """Rank 1's service killed between its TDX module keeping the certified chain and deleting
    platform-1's CPU-TEE root key: every later start found the module certified and never
    reached the deletion, so the root key stayed on disk (the hostile review of --gpus)."""
    from gputravel.service import members
    from gputravel.service.party import own_state, private_dir
    from gputravel.service.registry import platform_dir

    cfg = load_service(cohort / "orchestrator-1.toml")
    assert isinstance(cfg, OrchestratorService)
    state, platform = own_state(private_dir(cfg.state_dir), cfg.uid), platform_dir(Path(cfg.cohort_dir), cfg.rank)
    certify = members.QuotingLaunch.certify

    def killed_after(*args: object, **kwargs: object) -> None:
        certify(*args, **kwargs)  # type: ignore[arg-type]
        raise KeyboardInterrupt("killed before the unlink")

    monkeypatch.setattr(members.QuotingLaunch, "certify", staticmethod(killed_after))
    with pytest.raises(KeyboardInterrupt):
        members._start_tdx_module(cfg, state, platform)
    assert (platform / TEE_ROOT_KEY).exists()
    monkeypatch.setattr(members.QuotingLaunch, "certify", staticmethod(certify))
    tdx, _ = members._start_tdx_module(cfg, state, platform)  # certified by the chain it kept
    try:
        assert not (platform / TEE_ROOT_KEY).exists()
        assert (cohort / "platform" / TEE_ROOT_KEY).exists()  # rank 0's copy is rank 0's to use
    finally:
        tdx.close()


def _holders(tmp_path: Path) -> tuple[tuple[str, str], ...]:
    os.chmod(tmp_path, 0o755)  # the parties run under uids of their own when the suite is root
    return default_holders(4, tmp_path)


def test_two_gpus_train_on_the_services_each_holder_travelling_to_one_gpu(processes, searchable_tmp: Path,
                                                                         tmp_path: Path) -> None:
    hs = _holders(tmp_path)
    run = tmp_path / "run"
    logs = [(run / f"gpu-{k}-audit.log", run / f"gpu-{k}-orchestrator.pem") for k in range(2)]
    steps: list[int] = []
    with ServiceLaunch(hs, TINY.to_dict(), run, audit_log=logs[0][0], certificate=logs[0][1], gpus=2,
                       rank_audit=logs) as launch:
        report = launch.train(lambda row: steps.append(row["step"]))
        cohort = launch.cohort
        shares = load_service(cohort / "orchestrator.toml").shares  # type: ignore[union-attr]
        # Each rank's TDX module was certified by its own copy of the platform's key, then it went.
        assert not any((cohort / d / TEE_ROOT_KEY).exists() for d in ("platform", "platform-1"))
        rank_reports = launch.rank_reports
        said = {k: [json.loads(line) for line in (launch.dir / "logs" / f"{p}.log").read_text().splitlines()  # type: ignore[operator]
                    if line.startswith("{")] for k, p in enumerate(("orchestrator", "orchestrator-1"))}
        isolation = launch.isolation()
    assert steps == list(range(TINY.steps)) and len(report["losses"]) == TINY.steps
    assert [len(r["losses"]) for r in rank_reports] == [TINY.steps] * 2
    for k in range(2):  # every rank was up as rank k of 2 and trained the whole job
        up = next(e for e in said[k] if e["event"] == "up")
        assert (up["rank"], up["world_size"]) == (k, 2)
        assert any(e["event"] == "trained" for e in said[k])
    assert sorted(n for s in shares for n in s) == sorted(n for n, _ in hs) and all(shares)
    travelled: dict[str, set[int]] = {}
    for k, (log, cert) in enumerate(logs):  # both ranks' signed logs verify, each naming its own GPU
        summary = verify_log(log, cert.read_bytes())
        assert summary.closed and summary.gpu == f"GPU-EMU-{k}" and summary.entries
        for entry in summary.entries:
            travelled.setdefault(entry.holder, set()).add(k)
            assert entry.holder in shares[k]
    assert all(len(gpus) == 1 for gpus in travelled.values()), travelled  # a holder served one GPU
    assert set(travelled) == {n for n, _ in hs}  # and every holder served one
    if os.geteuid() == 0:  # every party, each rank's included, under its own account
        assert isolation["on"] and {"orchestrator", "orchestrator-1", "host-1", "gpu-1"} <= set(isolation["parties"])
    assert launch.dir is None


def test_a_rank_stopped_with_sigterm_stops_every_rank_at_one_step_checkpointed_there(processes, searchable_tmp: Path,
                                                                                   tmp_path: Path) -> None:
    """Rank 1's service alone is stopped (SIGTERM) mid-job: it does not train on until killed, nor stop
    alone and leave rank 0 waiting; both ranks stop at the same step and rank 0 checkpoints there."""
    hs = _holders(tmp_path)
    run = tmp_path / "run"
    logs = [(run / f"gpu-{k}-audit.log", run / f"gpu-{k}-orchestrator.pem") for k in range(2)]
    sent: list[int] = []

    def stop_rank_1(row: dict) -> None:
        if row["step"] >= 3 and not sent:
            launch.children["orchestrator-1"].send_signal(signal.SIGTERM)
            sent.append(row["step"])

    with ServiceLaunch(hs, TINY.replace(steps=100_000).to_dict(), run, audit_log=logs[0][0],
                       certificate=logs[0][1], gpus=2, rank_audit=logs) as launch:
        with pytest.raises(RemoteError, match=r"exit 0"):  # stopped, so no report: not done
            launch.train(stop_rank_1)
        said = {k: [json.loads(line) for line in (launch.dir / "logs" / f"{p}.log").read_text().splitlines()  # type: ignore[operator]
                    if line.startswith("{")] for k, p in enumerate(("orchestrator", "orchestrator-1"))}
        stopped = [next(e for e in said[k] if e["event"] == "stopped") for k in range(2)]
        checkpointed = len(checkpoint_extra(Path(stopped[0]["checkpoint"]))["losses"])
    assert [e["why"] for e in stopped] == ["another rank was stopped", "signal"]
    assert stopped[0]["step"] == stopped[1]["step"] == checkpointed > sent[0]


def test_ranks_told_different_jobs_refuse_each_other_before_any_step(processes, searchable_tmp: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's operator changes the ranks' context (not bound by the registry, but bound into
    the ranks' quotes): the ranks refuse each other's attestation and no step is trained."""
    hs = _holders(tmp_path)
    real = service_launch.init_cohort

    def init_then_edit(directory: Path, *args: object, **kwargs: object) -> list[Path]:
        written = real(directory, *args, **kwargs)  # type: ignore[arg-type]
        path = Path(directory) / "orchestrator-1.toml"
        _rewrite(path, path, ranks_context="ab" * 32)
        return written

    monkeypatch.setattr(service_launch, "init_cohort", init_then_edit)
    steps: list[int] = []
    run = tmp_path / "run"
    with pytest.raises(RemoteError, match="PeerAttestationError"):
        with ServiceLaunch(hs, TINY.to_dict(), run, audit_log=run / "a.log", certificate=run / "a.pem",
                           gpus=2, rank_audit=[(run / f"{k}.log", run / f"{k}.pem") for k in "ab"]) as launch:
            launch.train(lambda row: steps.append(row["step"]))
    assert steps == [] and not (run / "checkpoint.pt").exists()


def test_only_the_shipped_data_is_opened_as_root_when_the_holders_account_cannot(cohort: Path, tmp_path: Path,
                                                                               monkeypatch) -> None:
    """A checkout in a 0700 directory: a party's processes reach the package's demo data through
    a cover of that directory, root's `as_party` cannot, so status opens the shipped data (public
    text) as root; any other path the account cannot open stays unopened."""
    import contextlib

    from gputravel.service import status

    @contextlib.contextmanager
    def shut_out(uid: int):
        raise PermissionError(13, "Permission denied")
        yield

    monkeypatch.setattr(status, "as_party", shut_out)
    cfg = load_service(cohort / "holder-north.toml")
    assert isinstance(cfg, HolderService)
    shipped = Path(status.SHIPPED) / "shakespeare" / "comedies"
    link = tmp_path / "via-a-link"
    link.symlink_to(shipped)
    assert status._holders_data(cfg.model_copy(update={"data": str(link)})).size > 0
    theirs = tmp_path / "another-holders-data.txt"
    theirs.write_text("y" * 5000)
    with pytest.raises(PermissionError):
        status._holders_data(cfg.model_copy(update={"data": str(theirs)}))
