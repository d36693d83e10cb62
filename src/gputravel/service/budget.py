"""A holder's privacy budget on the deployed services (issue 29): its `[policy] epsilon_cap` caps
the epsilon every job it approves may spend of its data together, counted in its signed ledger
(holder/ledger.py) with its own TLS key. `job approve` (and a demo approving for it) refuses a job
past the cap; its service refuses to start on a ledger that does not verify, an approved job the
ledger lacks, or a total past the cap, so no byte leaves for such a job."""

from __future__ import annotations

import math
import time
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.crypto.certs import load_key
from gputravel.errors import BadInput
from gputravel.holder.ledger import LEDGER_FILE, PrivacyLedger, job_epsilon
from gputravel.manifest import JobManifest
from gputravel.service.config import HolderService
from gputravel.service.party import as_party
from gputravel.service.status import HOLDER_PKI

__all__ = ["approve_within_budget", "check_budget_at_start", "ledger_of", "manifest_epsilon"]


def _keys(cfg: HolderService) -> tuple[ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey]:
    pki = Path(cfg.state_dir) / HOLDER_PKI
    try:
        with as_party(cfg.uid):
            key = load_key((pki / f"{cfg.name}.key").read_bytes())
            cert = x509.load_pem_x509_certificate((pki / f"{cfg.name}.pem").read_bytes())
    except (OSError, ValueError):
        raise BadInput(f"holder {cfg.name!r} has no identity in {pki} to sign its privacy ledger with: make it "
                       "with `gputravel cohort identity`") from None
    public = cert.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise BadInput(f"holder {cfg.name!r}: its certificate's key is not an EC key")
    return key, public


def ledger_of(cfg: HolderService) -> PrivacyLedger:
    """The holder's ledger, verified under its own certificate's key; BadInput if it does not verify."""
    _, public = _keys(cfg)
    with as_party(cfg.uid):
        return PrivacyLedger.load(Path(cfg.state_dir) / LEDGER_FILE, public)


METRICS_WHY = "the job writes metrics (outputs.metrics), which DP-SGD does not cover"


def manifest_epsilon(m: JobManifest) -> float:
    """What job `m` may spend of a holder's data: its DP-SGD target; unbounded without DP-SGD, or where
    it writes metrics (per-step losses of its samples, which no epsilon covers: the third review)."""
    return job_epsilon(m.job.dp_epsilon) if not m.outputs.metrics else math.inf


def unbounded_why(m: JobManifest) -> str:
    """Why job `m` counts as unbounded: no DP-SGD, or a DP job that writes metrics."""
    return METRICS_WHY if m.job.dp_epsilon and m.outputs.metrics else "no DP-SGD"


def approve_within_budget(cfg: HolderService, m: JobManifest, *, record: bool) -> float:
    """The epsilon job `m` may spend of this holder's data, refused past its cap (BadInput, by how
    much); with `record`, the approval is written into its ledger."""
    epsilon = manifest_epsilon(m)
    ledger = ledger_of(cfg)
    ledger.check(cfg.name, m.digest_hex(), epsilon, cfg.policy.epsilon_cap,
                 why=METRICS_WHY if m.job.dp_epsilon and m.outputs.metrics else "")
    if record:
        key, _ = _keys(cfg)
        with as_party(cfg.uid):
            ledger.append(m.digest_hex(), epsilon, m.job.dp_delta, key, time.time())
    return epsilon


def check_budget_at_start(cfg: HolderService) -> None:
    """Before a holder's service sends anything: with a cap, every approved job is in its verified
    ledger and they spend no more than the cap together."""
    cap = cfg.policy.epsilon_cap
    if math.isinf(cap):
        return
    ledger = ledger_of(cfg)
    missing = ledger.missing(cfg.policy.approved_jobs)
    if missing:
        raise BadInput(f"holder {cfg.name!r}: approved job {missing[0][:16]}... is not in its privacy ledger: with an "
                       "epsilon_cap, nothing is sent to a job the ledger does not hold; remove it from [policy] "
                       "approved_jobs (cohort init approves the job alone, which has no DP), or approve it with "
                       "`gputravel job approve`, which counts its epsilon")
    spent = ledger.spent()
    if spent > cap:
        raise BadInput(f"holder {cfg.name!r}: the jobs in its ledger may spend epsilon {spent:g}, past its cap "
                       f"{cap:g}: {spent - cap:g} over")
