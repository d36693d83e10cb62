"""A holder signs the release only of the job it attested, to exactly the recipients that job's
manifest names (holder/release.py); anything else is declined with the reason."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gputravel.holder.release import answer_results, summary
from gputravel.manifest import JobManifest, Outputs
from gputravel.protocol.codec import decode, encode
from gputravel.protocol.travel import JobResults, ReleaseDeclined, ReleaseSigned
from gputravel.release import ReleaseSignature, ReleaseStatement, raw_public
from gputravel.train.job import TrainConfig

HOLDERS = ("h1", "h2", "h3")
ALICE = raw_public(X25519PrivateKey.generate())
KEY = ec.generate_private_key(ec.SECP384R1()).private_bytes(
    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _manifest(**changes: object) -> JobManifest:
    cfg = TrainConfig(steps=int(changes.pop("steps", 10)))
    return JobManifest.for_job(cfg, holders=HOLDERS, quorum=2, recipients=[("alice", ALICE)], **changes)  # type: ignore[arg-type]


def _asked(manifest: JobManifest, statement: ReleaseStatement | None) -> JobResults:
    return JobResults(metrics={"h1": {"loss": 0.5}}, manifest_json=manifest.to_json(),
                      statement=encode(statement) if statement is not None else b"")


def _statement(job: bytes, recipients: list[tuple[str, bytes]] | None = None) -> ReleaseStatement:
    return ReleaseStatement.of(b"weights", job, recipients or [("alice", ALICE)])


def _answer(msg: JobResults, job: bytes | None, name: str = "h1", sign: bool = True) -> object:
    return answer_results(msg, name=name, attested_job=job, key_pem=KEY, sign=sign)


def test_a_holder_signs_exactly_the_release_of_the_job_it_attested() -> None:
    m = _manifest()
    statement = _statement(m.digest())
    reply = _answer(_asked(m, statement), m.digest())
    assert isinstance(reply, ReleaseSigned)
    sig = decode(reply.signature, expect=ReleaseSignature)
    assert sig.holder == "h1" and sig.statement == statement.digest()


@pytest.mark.parametrize("case", ["other-manifest", "statement-of-another-job", "other-recipient", "not-a-signer",
                                  "no-attested-job", "declines"])
def test_anything_but_its_approved_release_is_declined_with_the_reason(case: str) -> None:
    m, other = _manifest(), _manifest(steps=11)
    msg, job, name, sign, why = _asked(m, _statement(m.digest())), m.digest(), "h1", True, ""
    if case == "other-manifest":  # the manifest sent is not the job this holder attested
        msg, why = _asked(other, _statement(m.digest())), "not the job"
    elif case == "statement-of-another-job":
        msg, why = _asked(m, _statement(other.digest())), "names job"
    elif case == "other-recipient":
        mallory = raw_public(X25519PrivateKey.generate())
        msg, why = _asked(m, _statement(m.digest(), [("alice", mallory)])), "other recipients"
    elif case == "not-a-signer":
        name, why = "h9", "not among"
    elif case == "no-attested-job":
        job, why = None, "no attested job"
    else:
        sign, why = False, "declines"
    reply = _answer(msg, job, name, sign)
    assert isinstance(reply, ReleaseDeclined) and why in reply.reason


def test_a_job_that_keeps_its_model_sealed_asks_for_no_signature() -> None:
    m = _manifest(outputs=Outputs(model="sealed"))
    assert isinstance(_answer(_asked(m, None), m.digest()), ReleaseDeclined)


def test_the_holders_log_line_holds_numbers_only() -> None:
    line = summary({"h1": {"loss": 0.51234, "accuracy": 0.9}, "all": {"loss": 0.6}})
    assert line == "all: loss 0.6; h1: accuracy 0.9, loss 0.5123"
