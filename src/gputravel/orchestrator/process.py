"""The orchestrator CVM's main loop: boot the engine (orchestrator/cvm.py), then answer the
supervisor's commands (travels, baseline transfers, joins and leaves, training)."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
import hashlib
import hmac
import json
import logging
import math
import select
import os
import socket
from functools import partial
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gputravel.attest.material import OrchestratorMaterial
from gputravel.broker.client import fetch_key
from gputravel.broker.seal import Sealer
from gputravel.crypto.pki import CohortPki
from gputravel.manifest import JobManifest
from gputravel.attest.rank import QuotingRankTee
from gputravel.firmware.tdx_module import request_quote
from gputravel.errors import BadInput, GputravelError, LocalError, failed_where
from gputravel.orchestrator.cvm import NAME, Orchestrator, OrchestratorConfig
from gputravel.orchestrator.job import job_digest
from gputravel.orchestrator.membership import ORCHESTRATOR_COMMANDS, Membership
from gputravel.orchestrator.release import Ending, anchors_digest, end_job, holder_anchors
from gputravel.protocol.control import (
    AwaitHolders,
    DoBaseline,
    DoTravel,
    Failed,
    Holders,
    Ready,
    Shutdown,
    Train,
    TrainDone,
    TrainStep,
)
from gputravel.protocol.travel import Bye
from gputravel.transport.base import Transport

if TYPE_CHECKING:
    from gputravel.train.ranks import Ranks

log = logging.getLogger(__name__)


class Admitting:
    """The engine training travels with: before each travel, holders join and leave (paper 4.5)."""

    def __init__(self, orch: Orchestrator, membership: Membership) -> None:
        self.orch, self.membership = orch, membership
        # What each holder brought when the job began: the loader cut its data by it, so one that
        # rejoins with another dataset or split is left out, never read with the old cut.
        hellos = orch.travel_sm.holders if orch.travel_sm is not None else {}
        self.pinned = {name: _what_travels(hello) for name, hello in hellos.items()}

    def travel(self, holder: str, dataset_offset: int) -> object:
        self.admit_waiting()
        return self.orch.travel(holder, dataset_offset)

    def baseline(self, holder: str, dataset_offset: int) -> object:
        """The TLS baseline's copy (paper 7.2), after reading goodbyes: it admits nobody mid-job."""
        self.read_goodbyes()
        return self.orch.baseline(holder, dataset_offset)

    def buffer_view(self) -> memoryview:
        return self.orch.buffer_view()

    def online(self) -> set[str]:
        return set(self.orch.holders)

    def read_goodbyes(self) -> None:
        """Holders that said goodbye (or broke their link) are dropped; nobody is admitted here: the
        loader asks this before it trains again on records it kept (train/loader.py)."""
        for name in [n for n, conn in self.orch.holders.items() if _readable(conn.fileno())]:
            self._departure(name)  # between travels a holder only ever says goodbye

    def admit_waiting(self) -> None:
        self.read_goodbyes()
        # One admission per travel at most: a stream of connections delays travels, never starves them.
        if _readable(self.orch.listener.fileno()):
            try:
                name = self.orch.accept_holder(self.orch.config.holder_timeout, self.membership.probe_over)
                hellos = self.orch.travel_sm.holders if self.orch.travel_sm is not None else {}
                if name in self.pinned and _what_travels(hellos[name]) != self.pinned[name]:
                    log.warning("holder %s rejoined with another dataset or split: left out of this job", name)
                    self.orch.drop(name)
                    return
                log.info("admitted holder %s", name)
            except GputravelError as exc:  # that holder stays out; training goes on with the others
                log.warning("a holder could not join: %s: %s", type(exc).__name__, exc)

    def _departure(self, name: str) -> None:
        try:
            msg = self.orch.holders[name].recv(timeout=1).message
            why = msg.reason if isinstance(msg, Bye) else f"sent {type(msg).__name__} between travels"
        except GputravelError as exc:
            why = type(exc).__name__
        log.info("holder %s left: %s", name, why)
        self.orch.drop(name)


def _what_travels(hello: Any) -> tuple[object, ...]:
    return (hello.dataset_bytes, hello.piece_bytes, hello.manifest, hello.tokenizer, hello.schema,
            hello.train_records, hello.eval_records)


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def run_training(orch: Orchestrator, cmd: Train, control: Transport, membership: Membership) -> dict[str, Any]:
    """Train inside this CVM on batches the GPU fetched by travelling; stream each step out."""
    from gputravel.train.loader import BaselineSource, TravelSource  # lazy: torch, for training only
    from gputravel.train.job import TrainConfig  # lazy: pydantic, for training only
    from gputravel.train.loop import make_report, sample_tokenizer  # lazy: torch
    from gputravel.train.scripted import run_job  # lazy: torch

    cfg = TrainConfig.from_json(cmd.config_json)
    if orch.travel_log is not None:
        orch.travel_log.check_open()
    measured = orch.config.job_json
    if measured and TrainConfig.from_json(measured).canonical_json() != measured:  # one text, one meaning
        raise BadInput("the job this orchestrator was measured with is not in canonical form: launch it with the "
                       "job's canonical JSON (TrainConfig.canonical_json)")
    if cfg.workload_code and not measured:  # code runs only where the holders pinned it
        raise BadInput("a job that brings its own code runs only on an orchestrator measured with that job")
    if orch.config.job_json and TrainConfig.from_json(orch.config.job_json) != cfg:
        raise BadInput("the job differs from the one this orchestrator was measured with, "
                       "which the holders pinned: launch an orchestrator for this job")
    if cfg.buffer_bytes != orch.config.buffer_bytes:
        raise BadInput(f"the job wants a {cfg.buffer_bytes}-byte buffer, this cohort has {orch.config.buffer_bytes}")
    if cfg.records and cfg.record_schema != orch.config.schema:
        raise BadInput("the job trains on records of another schema than the one this cohort's holders were "
                       "admitted with: launch an orchestrator for this job")
    if not cfg.records and orch.config.tokenizer and cfg.tokenizer != orch.config.tokenizer:
        raise BadInput(f"the job trains on {cfg.tokenizer!r} tokens, this cohort holds {orch.config.tokenizer!r} tokens")
    if cfg.ddp_compress != "none" and cmd.world_size < 2:  # a setting that would do nothing is refused, not ignored
        raise BadInput(f"ddp_compress {cfg.ddp_compress!r} compresses the all-reduce between GPUs: this job trains on "
                       "one, so set it to \"none\"")
    assert orch.travel_sm is not None
    hellos = {name: orch.travel_sm.holders[name] for name in orch.holders}
    sizes = {name: hello.dataset_bytes for name, hello in hellos.items()}
    cuts = {name: _cut(hello, cfg.records) for name, hello in hellos.items()}
    ranks = _ranks(orch, cmd)
    ending = _ending(orch, cmd, cfg)
    ended = _ending_args(ending, cfg, cuts)
    engine = Admitting(orch, membership)
    # Both on the engine: a holder's goodbye is read before a DP step or a kept visit either way.
    source = (BaselineSource(engine, sizes, cuts) if cfg.loader == "baseline" else TravelSource(engine, sizes, cuts))
    samples = ending is None or ending.manifest.outputs.samples  # generated text can repeat training data
    quiet = ending is not None and not ending.manifest.outputs.metrics
    run_dir = Path(cmd.run_dir) if cmd.run_dir else None
    result = run_job(cfg, source, run_dir=run_dir,
                   on_step=lambda e: control.send(_step(e, quiet)),
                   resume_from=Path(cmd.resume_checkpoint) if cmd.resume_checkpoint else None,
                   tokenizer=sample_tokenizer(cfg.tokenizer) if samples else None, ranks=ranks,
                   should_stop=_ShutdownAsked(control),  # with ranks, one asked stops them all
                   anchor=orch.travel_log,  # a resume goes on only with the log its checkpoint names
                   **ended)
    report = make_report(cfg, result)
    if ending is not None and not result.stopped:  # a stopped job resumes: it ends later
        report["release"] = end_job(ending, result.weights, _metrics(report), dict(orch.holders), run_dir,
                                    orch.travel_log).to_dict()
    return _allowed(report, ending)


def _ending(orch: Orchestrator, cmd: Train, cfg: Any) -> Ending | None:
    """What a job with a manifest keeps and how it ends (issue 28); None: a job without one."""
    config = orch.config
    if not config.manifest_json:
        return None
    if cmd.world_size > 1:
        raise BadInput("a job with a manifest trains on one GPU for now: its release gathers every holder's "
                       "signature in one orchestrator")
    from gputravel.train.rundir import Kept  # lazy: torch, for training only

    manifest, digest = JobManifest.from_json(config.manifest_json), job_digest(config)
    if cmd.resume_checkpoint and manifest.outputs.checkpoints != "sealed":
        # Only a sealed checkpoint is surely this job's: a plaintext one may be anyone's weights.
        raise BadInput("a job whose manifest keeps no checkpoint (outputs.checkpoints = \"none\") cannot resume")
    broker_key, anchored = job_parties(manifest, config), _anchors(manifest, config)

    def sealer(purpose: str) -> Sealer:
        # Quoted through the attester: only once RTMR[3] holds the job, which the key is bound to.
        key = fetch_key(config.broker_socket, purpose, orch.attester.quote, config.holder_timeout, broker_key)
        return Sealer(key, purpose, digest)

    checkpoints = manifest.outputs.checkpoints == "sealed"
    kept = Kept(metrics=manifest.outputs.metrics, checkpoints=checkpoints,
                sealer=sealer("checkpoint") if checkpoints else None, weights=True)
    dp_secret = None
    if cfg.dp_epsilon:  # DP-SGD's key from the broker: every run of this job draws the same sample and noise
        dp_secret = fetch_key(config.broker_socket, "dp", orch.attester.quote, config.holder_timeout, broker_key)
    return Ending(manifest, digest, anchored, sealer("model"), config.holder_timeout, kept, dp_secret)


def _ending_args(ending: Ending | None, cfg: Any, cuts: dict[str, Any]) -> dict[str, Any]:
    """What a manifest job adds to its run: what the run directory keeps and, for DP-SGD, the
    sampling and noise key of the broker's "dp" key over exactly the holders it names."""
    if ending is None:
        return {}
    if not cfg.dp_epsilon:
        return {"kept": ending.kept}
    check_dp_holders(ending.manifest.release.holders, cuts)
    if ending.dp_secret is None:  # a fresh key would let each rerun spend the holders' epsilon again
        raise BadInput("a manifest DP job needs its key broker's \"dp\" key")
    return {"kept": ending.kept, "dp_key": dp_key(ending.dp_secret, cuts)}


def check_dp_holders(named: Sequence[str], joined: Mapping[str, Any]) -> None:
    """A manifest DP job trains on every holder its manifest names, no fewer: the key follows the data
    of those who joined, so a run over a subset (the host picks whom the orchestrator awaits) would
    draw another key and spend the others' epsilon again."""
    if set(joined) != set(named):
        missing, extra = sorted(set(named) - set(joined)), sorted(set(joined) - set(named))
        raise BadInput(f"a DP job trains on every holder its manifest names: missing {missing}, not named {extra}; "
                       "a run over others would spend their privacy budget again")


def dp_key(secret: bytes, cuts: dict[str, Any]) -> bytes:
    """DP-SGD's sampling and noise key for a run of the job over exactly these holders' data: the same
    job over the same data draws the same sample and noise, so a run again from scratch (the host's
    rerun: the third review) gives the same model and spends nothing more; other data, another key."""
    data = json.dumps(sorted((name, cut.digest) for name, cut in cuts.items())).encode()
    return hmac.new(secret, b"gputravel/dp-key/v1\x00" + data, hashlib.sha256).digest()


def job_parties(manifest: JobManifest, config: OrchestratorConfig) -> str:
    """The key broker this job trusts (hex), the manifest's or else the one the measurement names;
    BadInput if it has none, or if the two disagree."""
    if not config.broker_socket:
        raise BadInput("a job with a manifest needs the key broker (broker_socket): its checkpoints and model "
                       "are sealed")
    named, measured = manifest.broker.identity, config.broker_key
    if named and measured and named != measured:
        raise BadInput("the manifest's broker.identity is not the key broker this orchestrator's measurement names "
                       "(broker_key): its keys would come from another broker")
    if not (named or measured):
        raise BadInput("a job with a manifest needs its key broker's identity: broker.identity in the manifest "
                       "(gputravel job init --cohort D), or broker_key in the orchestrator's config")
    return named or measured


def _anchors(manifest: JobManifest, config: OrchestratorConfig) -> tuple[bytes, ...]:
    """The certificates release signatures count under: the ones the manifest names (each holder's
    own, checked again by its fingerprint at the end), else the anchors the measurement binds."""
    pki = CohortPki.load(config.pki_dir)
    held = holder_anchors(pki.ca_pem, pki.member(NAME).cert_pem)
    named = manifest.release.certificates
    if named:
        pinned = {hashlib.sha384(der).hexdigest(): der for der in held}
        missing = [h for h, fp in sorted(named.items()) if fp not in pinned]
        if missing:  # early and in words; what counts is checked on each holder's TLS certificate at the end
            raise BadInput(f"release.certificates names holder {missing[0]!r}'s certificate, but this orchestrator "
                           "pins no such certificate: run the job on the cohort whose holders made them")
        return tuple(pinned[fp] for fp in named.values())
    if not config.anchors_sha384 or anchors_digest(held) != config.anchors_sha384:
        raise BadInput("the trust anchors in this orchestrator's pki directory are not the ones its measurement "
                       "binds (anchors_sha384): release signatures would count under someone else's; on the "
                       "deployed services the manifest names each holder's certificate (job init --cohort D)")
    return held


def _step(event: Any, quiet: bool) -> TrainStep:
    """A step as the launcher hears it; `quiet` (the manifest keeps metrics in): no loss, no evaluation."""
    fields = dataclasses.asdict(event)
    if quiet:
        fields.update(loss=math.nan, evaluated={})
    return TrainStep(**fields)


def _metrics(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The held-out metrics each holder hears at the end: per holder and over all, numbers only."""
    found = report.get("eval") or {}
    out = {name: dict(m) for name, m in (found.get("per_holder") or {}).items()}
    if found.get("all"):
        out["all"] = dict(found["all"])
    return out


def _allowed(report: dict[str, Any], ending: Ending | None) -> dict[str, Any]:
    """The report, less what the manifest does not let leave: metrics (losses, evaluations) and samples."""
    if ending is None:
        return report
    outputs = ending.manifest.outputs
    if not outputs.metrics:  # how many steps ran stays (a stopped job resumes there), their values go
        for key in ("eval", "eval_history", "final_loss", "loss_before", "loss_after"):
            report[key] = None
        report["losses"] = [None] * len(report["losses"])
    if not outputs.samples:
        report["sample"] = ""
    return report


def _cut(hello: Any, records: bool) -> Any:
    """How a holder's dataset travels, from its hello (checked when it was enrolled)."""
    from gputravel.data.records import RecordSchema, Units  # lazy: numpy, for training only
    from gputravel.train.loader import Cut  # lazy: torch, for training only

    if records != bool(hello.schema):
        raise BadInput(f"holder {hello.holder!r} holds {'records' if hello.schema else 'tokens'}, "
                       f"the job trains on {'records' if records else 'tokens'}")
    digest = hashlib.sha256(repr(_what_travels(hello)).encode()).hexdigest()
    if not records:
        return replace(Cut.tokens(hello.dataset_bytes), digest=digest)
    schema = RecordSchema.from_json(hello.schema)
    return Cut(Units(schema.record_bytes, hello.piece_bytes), hello.train_records, hello.eval_records, schema.dtype,
               digest)


class _ShutdownAsked:
    """Has the launcher asked this CVM to shut down? Asked between steps, so it stops checkpointed."""

    def __init__(self, control: Transport) -> None:
        self.control, self.asked = control, False

    def __call__(self) -> bool:
        if not self.asked and _readable(self.control.fileno()):
            msg = self.control.recv(timeout=1).message
            self.asked = isinstance(msg, Shutdown)
            if not self.asked:
                log.warning("ignored %s during training", type(msg).__name__)
        return self.asked


def _ranks(orch: Orchestrator, cmd: Train) -> Ranks | None:
    """This CVM as one rank of a data-parallel job (None: alone); peers attested before any gradient."""
    if cmd.world_size == 1 and cmd.rank == 0:
        return None
    from gputravel.train.ranks import Ranks  # lazy: torch, for training only

    host, _, port = cmd.master.rpartition(":")
    if not host or not port.isdigit() or not 0 <= cmd.rank < cmd.world_size:
        raise BadInput(f"rank {cmd.rank} of {cmd.world_size} with rank 0 at {cmd.master!r}: expected host:port")
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=port)  # torch.distributed's env:// rendezvous
    os.environ["LOCAL_RANK"] = str(cmd.rank)  # every rank runs on this machine: a device, nothing more
    if cmd.ifname:  # a server's link to the others (cohort/gpus.py), not its holders' star
        os.environ["GLOO_SOCKET_IFNAME"] = cmd.ifname
    if len(cmd.shares) != cmd.world_size or not set(orch.holders) <= set(cmd.shares[cmd.rank]):
        raise BadInput(f"rank {cmd.rank}'s holders ({', '.join(sorted(orch.holders))}) are not its share of the job")
    material = OrchestratorMaterial.load(orch.config.trust_dir)
    tee = QuotingRankTee(partial(request_quote, material.quoting_socket), material.trust)
    resumed = _checkpoint_digest(cmd.resume_checkpoint)
    return Ranks(rank=cmd.rank, world_size=cmd.world_size, attest=tee.attest, verify=tee.verify,
                 context=_job_context(cmd, resumed), shares=cmd.shares, resume_sha384=resumed)


def _checkpoint_digest(path: str) -> bytes:
    """SHA-384 of the checkpoint to resume (the loop loads only bytes with this digest)."""
    if not path:
        return b""
    try:
        return hashlib.sha384(Path(path).read_bytes()).digest()
    except OSError as exc:
        raise BadInput(f"no checkpoint at {path}: {exc.strerror}") from None


def _job_context(cmd: Train, resumed: bytes) -> bytes:
    """What the ranks' pair keys are bound to: the launcher's context and the job (settings,
    checkpoint, every rank's holders), so ranks told different jobs refuse each other's quotes."""
    job = json.dumps({"config": json.loads(cmd.config_json), "shares": cmd.shares, "checkpoint": resumed.hex()},
                     sort_keys=True)
    return b"gputravel ranks v1\0" + hashlib.sha384(hashlib.sha384(cmd.ranks_context).digest() + job.encode()).digest()


def serve(config: OrchestratorConfig, control: Transport, device_link: socket.socket) -> None:
    orch = Orchestrator.from_config(config, device_link)
    try:  # a boot that fails closes the links too
        orch.boot()
        membership = Membership(orch)  # who has the GPU between travels: kept across commands
        control.send(Ready(role=NAME, detail={"port": orch.listener.port}))
        while True:
            cmd = control.recv().message
            if isinstance(cmd, Shutdown):
                return
            try:
                if isinstance(cmd, AwaitHolders):
                    asked = _ShutdownAsked(control)  # a launcher that saw a holder refuse us stops the wait
                    joined = orch.await_holders(cmd.names, cmd.timeout, membership.probe_over,
                                                stop=(control.fileno(), asked))
                    if joined is None:
                        return
                    control.send(Holders(dataset_bytes=joined))
                elif isinstance(cmd, DoBaseline):
                    control.send(orch.baseline(cmd.holder, cmd.dataset_offset))
                elif isinstance(cmd, DoTravel):
                    control.send(orch.travel(cmd.holder, cmd.dataset_offset))
                elif isinstance(cmd, ORCHESTRATOR_COMMANDS):  # join and leave (orchestrator/membership.py)
                    control.send(membership.command(cmd))
                elif isinstance(cmd, Train):
                    try:
                        report = run_training(orch, cmd, control, membership)
                    except GputravelError:
                        raise
                    except Exception as exc:  # a bug, or torch refusing a record: its words may quote one
                        raise LocalError(f"training failed: {failed_where(exc)}") from None
                    if not report["stopped"]:  # the job is done (stopped: it resumes, the log goes on)
                        orch.job_done()  # the signed closing entry, before anyone is told it is done
                    control.send(TrainDone(report_json=json.dumps(report)))
                    if report["stopped"]:  # it was asked to shut down while it trained
                        return
                else:
                    control.send(Failed(kind="ProtocolError", reason=f"unknown command {type(cmd).__name__}"))
            except GputravelError as exc:
                control.send(Failed(kind=type(exc).__name__, reason=str(exc)))
    finally:
        orch.close()
