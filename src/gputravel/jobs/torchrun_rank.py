"""One rank of a `--loader local` data-parallel job launched by torchrun (issue 14), running
jobs/local_ranks.py's rank body, so its losses equal run_local_ranks' bit for bit::

    write_torchrun_job(cfg, shares, job_dir, run_dir)          # once, before launching
    PYTHONSAFEPATH=1 torchrun --standalone --nproc-per-node 2 -m gputravel.jobs.torchrun_rank JOB_DIR

The job directory holds the job's *emulated* quoting root key (0600), which every rank reads:
anyone who can read it can make quotes every rank accepts. Real TDX modules share no key.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from gputravel.crypto.certs import write_private
from gputravel.errors import BadInput
from gputravel.files import write_json
from gputravel.jobs.local_ranks import MEASUREMENT, RankJob, new_quoting_root, rank_shares, train_rank
from gputravel.train.job import TrainConfig

__all__ = ["JOB_FILE", "main", "read_torchrun_job", "write_torchrun_job"]

JOB_FILE = "job.json"
ROOT_CERT_FILE = "quoting-root.der"  # the emulated quoting root's certificate
ROOT_KEY_FILE = "quoting-root-key.pem"  # and its private key: emulation only (module docstring)
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets per rank


class _JobFile(BaseModel):
    """job.json as written by write_torchrun_job; anything else is refused before training."""

    model_config = ConfigDict(extra="forbid", strict=True, ser_json_bytes="hex", val_json_bytes="hex")

    format: Literal["gputravel torchrun job v1"]
    train: TrainConfig
    shares: list[list[tuple[str, str]]]  # per rank: (holder name, path of its tokens)
    run_dir: str
    resume_from: str | None
    context: bytes
    measurement: bytes


def write_torchrun_job(cfg: TrainConfig, shares: Sequence[Sequence[tuple[str, str]]], job_dir: Path,
                       run_dir: Path, *, resume_from: Path | None = None) -> Path:
    """Write the job directory (0700) for len(shares) ranks, its paths absolute, with a fresh
    context and quoting root (quotes of one job are refused in any other); launch it once."""
    if cfg.loader != "local":
        raise BadInput(f"torchrun ranks train with the local loader: set loader='local' (got {cfg.loader!r})")
    resume = Path(resume_from).resolve() if resume_from is not None else None
    shares = rank_shares([[(n, str(Path(p).resolve())) for n, p in share] for share in shares], resume)
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    job_dir.chmod(0o700)  # it holds the emulated root's key; a directory made earlier too
    cert, key = new_quoting_root()
    write_private(job_dir / ROOT_CERT_FILE, cert)
    write_private(job_dir / ROOT_KEY_FILE, key)
    # Names this job and is fresh: quotes made for it are refused in any other (ddp/keys.py).
    context = b"gputravel torchrun ranks/" + os.urandom(32)
    job = _JobFile(format="gputravel torchrun job v1", train=cfg, shares=[list(share) for share in shares],
                   run_dir=str(Path(run_dir).resolve()), resume_from=str(resume) if resume else None,
                   context=context, measurement=MEASUREMENT)
    write_json(job_dir / JOB_FILE, job.model_dump(mode="json"))  # written last: a job.json means a whole job
    return job_dir


def read_torchrun_job(job_dir: Path, rank: int, world_size: int) -> RankJob:
    """Rank `rank`'s part of the job; BadInput for a missing or malformed job or another world size."""
    job_dir = Path(job_dir)
    job = _read_job_file(job_dir / JOB_FILE)
    if len(job.shares) != world_size:
        raise BadInput(f"{job_dir / JOB_FILE} is a job of {len(job.shares)} ranks, launched with WORLD_SIZE="
                       f"{world_size}: launch {len(job.shares)} ranks in all (--nnodes x --nproc-per-node)")
    if not 0 <= rank < world_size:
        raise BadInput(f"RANK={rank} is not in 0..{world_size - 1}")
    shares = rank_shares(job.shares, Path(job.resume_from) if job.resume_from else None)
    root = (_read_file(job_dir / ROOT_CERT_FILE), _read_file(job_dir / ROOT_KEY_FILE))
    names = tuple(tuple(name for name, _ in share) for share in shares)
    return RankJob(job.train, world_size, shares[rank], job.run_dir if rank == 0 else None, job.resume_from, root,
                   job.context, job.measurement, shares=names)


def _read_job_file(path: Path) -> _JobFile:
    try:
        return _JobFile.model_validate_json(_read_file(path))  # JSON mode: arrays are the shares' tuples
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'job'}: {e['msg']}" for e in exc.errors())
        raise BadInput(f"{path} is malformed: {problems}; write it with write_torchrun_job") from None


def _read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise BadInput(f"{path} not found: is {path.parent} a job directory made by write_torchrun_job?") from None
    except OSError as exc:
        raise BadInput(f"{path} cannot be read ({exc.__class__.__name__})") from None


def _launch_env() -> tuple[int, int]:
    missing = [name for name in LAUNCH_ENV if not os.environ.get(name)]
    if missing:
        raise BadInput(f"{', '.join(missing)} not set: launch this module with torchrun "
                       "(torchrun ... -m gputravel.jobs.torchrun_rank JOB_DIR)")
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise BadInput(f"RANK and WORLD_SIZE must be integers (got {os.environ['RANK']!r}, "
                       f"{os.environ['WORLD_SIZE']!r})") from None


def run(job_dir: Path) -> dict:
    """Run this process's rank of the job; rank 0 writes report.json, with "gpus" and "shares"."""
    rank, world_size = _launch_env()
    job = read_torchrun_job(Path(job_dir), rank, world_size)
    report = train_rank(rank, job)
    if rank == 0:
        report["gpus"] = world_size
        report["shares"] = [list(names) for names in job.shares]
        path = Path(job.run_dir) / "report.json"
        write_json(path, report)
        print(f"rank 0 of {world_size}: trained {len(report['losses'])} steps, final loss "
              f"{report['final_loss']}; report in {path}")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m gputravel.jobs.torchrun_rank JOB_DIR`: 0 trained, 2 bad input; a failing peer raises (exit 1)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if len(args) != 1:
            raise BadInput("usage: python -m gputravel.jobs.torchrun_rank JOB_DIR (under torchrun)")
        run(Path(args[0]))
    except BadInput as exc:
        print(f"gputravel.jobs.torchrun_rank: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
