"""The end of a job with a manifest (issue 28): each holder hears its held-out metrics over its
TLS link and is asked to sign the release of exactly this model, job and recipients; the model is
sealed to the recipients only once the manifest's quorum of valid signatures is in. Until then,
and always, it is sealed to this orchestrator's own measurement and job (the key broker's "model"
key), so it can be released later without training again.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gputravel.errors import GputravelError
from gputravel.files import atomic_write_bytes
from gputravel.manifest import JobManifest
from gputravel.protocol.codec import decode, encode
from gputravel.protocol.travel import JobResults, ReleaseDeclined, ReleaseSigned
from gputravel.release import ReleaseRefused, ReleaseSignature, ReleaseStatement, seal_release, signature_verdicts
from gputravel.release.seal import anchors

if TYPE_CHECKING:
    from gputravel.orchestrator.travel_log import TravelLog
    from gputravel.train.rundir import Kept, Sealing
    from gputravel.transport.base import Transport

log = logging.getLogger(__name__)

SEALED_MODEL = "model.sealed"  # the model, sealed to this orchestrator's measurement and job
RELEASE_FILE = "model.release"  # the model, sealed to the manifest's recipients after the quorum


def anchors_digest(ders: list[bytes] | tuple[bytes, ...]) -> str:
    """The hex SHA-384 of a set of trust anchors (DER certificates, self-delimiting), in any order."""
    return hashlib.sha384(b"".join(sorted(ders))).hexdigest()


def holder_anchors(ca_pem: bytes, own_cert_pem: bytes) -> tuple[bytes, ...]:
    """The anchors of a ca.pem but our own certificate (a deployed member pins itself there too)."""
    own = set(anchors(own_cert_pem))
    return tuple(d for d in anchors(ca_pem) if d not in own)


@dataclass
class Outcome:
    """How the release went, for the report: names and counts, never a key."""

    statement: str = ""  # the statement's digest (hex); "": the manifest keeps the model sealed
    signed: list[str] = field(default_factory=list)
    declined: dict[str, str] = field(default_factory=dict)
    released_to: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {"statement": self.statement, "signed": sorted(self.signed), "declined": self.declined,
                "released_to": self.released_to, "files": self.files}


@dataclass(frozen=True)
class Ending:
    """What the end of the job works with, all of it the orchestrator CVM's own."""

    manifest: JobManifest
    job_digest: bytes
    anchors: tuple[bytes, ...]  # DER, bound by its measurement: a signature counts only under a certificate they issued
    seal_model: Sealing  # broker/seal.py Sealer for purpose "model"
    timeout: float
    kept: Kept  # what the run directory may hold meanwhile
    dp_secret: bytes | None = None  # the key broker's "dp" key for this measurement and job (a DP-SGD job)


def end_job(ending: Ending, weights: bytes, metrics: dict[str, dict[str, float]], holders: dict[str, Transport],
            run_dir: Path | None, travel_log: TravelLog | None) -> Outcome:
    """Seal the model to ourselves, tell each holder its results, ask for signatures, release on a quorum."""
    m, out = ending.manifest, Outcome()
    if run_dir is not None:
        path = run_dir / SEALED_MODEL
        atomic_write_bytes(path, ending.seal_model.seal(weights))
        out.files["sealed"] = str(path)
    statement = (ReleaseStatement.of(weights, ending.job_digest, m.recipient_keys())
                 if m.outputs.model == "release" else None)
    if statement is not None:
        out.statement = statement.digest().hex()
    asked = JobResults(metrics=metrics, manifest_json=m.to_json(),
                       statement=encode(statement) if statement is not None else b"")
    signatures, certificates = _collect(asked, holders, ending.timeout, out, dict(m.release.certificates))
    if statement is None:
        return out
    counted = _counted(statement, signatures, certificates, ending, travel_log)
    out.signed = counted
    if len(counted) < m.release.quorum:
        log.warning("release short of quorum: %d of %d signatures; the model stays sealed", len(counted),
                    m.release.quorum)
        return out
    try:
        blob = seal_release(weights, statement, [s for s in signatures if s.holder in counted], m.release.quorum,
                            holders=m.release.holders, certificates=certificates, ca_cert_der=ending.anchors)
    except ReleaseRefused as exc:
        log.warning("release refused: %s", exc)
        return out
    if run_dir is not None:
        path = run_dir / RELEASE_FILE
        atomic_write_bytes(path, blob)
        out.files["release"] = str(path)
    out.released_to = list(statement.recipient_names)
    if travel_log is not None:
        travel_log.released(statement.digest(), statement.recipient_names, tuple(counted))
    return out


def _collect(asked: JobResults, holders: dict[str, Transport], timeout: float, out: Outcome,
             asked_certificates: dict[str, str]) -> tuple[list[ReleaseSignature], dict[str, bytes]]:
    """Each holder's answer. A signature is kept under the name its TLS certificate proves, never the
    name it claims, and only if that certificate is the one the manifest names (where it names them);
    a holder that fails to answer declines."""
    signatures: list[ReleaseSignature] = []
    certificates: dict[str, bytes] = {}
    for name, conn in sorted(holders.items()):
        try:
            conn.send(asked)
            reply = conn.recv(timeout=timeout, expect=(ReleaseSigned, ReleaseDeclined)).message
            if isinstance(reply, ReleaseDeclined):
                out.declined[name] = reply.reason[:200]
                continue
            assert isinstance(reply, ReleaseSigned)
            sig = decode(reply.signature, expect=ReleaseSignature)
            if sig.holder != name:
                out.declined[name] = f"signed as {sig.holder!r}: not counted"
                continue
            cert = conn.peer_certificate()
            named = asked_certificates.get(name)
            if named is not None and hashlib.sha384(cert).hexdigest() != named:
                out.declined[name] = "its TLS certificate is not the one the manifest names: not counted"
                continue
            signatures.append(sig)
            certificates[name] = cert
        except GputravelError as exc:
            out.declined[name] = f"no answer ({type(exc).__name__})"
    return signatures, certificates


def _counted(statement: ReleaseStatement, signatures: list[ReleaseSignature], certificates: dict[str, bytes],
             ending: Ending, travel_log: TravelLog | None) -> list[str]:
    """The holders whose signature of exactly `statement` verifies, each logged as it is counted."""
    verdicts = signature_verdicts(statement, signatures, ending.manifest.release.holders, certificates,
                                  ending.anchors)
    counted = []
    for holder, why in verdicts:
        if why:
            log.warning("the release signature of %s does not count: %s", holder, why)
            continue
        counted.append(holder)
        if travel_log is not None:
            travel_log.release_signed(holder, statement.digest())
    return counted
