"""`gputravel job init | show | digest | approve`: write a job manifest, review it, print its digest,
and add it to a holder's policy (issue 28). A holder sends data only to a job whose digest it approved."""

from __future__ import annotations

import enum
import math
import tomllib
from pathlib import Path
from typing import Optional

import tomli_w
import typer

from gputravel.cli.output import Commands, console, name_values, named_subcommand
from gputravel.cli.train import workload_job
from gputravel.errors import BadInput
from gputravel.files import RECORDS, TOKENS, atomic_write_bytes
from gputravel.manifest import JobManifest, Outputs, Recipient, load_manifest, schema_digest, write_manifest
from gputravel.service.config import HolderService, load_service, validate_service
from gputravel.service.job import cohort_parties, published_parties
from gputravel.service.budget import approve_within_budget, unbounded_why
from gputravel.service.vouch import Pins, vouch
from gputravel.train.job import TrainConfig

job_app = typer.Typer(pretty_exceptions_show_locals=False, add_completion=False, no_args_is_help=True, cls=Commands, callback=named_subcommand,
                      help="Job manifests: what a holder approves by digest, and what may leave the orchestrator.")
JOB = TrainConfig()
MAX_KEY_FILE = 4 << 10  # a NAME.pub is 65 bytes


class ModelOutput(str, enum.Enum):  # --model's choices (outputs.model)
    release = "release"
    sealed = "sealed"


def _names(value: str) -> list[str]:
    return [n.strip() for n in value.split(",") if n.strip()]


def _recipient(item: str) -> Recipient:
    """--recipient NAME=PUBFILE: PUBFILE holds the raw X25519 key in hex (`gputravel model keygen`'s NAME.pub)."""
    name, sep, file = item.partition("=")
    if not sep or not name or not file:
        raise BadInput(f"--recipient takes NAME=PUBFILE, got {item!r}")
    path = Path(file)
    if not path.is_file():
        raise BadInput(f"--recipient {name}: {path} is not a file")
    text = path.read_bytes()[:MAX_KEY_FILE].decode(errors="replace").strip()
    if len(text) != 64:
        raise BadInput(f"--recipient {name}: {path} does not hold a raw X25519 public key in 64 hex digits "
                       "(as `gputravel model keygen` writes NAME.pub)")
    try:
        return Recipient.of(name, text.lower())
    except BadInput as exc:
        raise BadInput(f"--recipient {name} ({path}): {exc}") from None


def _schema(path: Path) -> str:
    """--schema-from: a holder's packed dataset directory, or its schema.json; the schema's canonical JSON."""
    from gputravel.data.records import SCHEMA_FILE, RecordSchema  # lazy: numpy

    file = path / SCHEMA_FILE if path.is_dir() else path
    if not file.is_file():
        raise BadInput(f"--schema-from {path}: no {SCHEMA_FILE} there (a dataset `gputravel data pack` wrote)")
    try:
        return RecordSchema.from_json(file.read_text()).canonical_json()
    except BadInput as exc:
        raise BadInput(f"--schema-from {file}: {exc}") from None
    except UnicodeDecodeError:
        raise BadInput(f"--schema-from {file}: not UTF-8 text") from None


def _train_config(workload: str, script: bool, schema_from: Optional[Path], **settings: object) -> TrainConfig:
    job = workload_job(workload)
    if script:
        if "workload_code" not in job:
            raise BadInput("--script: expected --workload to name the training script's .py file")
        job["script"] = True  # type: ignore[assignment]
    cfg = TrainConfig(**job, **settings)
    if cfg.records and schema_from is None:
        raise BadInput(f"--schema-from: workload {cfg.workload!r} trains on records: name a holder's packed "
                       "dataset (or its schema.json), whose schema the job pins")
    if not cfg.records and schema_from is not None:
        raise BadInput("--schema-from: gpt2 trains on tokens, which have no record schema")
    return cfg.replace(record_schema=_schema(schema_from)) if schema_from is not None else cfg


def _signers(holders: Optional[str], cohort: Optional[Path]) -> tuple[list[str], dict[str, str], str]:
    """The signers, and with --cohort their published certificates' digests and the key broker's key."""
    if cohort is None:
        if holders is None:
            raise BadInput("--holders: name the holders who may sign (or give --cohort)")
        return _names(holders), {}, ""
    members = [c.name for _, c in cohort_parties(cohort).values() if isinstance(c, HolderService)]
    names = members if holders is None else _names(holders)
    strangers = [n for n in names if n not in members]
    if strangers:
        raise BadInput(f"--holders: {strangers[0]!r} is not a holder of the cohort in {cohort} ({', '.join(members)})")
    certificates, key = published_parties(cohort, names)
    return names, certificates, key


@job_app.command()
def init(
    out: Path = typer.Option(..., "--out", "-o", help="The manifest to write (TOML)."),
    holders: Optional[str] = typer.Option(None, help="The holders who may sign the model's release, comma separated "
                                                     "(default with --cohort: every holder of it)."),
    cohort: Optional[Path] = typer.Option(None, help="The deployed cohort (`gputravel cohort init`) the job runs on: "
                                                     "the manifest names each signer's certificate and the key broker "
                                                     "as they published them (`gputravel cohort identity`)."),
    quorum: Optional[int] = typer.Option(None, help="How many of them must sign (k of n); default: a majority."),
    recipients: Optional[list[str]] = typer.Option(None, "--recipient", help="NAME=PUBFILE: a recipient of the "
                                                   "model and its X25519 key (`gputravel model keygen`); repeatable."),
    workload: str = typer.Option(JOB.workload, help="gpt2, image, tabular, or a workload .py file (its SHA-384 "
                                                    "is pinned)."),
    script: bool = typer.Option(False, help="--workload's file is a training script with its own loop."),
    schema_from: Optional[Path] = typer.Option(None, help="A holder's packed record dataset (or its schema.json): "
                                                          "the schema a records job pins."),
    steps: int = typer.Option(JOB.steps),
    batch: int = typer.Option(JOB.batch),
    lr: float = typer.Option(JOB.lr),
    eval_every: int = typer.Option(JOB.eval_every),
    dp_epsilon: float = typer.Option(JOB.dp_epsilon, help="DP-SGD's target epsilon (0: no DP; docs/privacy.md)."),
    dp_delta: float = typer.Option(JOB.dp_delta, help="DP-SGD's delta."),
    dp_clip: float = typer.Option(JOB.dp_max_grad_norm, help="DP-SGD's clipping norm for each example's gradient."),
    dp_accountant: str = typer.Option(JOB.dp_accountant, help="How DP-SGD's privacy is counted: rdp or prv (gdp "
                                                              "can undercount and is refused with DP)."),
    resident_mib: int = typer.Option(JOB.resident_mib, help="MiB of travelled records the orchestrator keeps in "
                                     "its memory for the job's steps (a kept visit does not travel again); 0: none."),
    shuffle: str = typer.Option(JOB.shuffle, help="Records: visit (within each travel) or all (one shuffle over "
                                                  "every holder's records an epoch; --resident-mib must hold them)."),
    metrics: bool = typer.Option(True, "--metrics/--no-metrics", help="Write the losses and evaluations to the "
                                 "run directory (outputs.metrics); DP-SGD does not cover them, so a holder with an "
                                 "epsilon cap counts a job that writes them as unbounded."),
    model: ModelOutput = typer.Option(ModelOutput.release, help="release: to the recipients once a quorum of "
                                                                "holders signs; sealed: kept sealed to the orchestrator."),
    force: bool = typer.Option(False, help="Replace --out if it exists."),
) -> None:
    """Write a job manifest; edit it, then `gputravel job show` it to the holders."""
    if out.exists() and not force:
        raise BadInput(f"--out {out}: exists; choose another path or replace it (--force)")
    cfg = _train_config(workload, script, schema_from, steps=steps, batch=batch, lr=lr, eval_every=eval_every,
                        dp_epsilon=dp_epsilon, dp_delta=dp_delta, dp_max_grad_norm=dp_clip, dp_accountant=dp_accountant,
                        resident_mib=resident_mib, shuffle=shuffle)
    names, certificates, broker_key = _signers(holders, cohort)
    m = JobManifest.for_job(cfg, holders=names, quorum=len(names) // 2 + 1 if quorum is None else quorum,
                            recipients=[_recipient(r) for r in recipients or ()],
                            outputs=Outputs(model=model.value, metrics=metrics), certificates=certificates,
                            broker_key=broker_key)
    write_manifest(out, m, force=force)
    typer.echo(f"wrote {out}: job {m.digest_hex()}")


@job_app.command()
def show(manifest: Path = typer.Argument(..., help="The job manifest (TOML).")) -> None:
    """What the manifest says, as a holder reviews it before approving, and its digest."""
    typer.echo(load_manifest(manifest).describe())


@job_app.command()
def digest(manifest: Path = typer.Argument(..., help="The job manifest (TOML).")) -> None:
    """The manifest's digest: 96 hex digits, nothing else (what RTMR[3] is extended with)."""
    typer.echo(load_manifest(manifest).digest_hex())


def _check_holder(m: JobManifest, where: Path, cfg: HolderService, source: Path) -> None:
    """A holder approves only a job it may sign for, holding out what the job evaluates on, over its data."""
    if cfg.name not in m.release.holders:
        raise BadInput(f"{source}: name: {cfg.name!r} is not among {where}'s release.holders "
                       f"({', '.join(m.release.holders)})")
    if cfg.eval_share != m.evaluation.share:
        raise BadInput(f"{source}: eval_share: {cfg.eval_share:g} differs from {where}'s evaluation.share "
                       f"{m.evaluation.share:g}: the job would evaluate on another held-out share")
    wanted = RECORDS if m.data.schema_digest else TOKENS
    if cfg.format != wanted:
        raise BadInput(f"{source}: format: {cfg.format!r}, but {where}'s job trains on {wanted}")
    theirs = Path(cfg.data) / "schema.json"
    if wanted == RECORDS and theirs.is_file():  # where the data lives: the job must read it as it is
        ours = _schema(theirs)
        if schema_digest(ours) != m.data.schema_digest:
            raise BadInput(f"{source}: data: its records' schema ({schema_digest(ours)[:16]}...) is not "
                           f"{where}'s data.schema ({m.data.schema_digest[:16]}...)")


def _approval(path: Path, digest_hex: str, pins: Pins) -> bytes:
    """The holder config with `digest_hex` in [policy] approved_jobs and the pins confirmed, every
    other key kept; checked to load before anything is written."""
    raw = tomllib.loads(path.read_text())
    policy = raw.setdefault("policy", {})
    policy.setdefault("approved_jobs", []).append(digest_hex)
    policy.update(known_broker=pins.broker, known_signers=dict(sorted(pins.signers.items())),
                  known_recipients=dict(sorted(pins.recipients.items())))
    validate_service(raw, str(path), "holder")  # what is written still loads
    return tomli_w.dumps(raw).encode()


@job_app.command()
def approve(
    manifest: Path = typer.Argument(..., help="The job manifest (TOML)."),
    holder_config: Path = typer.Option(..., help="This holder's service config (TOML): its [policy] gains "
                                                 "the job's digest."),
    expected: Optional[str] = typer.Option(None, "--digest", help="The digest you were told: refused if the "
                                                                 "manifest's differs."),
    broker: Optional[str] = typer.Option(None, help="The key broker's fingerprint (sha256:...) as its operator told "
                                                    "you; kept in [policy] known_broker for later jobs."),
    signers: Optional[list[str]] = typer.Option(None, "--signer", help="NAME=SHA384: another signer's certificate "
                                                "as that holder told you (32 hex digits at least); repeatable, "
                                                "kept in [policy] known_signers."),
    recipients: Optional[list[str]] = typer.Option(None, "--recipient", help="NAME=FINGERPRINT: a recipient's key "
                                                   "(sha256:..., as `job show` prints it) as that recipient told you; "
                                                   "repeatable, kept in [policy] known_recipients."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Approve without asking (after showing the manifest)."),
) -> None:
    """Show the manifest, then add its digest to this holder's approved jobs: its data goes to no other job."""
    m = load_manifest(manifest)
    if expected is not None and expected.strip().lower() != m.digest_hex():
        raise BadInput(f"{manifest}: its digest {m.digest_hex()} is not the --digest given ({expected.strip()[:96]}): "
                       "approve only the job you were told of")
    cfg = load_service(holder_config, "holder")
    assert isinstance(cfg, HolderService)  # load_service checked the party
    _check_holder(m, manifest, cfg, holder_config)
    pins = vouch(m, manifest, cfg, holder_config, broker, name_values(signers or (), "--signer"),
                 name_values(recipients or (), "--recipient"))
    approve_within_budget(cfg, m, record=False)  # past its epsilon cap: refused before it is asked
    typer.echo(m.describe())
    typer.echo("\n".join(["confirmed", *(f"  {line}" for line in pins.told)]))
    if m.digest_hex() in cfg.policy.approved_jobs:
        typer.echo(f"{cfg.name} already approves job {m.digest_hex()}")
        return
    if not yes and not typer.confirm(f"approve this job for {cfg.name}'s data?", default=False):
        console.print("not approved: nothing changed")
        raise typer.Exit(1)
    written = _approval(holder_config, m.digest_hex(), pins)
    epsilon = approve_within_budget(cfg, m, record=True)  # in the signed ledger before the policy lists it
    atomic_write_bytes(holder_config, written)
    typer.echo(f"{cfg.name} approves job {m.digest_hex()} ({holder_config} [policy] approved_jobs)")
    spent = f"unbounded ({unbounded_why(m)})" if math.isinf(epsilon) else f"{epsilon:g}"
    cap = cfg.policy.epsilon_cap
    typer.echo(f"  its privacy ledger counts epsilon {spent} for it"
               + ("" if math.isinf(cap) else f", against a cap of {cap:g}"))
