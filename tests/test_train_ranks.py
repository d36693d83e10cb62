"""The training loop as one rank of a data-parallel job (train/ranks.py, issue 14), and its
local N-rank runner (jobs/local_ranks.py), the `--loader local` reference of G2 with N ranks:
deterministic to the bit, resumable to the bit, and stopped before training by a refused peer."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from gputravel.ddp.launch import ProcessFailed, free_port, run_processes
from gputravel.errors import BadInput
from gputravel.jobs.local_ranks import run_local_ranks
from gputravel.train.loader import LocalSource
from gputravel.train import loop
from gputravel.train.loop import TrainConfig, train
from gputravel.train.ranks import Ranks

TINY = TrainConfig(steps=8, batch=2, seq_len=16, buffer_bytes=1024, n_layer=1, n_head=2, n_embd=32,
                   threads=1, sample_tokens=0, warmup_steps=2, checkpoint_every=4)
STOP_AT = 4  # the stopped run's last step: its checkpoint is the one resumed
ASK_AT = 3  # a rank asked to stop here, between periodic checkpoints: the stop's checkpoint is resumed
# The ranks this file starts itself are forks of a forkserver that imported torch once (as
# conftest's run_ranks starts them), not fresh interpreters that each import it: seconds a
# launch. Each rank is still a process of its own; how it started is not what these tests check.
FORK = {"method": "forkserver", "preload": ["torch", "torch.distributed", "gputravel.ddp"], "grace": 5.0}


@pytest.fixture(scope="module")
def two_ranks(processes, tmp_path_factory, write_rank_shares):
    tmp = tmp_path_factory.mktemp("ranks")
    shares = write_rank_shares(tmp)
    return tmp, shares, run_local_ranks(TINY, shares, tmp / "run", timeout=60)


class _Stop(Exception):
    pass


def _stopping_rank(rank: int, world: int, port: int, shares, run_dir: str, refuse: bool) -> None:
    """A rank of a test job: stops (as if killed) after step STOP_AT, or refuses its peer."""
    from gputravel.data.holder_tokens import load_tokens

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    def stop(event) -> None:
        if event.step + 1 == STOP_AT:
            raise _Stop("stopped on purpose")

    def verify(peer: int, evidence: bytes, data: bytes) -> None:
        if (refuse and rank == 1) or evidence != b"quote of " + data:
            raise ValueError("not the measurement this rank trusts")

    ranks = Ranks(rank=rank, world_size=world, attest=lambda data: b"quote of " + data, verify=verify,
                  context=b"test job", timeout_s=30)
    tokens = {name: load_tokens(path, TINY.tokenizer).tokens for name, path in shares[rank]}
    train(TINY, LocalSource(tokens), run_dir=Path(run_dir) if rank == 0 else None, on_step=stop, ranks=ranks)


def _asked_rank(rank: int, world: int, port: int, shares, run_dir: str) -> tuple[bool, int]:
    """A rank of a test job where rank 1 alone is asked to stop after step ASK_AT: (stopped, steps)."""
    from gputravel.data.holder_tokens import load_tokens

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    done = []
    ranks = Ranks(rank=rank, world_size=world, attest=lambda data: data, verify=lambda *a: None,
                  context=b"test job", timeout_s=30)
    tokens = {name: load_tokens(path, TINY.tokenizer).tokens for name, path in shares[rank]}
    result = train(TINY, LocalSource(tokens), run_dir=Path(run_dir) if rank == 0 else None, ranks=ranks,
                   on_step=lambda event: done.append(event.step), should_stop=lambda: rank == 1 and len(done) == ASK_AT)
    return result.stopped, len(result.losses)


def _tampered_rank(rank: int, world: int, port: int, shares) -> str:
    """A rank of a job whose host flips one bit of rank 1's third ring record: what it raised."""
    from gputravel.data.holder_tokens import load_tokens
    from gputravel.ddp import ring

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    real, sent = ring.TorchPointToPoint.isend, []

    def tampering(self, buf, dst, lane):
        sent.append(dst)
        if rank == 1 and len(sent) == 3:
            buf[0] = buf[0] ^ 1
        return real(self, buf, dst, lane)

    ring.TorchPointToPoint.isend = tampering
    ranks = Ranks(rank=rank, world_size=world, attest=lambda data: data, verify=lambda *a: None,
                  context=b"test job", timeout_s=20)
    tokens = {name: load_tokens(path, TINY.tokenizer).tokens for name, path in shares[rank]}
    try:
        train(TINY, LocalSource(tokens), ranks=ranks)
    except Exception as err:  # the test wants the type each rank saw
        return type(err).__name__
    return "trained"


def _run_test_job(shares, run_dir: Path, refuse: bool) -> None:
    port = free_port()
    run_processes([(_stopping_rank, (r, 2, port, shares, str(run_dir), refuse)) for r in range(2)], 60,
                  names=["rank 0", "rank 1"], **FORK)


def test_two_local_ranks_give_bit_identical_losses_run_after_run(two_ranks):
    tmp, shares, first = two_ranks
    again = run_local_ranks(TINY, shares, tmp / "again", timeout=60)
    assert len(first["losses"]) == TINY.steps
    assert first["losses"] == again["losses"] and first["rank_losses"] == again["rank_losses"]
    assert first["rank_losses"][0] == first["losses"] != first["rank_losses"][1]  # each rank its own batches
    assert first["gpus"] == 2 and first["shares"] == [["north"], ["south", "west"]]
    assert {t["holder"] for t in first["travels"]} == {"north"}  # rank 0's report is rank 0's
    assert (tmp / "run" / "checkpoint.pt").is_file()
    assert len((tmp / "run" / "metrics.csv").read_text().splitlines()) == 1 + TINY.steps  # rank 0's alone


def test_a_stopped_job_resumes_from_its_checkpoint_bit_for_bit(two_ranks, tmp_path):
    _, shares, uninterrupted = two_ranks
    with pytest.raises(ProcessFailed, match="_Stop"):
        _run_test_job(shares, tmp_path / "run", refuse=False)
    checkpoint = tmp_path / "run" / "checkpoint.pt"
    assert checkpoint.is_file()
    resumed = run_local_ranks(TINY, shares, tmp_path / "run", resume_from=checkpoint, timeout=60)
    assert resumed["losses"] == uninterrupted["losses"]
    assert resumed["rank_losses"] == uninterrupted["rank_losses"]
    assert resumed["loader_state"] == uninterrupted["loader_state"]


def test_one_rank_asked_to_stop_stops_every_rank_at_its_step_and_resumes_bit_for_bit(two_ranks, tmp_path):
    """A rank of several GPUs asked to stop (its service's SIGTERM) does not stop alone, leaving its peers
    waiting: the ranks vote at every step, all stop where one was asked, and rank 0 checkpoints there."""
    _, shares, uninterrupted = two_ranks
    port = free_port()
    outcomes = run_processes([(_asked_rank, (r, 2, port, shares, str(tmp_path / "run"))) for r in range(2)], 60,
                             names=["rank 0", "rank 1"], **FORK)
    assert outcomes == [(True, ASK_AT), (True, ASK_AT)]
    checkpoint = tmp_path / "run" / "checkpoint.pt"
    assert len(loop.checkpoint_extra(checkpoint)["losses"]) == ASK_AT  # written at the stop, not at step 4
    resumed = run_local_ranks(TINY, shares, tmp_path / "run", resume_from=checkpoint, timeout=60)
    assert resumed["losses"] == uninterrupted["losses"]
    assert resumed["rank_losses"] == uninterrupted["rank_losses"]


def test_resuming_with_another_number_of_ranks_is_refused(two_ranks, tmp_path):
    tmp, shares, _ = two_ranks
    checkpoint = tmp_path / "checkpoint.pt"
    shutil.copyfile(tmp / "run" / "checkpoint.pt", checkpoint)
    with pytest.raises(BadInput, match="2 ranks"):
        run_local_ranks(TINY, [shares[0] + shares[1]], tmp_path / "one", resume_from=checkpoint)
    one = Ranks(rank=0, world_size=1, attest=bytes, verify=lambda *a: None, context=b"job")
    for ranks in (None, one):  # the loop refuses it too, before it joins any group
        with pytest.raises(BadInput, match="2 ranks"):
            train(TINY, LocalSource({}), resume_from=checkpoint, ranks=ranks)


def test_resuming_with_other_shares_of_the_holders_is_refused(two_ranks):
    """The checkpoint records which holders each rank trained on; resumed with other shares a
    rank would take over another's cursors and a chunk would reach two ranks."""
    tmp, shares, _ = two_ranks
    checkpoint = tmp / "run" / "checkpoint.pt"
    swapped = [shares[1], shares[0]]
    with pytest.raises(ProcessFailed, match="other shares"):
        run_local_ranks(TINY, swapped, tmp / "swapped", resume_from=checkpoint, timeout=60)
    names = (("south", "west"), ("north",))
    rank0 = Ranks(rank=0, world_size=2, attest=bytes, verify=lambda *a: None, context=b"job", shares=names)
    extra = {"shares": None, "loaders": None}
    with pytest.raises(BadInput, match="outside its share"):  # a checkpoint that records none
        loop._check_shares(checkpoint, extra, {"cursors": {"north": 8}, "last": "north"}, rank0)


def test_a_checkpoint_changed_after_the_ranks_agreed_on_it_is_refused(two_ranks):
    """The orchestrator binds the SHA-384 of the checkpoint it resumes into the ranks' keys;
    the loop then loads only bytes with that digest, so a file swapped in between is refused."""
    tmp, shares, _ = two_ranks
    checkpoint = tmp / "run" / "checkpoint.pt"
    bound = hashlib.sha384(checkpoint.read_bytes() + b"before the swap").digest()
    ranks = Ranks(rank=0, world_size=2, attest=bytes, verify=lambda *a: None, context=b"job",
                  shares=(("north",), ("south", "west")), resume_sha384=bound)
    with pytest.raises(BadInput, match="changed after"):
        train(TINY, LocalSource({}), resume_from=checkpoint, ranks=ranks)


def test_a_rank_that_refuses_its_peer_stops_the_job_before_any_step(two_ranks, tmp_path):
    _, shares, _ = two_ranks
    with pytest.raises(ProcessFailed) as err:
        _run_test_job(shares, tmp_path / "run", refuse=True)
    assert err.value.error.startswith("PeerAttestationError")
    assert not (tmp_path / "run" / "metrics.csv").exists() and not (tmp_path / "run" / "checkpoint.pt").exists()


def test_a_tampered_gradient_record_stops_the_step_with_its_typed_error(two_ranks):
    _, shares, _ = two_ranks
    port = free_port()
    seen = run_processes([(_tampered_rank, (r, 2, port, shares)) for r in range(2)], 60, names=["rank 0", "rank 1"],
                         **FORK)
    # Rank 0 opened the tampered record; rank 1 then lost its peer mid-ring. Neither trained
    # on, and neither saw DDP's RuntimeError: the ring's own errors come through.
    assert seen[0] == "IntegrityError"
    assert seen[1] in ("TransportClosed", "PeerTimeout", "ChannelFaulted")


@pytest.mark.parametrize("bad", [dict(rank=2), dict(rank=-1), dict(world_size=0), dict(context=b""),
                                 dict(variant="plain"), dict(attest=None), dict(timeout_s=0),
                                 dict(shares=(("a",), ("a",))), dict(shares=(("a",), ())), dict(shares=(("a",),))])
def test_bad_ranks_are_refused(bad):
    args = dict(rank=0, world_size=2, attest=bytes, verify=lambda *a: None, context=b"job") | bad
    with pytest.raises(BadInput):
        Ranks(**args)


class _PeersVote:
    """A ring whose all-reduce adds what the peers sent: their votes, or a bug's or a liar's numbers."""

    def __init__(self, *peers: float) -> None:
        self.peers = peers

    def all_reduce(self, votes) -> None:
        import torch

        votes += torch.tensor(self.peers, dtype=votes.dtype)


@pytest.mark.parametrize("peers, mine, stop", [((0.0, 0.0), False, False), ((0.0, 1.0), False, True),
                                               ((0.0, 0.0), True, True), ((0.0, 0.5), False, None),
                                               ((0.0, 2.0), False, None), ((1.0, 0.0), False, None)])
def test_a_stop_vote_is_yes_or_no_and_a_ranks_own_vote_comes_back_unchanged(peers, mine, stop):
    """Every rank stops where any asked (security row 53); a vote other than 0/1, or one written into
    another rank's slot, is a ProtocolError, never a stop or a go decided on a number nobody cast."""
    from gputravel.errors import ProtocolError
    from gputravel.train.ranks import DataParallel

    ranks = Ranks(rank=0, world_size=2, attest=bytes, verify=lambda *a: None, context=b"job")
    dp = DataParallel(ranks, group=None, ring=_PeersVote(*peers), owns_default=False)  # type: ignore[arg-type]
    if stop is None:
        with pytest.raises(ProtocolError, match="vote"):
            dp.anyone(mine)
    else:
        assert dp.anyone(mine) is stop


def _wrapped_rank(rank: int, world: int, port: int) -> list[float]:
    """A rank whose model starts from its own seed: its first weights after DataParallel.wrap."""
    import torch

    from gputravel.train.ranks import DataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.manual_seed(100 + rank)
    model = torch.nn.Linear(4, 2)
    ranks = Ranks(rank=rank, world_size=world, attest=lambda data: data, verify=lambda *a: None,
                  context=b"test job", timeout_s=20)
    with DataParallel.open(ranks) as dp:
        dp.wrap(model)
        return model.weight.detach().flatten().tolist()


def test_wrapping_broadcasts_no_parameter(processes):
    """DDP's start-up broadcast would send rank 0's weights over gloo in the clear: it is off,
    so two ranks that start from different weights still hold their own after wrapping."""
    port = free_port()
    got = run_processes([(_wrapped_rank, (r, 2, port)) for r in range(2)], 60, names=["rank 0", "rank 1"], **FORK)
    assert got[0] != got[1]
