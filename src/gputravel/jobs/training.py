"""The training job (`gputravel demo`): the orchestrator trains the workload (GPT-2, or records'
own, issue 27) on what its GPU brings from each holder; ``loader="local"`` runs the same loop here
on the same data read from disk, in the same order: the reference for paper goal G2.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from gputravel.cohort import capacity
from gputravel.cohort.client import RankPlace
from gputravel.service.init import data_bytes, holder_shares, job_tokenizer
from gputravel.service.launch import ServiceLaunch
from gputravel.cohort.gpus import GpuCohorts, on_each
from gputravel.cohort.local import Cohort
from gputravel.ddp.launch import free_port
from gputravel.net.counters import bytes_between, link_bytes
from gputravel.jobs.local_ranks import run_local_ranks
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.data.records import RecordSchema, Units, common_schema, held_out, load_records
from gputravel.data.shakespeare import shakespeare_holders
from gputravel.data.tokenizer import KNOWN
from gputravel.errors import BadInput, number_in
from gputravel.files import EVAL_SHARE, MISSING, RECORDS, TOKENS, atomic_write_bytes, not_data, write_json
from gputravel.manifest import JobManifest, Outputs, Recipient
from gputravel.net.tc import MAX_BANDWIDTH_MBIT
from gputravel.protocol.hardware import hardware_profile
from gputravel.protocol.layout import layout_for, manifest_piece_bytes
from gputravel.train.loader import TOKEN_BYTES, LocalSource
from gputravel.train.job import TrainConfig
from gputravel.train.loop import StepEvent, checkpoint_shares, make_report, sample_tokenizer, workload_of
from gputravel.train.privacy import Mechanism, check_fits, check_independent, check_job, check_model, mechanism_of
from gputravel.train.scripted import run_job


@dataclass(frozen=True)
class TrainingJobConfig:
    train: TrainConfig
    holders: tuple[tuple[str, str], ...]  # (name, path to shards or text)
    run_dir: str
    resume: bool = False  # continue from run_dir/checkpoint.pt (after a crash or a kill)
    hardware: str = "emulated"  # protocol/hardware.py: the hardware the cohort stands for
    gpus: int = 1  # data-parallel ranks, one GPU each (issue 14); each travels to its share of holders
    # Each GPU an emulated server of its own: its cohort in network namespaces, the ranks joined
    # by a shaped link through a switch (cohort/gpus.py), capped at server_mbit (None: uncapped).
    servers: bool = False
    server_mbit: float | None = None
    # Issue 28 (one GPU, the travelling or baseline loader): the job's manifest, else one built from
    # these: the model released to `release_to` (else kept sealed) once `quorum` holders sign (None:
    # a majority); the holders in `decline` decline to sign.
    manifest: JobManifest | None = None
    release_to: tuple[Recipient, ...] = ()
    quorum: int | None = None
    decline: tuple[str, ...] = ()
    # Issue 29: (holder, epsilon) caps those holders set on what their data may be spent on (their
    # [policy] epsilon_cap): a job past one is refused before anything travels.
    caps: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        hardware_profile(self.hardware)  # BadInput for an unknown profile
        if not self.holders:
            raise BadInput("a training job needs at least one data holder")
        if type(self.gpus) is not int or not 1 <= self.gpus <= len(self.holders):
            raise BadInput(f"--gpus must be between 1 and the number of holders ({len(self.holders)}), got {self.gpus!r}")
        if self.servers and (self.gpus < 2 or self.train.loader != "travelling"):
            raise BadInput("--servers spreads the GPUs of a travelling run over servers: it needs --gpus 2 or more")
        if self.train.ddp_compress != "none" and self.gpus < 2:  # else accepted and ignored
            raise BadInput(f"--ddp-compress {self.train.ddp_compress} compresses the all-reduce between GPUs: "
                           "it needs --gpus 2 or more (one GPU has nothing to all-reduce)")
        if self.server_mbit is not None:
            number_in(self.server_mbit, "--server-mbit", high=MAX_BANDWIDTH_MBIT)
        check_job(self.train, self.gpus)  # DP-SGD on one GPU only
        for name, path in self.holders:
            why = not_data(path)
            if why is not None:
                raise BadInput(f"data of holder {name!r} ({path}) {'not found' if why == MISSING else why}")
        self._check_release()

    def _check_release(self) -> None:
        given = [flag for flag, on in (("--manifest", self.manifest is not None), ("--release-to", self.release_to),
                                       ("--quorum", self.quorum is not None), ("--decline", self.decline),
                                       ("--epsilon-cap", self.caps)) if on]
        if given and not self.sealed:
            raise BadInput(f"{given[0]}: a job with a manifest runs on one GPU with the travelling or baseline "
                           "loader (no --gpus, no --loader local)")
        if self.manifest is not None and (self.release_to or self.quorum is not None):
            raise BadInput(f"{'--release-to' if self.release_to else '--quorum'}: --manifest names the recipients "
                           "and the quorum itself")
        names = [n for n, _ in self.holders]
        if self.quorum is not None and not 1 <= self.quorum <= len(names):
            raise BadInput(f"--quorum: expected 1 to {len(names)} (the holders who may sign), got {self.quorum}")
        strangers = [n for n in self.decline if n not in names]
        if strangers:
            raise BadInput(f"--decline {strangers[0]}: not a holder of this job ({', '.join(names)})")
        for name, cap in self.caps:
            if name not in names:
                raise BadInput(f"--epsilon-cap {name}: not a holder of this job ({', '.join(names)})")
            if not cap > 0:
                raise BadInput(f"--epsilon-cap {name}: expected a positive epsilon, got {cap!r}")

    @property
    def sealed(self) -> bool:
        """Whether this job runs with a manifest: its checkpoints and model sealed, released by quorum."""
        return self.gpus == 1 and self.train.loader != "local"


def check_capacity(cfg: TrainingJobConfig) -> Mechanism | None:
    """BadInput, naming the flag, if this machine cannot carry the job (cohort/capacity.py); else the
    DP-SGD it will run (None: no DP), as the orchestrator will find it from the holders' data on disk."""
    t = resolve(cfg).train  # the holders' tokenizer fixes the vocabulary, so the logits' size
    local = t.loader == "local"  # no cohort: the training alone, here
    mechanism = None
    if t.records:
        _check_records_fit(t)
        if t.dp_epsilon:
            mechanism = _check_private(t, cfg.holders)
    else:
        _check_tokens_fit(t, local)
    if local:
        return mechanism
    capacity.check_buffer(t.buffer_bytes, "--buffer-mib")
    data = sum(data_bytes(path) for _, path in cfg.holders)
    capacity.check(len(cfg.holders), sysmem_bytes=layout_for(t.buffer_bytes).sysmem_bytes,
                   dataset_bytes=-(-data // len(cfg.holders)), gpus=cfg.gpus,
                   vram_mib=-(-t.buffer_bytes // capacity.MIB) + capacity.VRAM_MARGIN_MIB, train_mib=t.memory_mib())
    return mechanism


def _check_tokens_fit(t: TrainConfig, local: bool) -> None:
    if t.buffer_bytes // TOKEN_BYTES < t.batch * t.seq_len + 1:
        raise BadInput(f"--buffer-mib {t.buffer_bytes / capacity.MIB:g} holds {t.buffer_bytes // TOKEN_BYTES} tokens, and one "
                       f"batch needs {t.batch * t.seq_len + 1} (--batch {t.batch} x --seq-len {t.seq_len}, and the next "
                       "token): use a larger --buffer-mib, or a smaller --batch or --seq-len")
    who = "training" if local else "the orchestrator's training"
    capacity.check_memory(t.memory_mib(), f"{who} with --batch {t.batch} x --seq-len {t.seq_len} needs",
                          "use a smaller --batch or --seq-len", f"a GPT-2 of {t.params():,} parameters, {t.n_layer} "
                          f"layers {t.n_embd} wide, vocabulary {t.vocab_size}, with AdamW, and a batch of "
                          f"{t.batch * t.seq_len:,} tokens")


def _check_records_fit(t: TrainConfig) -> None:
    record = RecordSchema.from_json(t.record_schema).record_bytes
    held = Units(record, manifest_piece_bytes(layout_for(t.buffer_bytes))).capacity(t.buffer_bytes)
    if held < t.batch:
        raise BadInput(f"--buffer-mib {t.buffer_bytes / capacity.MIB:g} holds {held} records of {record} bytes, and one "
                       f"batch needs {t.batch}: use a larger --buffer-mib or a smaller --batch")


def _check_private(t: TrainConfig, holders: Sequence[tuple[str, str]]) -> Mechanism:
    """A DP job's model and data, said here before anything starts (the orchestrator checks again,
    before its first travel): every layer one Opacus trains, every training record in the buffer."""
    workload = workload_of(t)
    assert workload.schema is not None
    model, _ = workload.build(t, "cpu")
    check_model(model, workload.name)
    check_independent(workload, model)  # records treated one by one: what clipping each bounds
    sizes = {name: len(held_out(len(load_records(path)), EVAL_SHARE)[0]) for name, path in holders}
    return mechanism_of(t, check_fits(t, sizes, workload.schema.record_bytes))


def default_holders(count: int, workdir: Path, workload: str = "gpt2") -> tuple[tuple[str, str], ...]:
    """The shipped demo data: Shakespeare's three presses, or its plays dealt to `count` holders in
    turn; for the image and tabular workloads, digits or tumour records dealt to `count` holders."""
    if workload in ("image", "tabular"):
        from gputravel.data.demo_records import demo_holders  # lazy: Pillow, for these workloads only

        return demo_holders(workload, count, workdir)
    presses = shakespeare_holders()
    if count == len(presses):
        return tuple((name, str(path)) for name, path in presses.items())
    plays = sorted(p for d in presses.values() for p in Path(d).glob("*.txt"))
    if not 1 <= count <= len(plays):
        raise BadInput(f"--holders must be between 1 and {len(plays)} with the demo data (one play each at least)")
    out = []
    for i in range(count):
        d = workdir / "holders" / f"holder-{i + 1}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for play in plays[i::count]:
            shutil.copyfile(play, d / play.name)
        out.append((f"holder-{i + 1}", str(d)))
    return tuple(out)


def resolve(cfg: TrainingJobConfig) -> TrainingJobConfig:
    """Fix the tokenizer and vocabulary, or the record schema, from the holders' data; every holder must agree."""
    if cfg.train.records:
        schema = common_schema(cfg.holders).canonical_json()
        train = cfg.train.replace(record_schema=schema, sample_tokens=0)
        if not train.script:
            workload_of(train)  # BadInput now if the workload cannot train on these records
        return replace(cfg, train=train)
    name = job_tokenizer(cfg.holders)
    return replace(cfg, train=cfg.train.replace(tokenizer=name, vocab_size=KNOWN[name].vocab_size))


def job_manifest(cfg: TrainingJobConfig) -> JobManifest | None:
    """The manifest the job runs under (None: without one); `cfg` resolved, so the data fixed its schema."""
    if not cfg.sealed:
        return None
    if cfg.manifest is not None:
        differs = cfg.manifest.admits(cfg.train)
        if differs:
            raise BadInput(f"--manifest: its job is not this demo's: it differs in {', '.join(differs)}")
        return cfg.manifest
    names = [n for n, _ in cfg.holders]
    t = cfg.train
    # A holder that budgets its data (--epsilon-cap) counts per-step losses as unbounded: none are written.
    outputs = Outputs(model="release" if cfg.release_to else "sealed", checkpoints="sealed", metrics=not cfg.caps,
                      samples=not t.records and t.sample_tokens > 0)  # GPT-2's sample: text it generates
    return JobManifest.for_job(t, holders=names, quorum=len(names) // 2 + 1 if cfg.quorum is None else cfg.quorum,
                               recipients=cfg.release_to, outputs=outputs)


def keys_dir(run_dir: Path) -> Path:
    """Where the demo keeps the keys its sealed checkpoint depends on (the key broker's secret and
    identity, the holders' TLS identities): beside the run directory, never in it (the host may read
    the run directory), so a --resume reopens the sealed checkpoint."""
    return run_dir.parent / f"{run_dir.name}.keys"


def run_training_job(cfg: TrainingJobConfig, on_step: Callable[[StepEvent], None] | None = None) -> dict:
    check_capacity(cfg)
    cfg = resolve(cfg)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.gpus > 1:
        report = _run_ranks(cfg, run_dir, on_step)
    elif cfg.train.loader == "local":
        report = make_report(cfg.train, run_job(cfg.train, LocalSource.of(cfg.train, cfg.holders), run_dir=run_dir,
                                              on_step=on_step,
                                              resume_from=_checkpoint(cfg, run_dir),
                                              tokenizer=sample_tokenizer(cfg.train.tokenizer)))
    else:
        report = _run_services(cfg, run_dir, on_step)
    report["holders"] = {name: path for name, path in cfg.holders}
    write_json(run_dir / "report.json", report)
    return report


def non_private_reference(cfg: TrainingJobConfig) -> dict:
    """The same job without DP, on the local loader (no cohort; no file written): its held-out
    metrics over all holders, the accuracy a DP job is stated beside."""
    t = resolve(cfg).train.replace(dp_epsilon=0.0, loader="local")
    result = run_job(t, LocalSource.of(t, cfg.holders))
    return {**(result.evals[-1]["all"] if result.evals else {}), "loader": "local"}


def _run_services(cfg: TrainingJobConfig, run_dir: Path, on_step, shares=None) -> dict:
    """Each party its own service (service/launch.py); with `shares`, each GPU's orchestrator a rank of one job."""
    logs = [_audit_paths(run_dir, f"gpu-{k}-" if shares is not None else "") for k in range(cfg.gpus)]
    _checkpoint(cfg, run_dir)  # --resume with no checkpoint: said before anything starts
    relay = None if on_step is None else (lambda row: on_step(StepEvent(**row)))
    manifest = job_manifest(cfg)
    sealed = {} if manifest is None else {"manifest": manifest, "decline": cfg.decline, "caps": dict(cfg.caps),
                                          "keep_dir": keys_dir(run_dir.absolute())}
    with ServiceLaunch(cfg.holders, cfg.train.to_dict(), run_dir, audit_log=logs[0][0], certificate=logs[0][1],
                       hardware=cfg.hardware, resume=cfg.resume, gpus=cfg.gpus, shares=shares,
                       rank_audit=logs, **sealed) as cohort:
        report = cohort.train(relay)
        if manifest is not None:
            manifest = cohort.manifest or manifest  # naming the identities its parties made
            report["manifest"] = {"digest": manifest.digest_hex(), "quorum": manifest.release.quorum,
                                  "holders": list(manifest.release.holders), "model": manifest.outputs.model}
            _files_here(report, run_dir)
        if shares is not None:
            report["ranks"] = _rank_rows(shares, cohort.rank_reports, logs)
        report["isolation"] = cohort.isolation()
    if shares is not None:
        report["servers"] = None
    report["hardware"] = hardware_profile(cfg.hardware).to_json()
    return report


def _files_here(report: dict, run_dir: Path) -> None:
    """The release's files as the user's run directory holds them (the service wrote them in its own)."""
    release = report.get("release")
    if isinstance(release, dict) and isinstance(release.get("files"), dict):
        release["files"] = {k: str(run_dir / Path(v).name) for k, v in release["files"].items()}


def _rank_rows(shares, reports: list[dict], logs: list[tuple[Path, Path]]) -> list[dict]:
    return [{"gpu": k, "holders": list(shares[k]), "travel_count": r["travel_count"], "final_loss": r["final_loss"],
             "stall_share": r["stall_share"], "audit_log": logs[k][0].name} for k, r in enumerate(reports)]


def _audit_paths(run_dir: Path, stem: str = "") -> tuple[Path, Path]:
    """The travel log and its orchestrator's certificate: a resumed run's new orchestrator key
    starts a log of its own beside the first; `stem` names the GPU, with several ("gpu-1-")."""
    k = 0
    while (run_dir / (f"{stem}audit-{k}.log" if k else f"{stem}audit.log")).exists():
        k += 1
    suffix = f"-{k}" if k else ""
    return run_dir / f"{stem}audit{suffix}.log", run_dir / f"{stem}orchestrator{suffix}.pem"


def _checkpoint(cfg: TrainingJobConfig, run_dir: Path) -> Path | None:
    if not cfg.resume:
        return None
    path = run_dir / "checkpoint.pt"
    if not path.is_file():
        raise BadInput(f"nothing to resume: {path} does not exist (run without --resume first)")
    return path


def shares_of(cfg: TrainingJobConfig) -> tuple[tuple[str, ...], ...]:
    """Each GPU's holders, balanced by their data's bytes: the same for a run and its local reference (G2)."""
    return tuple(map(tuple, holder_shares(cfg.holders, cfg.gpus)))


def _resumed_shares(cfg: TrainingJobConfig, run_dir: Path) -> tuple[tuple[str, ...], ...] | None:
    """The checkpoint's shares: a new partition of grown data would hand a holder's cursor to another rank."""
    checkpoint = _checkpoint(cfg, run_dir)
    shares = checkpoint_shares(checkpoint) if checkpoint is not None else None
    if shares is not None:
        holder_shares(cfg.holders, cfg.gpus, shares, f"{checkpoint} (resume with the same GPUs and holders)")
    return shares


def _run_ranks(cfg: TrainingJobConfig, run_dir: Path, on_step) -> dict:
    shares = _resumed_shares(cfg, run_dir) or shares_of(cfg)
    paths = dict(cfg.holders)
    if cfg.train.loader == "local":
        report = run_local_ranks(cfg.train, [[(n, paths[n]) for n in share] for share in shares], run_dir,
                                 resume_from=_checkpoint(cfg, run_dir))
    elif cfg.train.loader == "travelling" and not cfg.servers:
        report = _run_services(cfg, run_dir, on_step, shares)
    elif cfg.train.loader == "travelling":
        report = _run_travelling_ranks(cfg, run_dir, on_step, shares)
    else:
        raise BadInput(f"--gpus {cfg.gpus} trains with the travelling or the local loader, not {cfg.train.loader!r}")
    report["gpus"] = cfg.gpus
    report["shares"] = [list(s) for s in shares]
    return report


def _run_travelling_ranks(cfg: TrainingJobConfig, run_dir: Path, on_step, shares) -> dict:
    """--servers: a cohort per GPU in network namespaces (cohort/gpus.py), the ranks of one job."""
    t = cfg.train
    logs = [_audit_paths(run_dir, f"gpu-{k}-") for k in range(cfg.gpus)]
    fmt = RECORDS if t.records else TOKENS
    base = CohortConfig(holders=tuple(HolderSpec(n, p, fmt) for n, p in cfg.holders), schema=t.record_schema,
                        buffer_bytes=t.buffer_bytes, layout=layout_for(t.buffer_bytes),
                        tokenizer="" if t.records else t.tokenizer,
                        output_dirs=(str(run_dir),), hardware=cfg.hardware, link="netns",
                        job_json=t.canonical_json())

    def per_gpu(k: int, c: CohortConfig) -> CohortConfig:
        # Only rank 0 writes into the run directory; each rank signs its own travel log.
        return replace(c, audit_log=str(logs[k][0]), output_dirs=c.output_dirs if k == 0 else ())

    resume = _checkpoint(cfg, run_dir)
    with GpuCohorts(base, shares, per_gpu=per_gpu, servers=cfg.servers, server_mbit=cfg.server_mbit) as gpus:
        # The port is free here; rank 0 binds it in its own namespace when it is a server's.
        place = RankPlace(world_size=cfg.gpus, master=f"{gpus.rank_address(0)}:{free_port()}",
                          ifname=gpus.rank_ifname, shares=tuple(shares),
                          context=b"gputravel demo ranks/" + os.urandom(32))
        for k, cohort in enumerate(gpus.cohorts):  # replaced, never written through a link a rank left
            atomic_write_bytes(logs[k][1], cohort.orchestrator_certificate())
        relay = None if on_step is None else (lambda m: on_step(StepEvent(**{f: getattr(m, f) for f in StepEvent.__dataclass_fields__})))

        def rank(k: int, cohort: Cohort) -> dict:
            return cohort.train(t.canonical_json(), str(run_dir.resolve()) if k == 0 else "",
                                         str(resume.absolute()) if resume else "", on_step=relay if k == 0 else None,
                                         rank=replace(place, rank=k))

        before = link_bytes(gpus.fabric) if gpus.fabric is not None else {}
        # The first failure closes every cohort: ranks blocked in a collective with it stop too.
        reports = on_each(gpus.cohorts, rank, stop_all=gpus.close)
        carried = bytes_between(before, link_bytes(gpus.fabric)) if gpus.fabric is not None else {}
        report = reports[0]
        report["ranks"] = _rank_rows(shares, reports, logs)
        each = [c.isolation.summary() for c in gpus.cohorts]  # on only if on for every GPU's cohort
        report["isolation"] = {"on": all(i["on"] for i in each),
                               "reason": next((i["reason"] for i in each if i["reason"]), ""),
                               "parties": {f"gpu-{k}/{n}": p for k, i in enumerate(each)
                                           for n, p in i["parties"].items()}}
        # What each server's link to the others carried (kernel counters): the ranks' traffic.
        report["servers"] = None if gpus.fabric is None else {
            "links": gpus.fabric.link, "mbit": cfg.server_mbit,
            "bytes": {name: {"sent": b.up, "received": b.down} for name, b in carried.items()}}
        report["hardware"] = hardware_profile(cfg.hardware).to_json()
        return report
