"""A cohort's job with a manifest (issue 28, docs/deploy.md): each signer and the key broker make
their own identity in their own state directory (`gputravel cohort identity`), the manifest names
them, and `gputravel cohort job` sets it as the orchestrator's job. So nobody who ran `cohort init`
holds a key that signs a holder's release or opens the sealed model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from gputravel.broker.state import SECRET_FILE, broker_public_key, broker_secret
from gputravel.crypto.pki import self_signed_member
from gputravel.errors import BadInput
from gputravel.files import atomic_write_bytes, read_plain
from gputravel.manifest import key_fingerprint
from gputravel.cohort.trust import measure_orchestrator
from gputravel.service.config import (BROKER, BrokerService, HolderService, JobSection, OrchestratorService,
                                      load_service, orchestrator_engine_config)
from gputravel.service.budget import approve_within_budget
from gputravel.service.init import write_service
from gputravel.service.party import as_party, own_state, private_dir, publish_certificate, refuse_planted
from gputravel.service.registry import bind
from gputravel.service.status import HOLDER_PKI, party_name

if TYPE_CHECKING:
    from gputravel.manifest import JobManifest

__all__ = ["BROKER_PUBLIC", "Identity", "cohort_parties", "make_identity", "published_parties", "set_job"]

BROKER_PUBLIC = f"{BROKER}.pub"  # in public/: the key broker's identity, hex (what a manifest's broker.identity holds)
_MAX_KEY_TEXT = 1024


@dataclass(frozen=True)
class Identity:
    party: str
    what: str  # "certificate" (a holder's, SHA-384 of its DER) or "key" (the broker's, hex)
    value: str
    published: Path
    kept: bool  # made at an earlier call or start, not now

    @property
    def fingerprint(self) -> str:
        """What its peers compare out of band: the certificate's SHA-384, or the broker key's sha256: fingerprint."""
        return self.value if self.what == "certificate" else key_fingerprint(bytes.fromhex(self.value))


def certificate_sha384(pem: bytes) -> str:
    """The SHA-384 (hex) of a PEM certificate's DER: what a manifest's release.certificates holds."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        raise BadInput("not a PEM certificate") from None
    return hashlib.sha384(cert.public_bytes(Encoding.DER)).hexdigest()


def make_identity(config: str | Path) -> Identity:
    """The identity of the party whose config this is, made in its own state directory as its
    service would at first start (a restart keeps it), and its public half published in public/."""
    cfg = load_service(Path(config))
    bind(cfg, party_name(cfg))  # the party cohort init made, or nothing is touched
    if not isinstance(cfg, (HolderService, BrokerService)):
        raise BadInput(f"{config}: only a holder and the key broker make an identity a job manifest names, "
                       f"not the {cfg.party}")
    state = private_dir(cfg.state_dir)
    refuse_planted(state, cfg.uid)
    own_state(state, cfg.uid)
    public = Path(cfg.public_dir) if isinstance(cfg, HolderService) else Path(cfg.cohort_dir) / "public"
    if isinstance(cfg, HolderService):
        with as_party(cfg.uid):  # inside the holder's own tree: as the holder
            pki = private_dir(state / HOLDER_PKI)
            kept = (pki / f"{cfg.name}.key").exists()
            pem = self_signed_member(pki, cfg.name)
        dest = public / f"holder-{cfg.name}.pem"
        publish_certificate(pki / f"{cfg.name}.pem", dest, cfg.name, cfg.uid)
        return Identity(f"holder-{cfg.name}", "certificate", certificate_sha384(pem), dest, kept)
    with as_party(cfg.uid):
        kept = (state / SECRET_FILE).exists()
        broker_secret(state)
        key = broker_public_key(state)
    dest = public / BROKER_PUBLIC
    atomic_write_bytes(dest, (key + "\n").encode())
    return Identity(BROKER, "key", key, dest, kept)


def published_parties(cohort: str | Path, holders: Sequence[str]) -> tuple[dict[str, str], str]:
    """Each holder's published certificate's SHA-384 and the key broker's published key, from the
    cohort's public/; BadInput naming a party that has not made its identity yet."""
    public = Path(cohort) / "public"
    certificates = {}
    for name in holders:
        path = public / f"holder-{name}.pem"
        try:
            certificates[name] = certificate_sha384(read_plain(path, 1 << 16))
        except (OSError, BadInput):
            raise BadInput(f"holder {name!r} has published no certificate at {path}: it makes its identity with "
                           f"`gputravel cohort identity --config {Path(cohort) / f'holder-{name}.toml'}`") from None
    path = public / BROKER_PUBLIC
    try:
        key = read_plain(path, _MAX_KEY_TEXT).decode().strip()
    except (OSError, UnicodeDecodeError):
        raise BadInput(f"the key broker has published no key at {path}: it makes its identity with "
                       f"`gputravel cohort identity --config {Path(cohort) / f'{BROKER}.toml'}`") from None
    return certificates, key


def cohort_parties(cohort: str | Path) -> dict[str, Any]:
    """The cohort's services, by party name, read from its config files."""
    d = Path(cohort)
    found = {}
    for path in sorted(d.glob("*.toml")):
        cfg = load_service(path)
        found[cfg.name if isinstance(cfg, HolderService) else party_name(cfg)] = (path, cfg)
    if not any(isinstance(c, OrchestratorService) for _, c in found.values()):
        raise BadInput(f"{d}: no orchestrator config; is it a cohort `gputravel cohort init` wrote?")
    return found


def set_job(cohort: str | Path, manifest: JobManifest, *, job: Mapping[str, object] | None = None,
            approve: Sequence[str] = (), decline: Sequence[str] = ()) -> list[Path]:
    """Make `manifest` the cohort's job: its [job] table (and `job`, the workload's code) in the
    orchestrator's config, its digest in RTMR[3] at the next start; the holders' held-out share set
    to its own. Those in `approve` approve it here (a demo standing for each holder), those in
    `decline` decline to sign its release. The manifest must name the parties' published identities."""
    d = Path(cohort).resolve()
    parties = cohort_parties(d)
    orchestrators = [(p, c) for p, c in parties.values() if isinstance(c, OrchestratorService)]
    holders = {c.name: (p, c) for p, c in parties.values() if isinstance(c, HolderService)}
    _check(manifest, d, len(orchestrators), list(holders), [*approve, *decline])
    for name in approve:  # every cap checked before any ledger or config is written
        approve_within_budget(holders[name][1], manifest, record=False)
    written = []
    for path, orch in orchestrators:
        fields = {**orch.job.model_dump(), **(job or {}), **manifest.job.model_dump()}
        section = JobSection.model_validate(fields)
        new = orch.model_copy(update={"job": section, "manifest_json": manifest.to_json()})
        _same_measurement(orch, new, d)
        written.append(write_service(path, new))
    digest = manifest.digest_hex()
    for name, (path, holder) in holders.items():
        # A holder's config is its own: only a demo standing for it approves or declines for it here.
        if name not in approve and name not in decline:
            continue
        update: dict[str, Any] = {"sign_release": name not in decline}
        if name in approve:
            approve_within_budget(holder, manifest, record=True)  # the demo approves as the holder would
            jobs = [digest]  # this job alone: not the job init approved, which no ledger counts
            update.update(eval_share=manifest.evaluation.share,
                          policy=holder.policy.model_copy(update={"approved_jobs": jobs}))
        written.append(write_service(path, holder.model_copy(update=update)))
    return written


def _same_measurement(old: OrchestratorService, new: OrchestratorService, d: Path) -> None:
    """The job's settings that the orchestrator's MRTD covers (its buffer, tokenizer, schema) stay
    those its holders and broker pinned at init: else the job could never attest, refused here."""
    def measured(cfg: OrchestratorService) -> bytes:
        return measure_orchestrator(orchestrator_engine_config(cfg, pki_dir="", trust_dir=""))

    if measured(old) != measured(new):
        keys = [f"job.{k}" for k in ("buffer_bytes", "tokenizer", "record_schema")
                if getattr(old.job, k) != getattr(new.job, k)]
        raise BadInput(f"the manifest's {', '.join(keys) or 'job'} moves the orchestrator's measurement, which the "
                       f"holders and the key broker of {d} pinned at init: init a cohort with these settings")


def _check(manifest: JobManifest, d: Path, orchestrators: int, holders: list[str], named: list[str]) -> None:
    if sorted(manifest.release.holders) != sorted(holders):  # the orchestrator admits only holders it names
        raise BadInput(f"release.holders: expected every holder of the cohort in {d} ({', '.join(holders)}): each "
                       f"joins only under the certificate the manifest names for it, got {manifest.release.holders}")
    if orchestrators != 1:
        raise BadInput(f"{d}: a job with a manifest trains on one GPU (its release gathers every holder's "
                       f"signature in one orchestrator); this cohort has {orchestrators}")
    for who in [*manifest.release.holders, *named]:
        if who not in holders:
            raise BadInput(f"{who!r} is not a holder of the cohort in {d} ({', '.join(holders)})")
    certificates, key = published_parties(d, manifest.release.holders)
    if manifest.release.certificates != certificates or manifest.broker.identity != key:
        wrong = [f"release.certificates.{h}" for h in manifest.release.holders
                 if manifest.release.certificates.get(h) != certificates[h]]
        wrong += ["broker.identity"] if manifest.broker.identity != key else []
        raise BadInput(f"the manifest's {', '.join(wrong)} is not what the cohort's parties published in {d / 'public'}"
                       f": write it with `gputravel job init --cohort {d}`, after each holder and the key broker "
                       "made its identity (`gputravel cohort identity`)")
