"""A data holder's answer when the job is done (issue 28): it reads the held-out metrics it is sent,
and signs the release only of the job it attested (RTMR[3]) and approved, to exactly the recipients
that job's manifest names. Anything else is declined, with the reason; its data never leaves here.
"""

from __future__ import annotations

from gputravel.errors import BadInput, GputravelError
from gputravel.manifest import JobManifest
from gputravel.protocol.codec import decode, encode
from gputravel.protocol.travel import JobResults, ReleaseDeclined, ReleaseSigned
from gputravel.release import ReleaseStatement, sign_release

__all__ = ["answer_results", "summary"]


def answer_results(msg: JobResults, *, name: str, attested_job: bytes | None, key_pem: bytes,
                   sign: bool) -> ReleaseSigned | ReleaseDeclined:
    """Sign `msg`'s release statement with our TLS key (`key_pem`) or say why not."""
    if not msg.statement:
        return ReleaseDeclined(reason="nothing to sign: the job keeps its model sealed")
    try:
        statement = _release_of(msg, name, attested_job)
    except GputravelError as exc:
        return ReleaseDeclined(reason=str(exc))
    if not sign:
        return ReleaseDeclined(reason=f"holder {name!r} declines to release this model (its config: sign_release "
                                      "= false)")
    return ReleaseSigned(signature=encode(sign_release(statement, name, key_pem)))


def _release_of(msg: JobResults, name: str, attested_job: bytes | None) -> ReleaseStatement:
    """The statement, once it is shown to be the release our approved, attested job allows."""
    if attested_job is None:
        raise BadInput("no attested job: nothing is signed")
    manifest = JobManifest.from_json(msg.manifest_json)
    if manifest.digest() != attested_job:
        raise BadInput(f"the manifest sent is job {manifest.digest_hex()[:16]}..., not the job "
                       f"{attested_job.hex()[:16]}... this holder attested")
    statement = decode(msg.statement, expect=ReleaseStatement)
    assert isinstance(statement, ReleaseStatement)
    if statement.job_digest != attested_job:
        raise BadInput(f"the release names job {statement.job_digest.hex()[:16]}..., not the one this holder "
                       "attested")
    if manifest.outputs.model != "release":
        raise BadInput("the job's manifest keeps the model sealed: it names no release")
    if name not in manifest.release.holders:
        raise BadInput(f"holder {name!r} is not among those the manifest lets sign")
    if dict(statement.recipients) != manifest.recipient_keys():
        raise BadInput("the release names other recipients or keys than the manifest the holder approved")
    return statement


def summary(metrics: dict[str, dict[str, float]]) -> str:
    """The metrics as one line for the holder's log: numbers, nothing of any record."""
    return "; ".join(f"{who}: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(m.items()))
                     for who, m in sorted(metrics.items()))
