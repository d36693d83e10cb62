"""`--loader local` with N ranks, the G2 reference (issue 14): rank processes reading their
shares from disk run the travelling ranks' loop, so the losses are bit-identical; each rank's
TEE is emulated under one quoting root the parent makes for the job.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from gputravel.attest import Authority
from gputravel.attest.quote import EmulatedRankTee
from gputravel.attest.roots import TEE_QUOTING_ROOT_CN
from gputravel.crypto.certs import key_pem
from gputravel.ddp.launch import free_port, run_processes
from gputravel.errors import BadInput
from gputravel.train.loader import LocalSource
from gputravel.train.job import TrainConfig
from gputravel.train.loop import checkpoint_world_size, make_report, sample_tokenizer, train
from gputravel.train.ranks import Ranks

__all__ = ["MEASUREMENT", "RankJob", "new_quoting_root", "rank_shares", "run_local_ranks", "train_rank"]

#: The rank CVMs' measurement (emulated): every rank quotes it, every rank accepts only it.
MEASUREMENT = hashlib.sha384(b"gputravel local rank cvm v1").digest()
DEFAULT_TIMEOUT_S = 4 * 3600.0  # the whole job; a rank silent that long is hung


@dataclass(frozen=True)
class RankJob:
    """What one rank needs besides its place; picklable, or read from a job directory (jobs/torchrun_rank.py)."""

    cfg: TrainConfig
    world_size: int
    share: tuple[tuple[str, str], ...]  # (holder name, path of its tokens)
    run_dir: str | None  # rank 0 only
    resume_from: str | None
    root: tuple[bytes, bytes]  # the emulated quoting root's certificate (DER) and key (PEM)
    context: bytes
    measurement: bytes = MEASUREMENT
    shares: tuple[tuple[str, ...], ...] = ()  # every rank's holder names, recorded by its checkpoints


def run_local_ranks(cfg: TrainConfig, shares: Sequence[Sequence[tuple[str, str]]], run_dir: Path, *,
                    resume_from: Path | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """Train with a local rank per share; rank 0's report, with "gpus", "shares" and every
    rank's "rank_losses". A rank that fails, dies or hangs stops the job (ddp.launch)."""
    shares = rank_shares(shares, resume_from)
    port = free_port()
    # Names this job and is fresh: quotes made for it are refused in any other (ddp/keys.py).
    context = b"gputravel local ranks/" + os.urandom(32)
    root = new_quoting_root()
    names = tuple(tuple(name for name, _ in share) for share in shares)
    jobs = [RankJob(cfg, len(shares), share, str(run_dir) if k == 0 else None,
                    str(resume_from) if resume_from is not None else None, root, context, shares=names)
            for k, share in enumerate(shares)]
    reports = run_processes([(_rank_main, (k, port, job)) for k, job in enumerate(jobs)], timeout,
                            names=[f"rank {k} of {len(shares)}" for k in range(len(shares))])
    report = reports[0]
    report["gpus"] = len(shares)
    report["shares"] = [[name for name, _ in share] for share in shares]
    report["rank_losses"] = [r["losses"] for r in reports]
    return report


def rank_shares(shares: Sequence[Sequence[tuple[str, str]]],
                resume_from: Path | None = None) -> tuple[tuple[tuple[str, str], ...], ...]:
    """`shares` as tuples of (name, path), checked: none empty, and as many as the checkpoint's ranks."""
    shares = tuple(tuple((str(n), str(p)) for n, p in share) for share in shares)
    if not shares or any(not share for share in shares):
        raise BadInput("every rank needs a share of at least one holder")
    if resume_from is not None and (found := checkpoint_world_size(resume_from)) != len(shares):
        raise BadInput(f"checkpoint {resume_from} is of a job of {found} ranks; resume it with {found} ranks, "
                       f"not {len(shares)}")
    return shares


def new_quoting_root() -> tuple[bytes, bytes]:
    """A fresh emulated quoting root for one job: its certificate (DER) and key (PEM)."""
    authority = Authority.self_signed(TEE_QUOTING_ROOT_CN)
    return authority.cert_der, key_pem(authority.key)


def _rank_main(rank: int, port: int, job: RankJob) -> dict:
    # The env:// rendezvous torchrun would set; on one machine a rank's local rank is its rank.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(job.world_size))
    return train_rank(rank, job)


def train_rank(rank: int, job: RankJob) -> dict:
    """Rank `rank` of `job`, however launched (MASTER_ADDR and MASTER_PORT set); its report."""
    cfg = job.cfg
    cert, key = job.root
    tee = EmulatedRankTee(Authority(cert, serialization.load_pem_private_key(key, password=None)), cert,
                          job.measurement)
    ranks = Ranks(rank=rank, world_size=job.world_size, attest=tee.attest, verify=tee.verify, context=job.context,
                  shares=job.shares)
    result = train(cfg, LocalSource.of(cfg, job.share), run_dir=Path(job.run_dir) if job.run_dir else None,
                   resume_from=Path(job.resume_from) if job.resume_from else None,
                   tokenizer=sample_tokenizer(cfg.tokenizer) if rank == 0 else None, ranks=ranks)
    return make_report(cfg, result)
