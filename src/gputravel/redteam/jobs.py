"""The red team's job rows (issue 28): what leaves the orchestrator is what every holder approved. They run
after the arena's rows, on cohorts of their own (redteam/jobarena.py): orchestrators launched for jobs the
holders did not approve, an approval replayed at the quote, the files a finished job leaves to the host,
its release opened, re-signed or short of signatures, and a foreign orchestrator resuming its checkpoint.
Each row returns whether the defence it names was seen to act; :func:`run_jobs` searches what it read."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from msgspec import structs

from gputravel.attest import AttestationError, Authority, EmulatedQuotingEnclave, Policy, TrustStore
from gputravel.attest import verify_bound_quote
from gputravel.attest.quote import ZERO_RTMRS, rtmr_after
from gputravel.attest.ratls import report_data_for_tls, spki_der
from gputravel.attest.roots import TEE_QUOTING_ROOT_CN
from gputravel.broker import is_sealed
from gputravel.crypto.certs import issue_certificate, new_key, subject_name
from gputravel.errors import GputravelError
from gputravel.orchestrator.release import RELEASE_FILE, SEALED_MODEL
from gputravel.redteam.arena import ALICE, BOB, MALLORY, Verdict
from gputravel.redteam.canary import Found
from gputravel.redteam.identities import operator_made_keys
from gputravel.redteam.evidence import (Control, FileRead, JobLog, Measured, Opened, Quoted, Released, Resumed,
                                        SealTried)
from gputravel.redteam.jobarena import JOB_HOLDERS, QUORUM, RECIPIENT, JobArena, JobAttack, edit_one_line, job_row
from gputravel.release import (NotARecipient, ReleaseRefused, ReleaseSignature, ReleaseStatement, open_release,
                               raw_public, read_release, seal_release)
from gputravel.release.seal import SUITE

CHECKPOINT = "checkpoint.pt"
REFUSED_AT_JOIN = ("RTMR[3]: the orchestrator's TDX module extended RTMR[3] with the launched job's manifest "
                   "digest at boot, and each holder's policy approves only the manifest it reviewed: every holder "
                   "refused at attestation, naming the digest it saw, before its first byte (its signed travel log "
                   "holds no approval and no travel)")


def _refused_everywhere(a: JobArena, manifest_changes: Iterable[tuple[str, object]]) -> bool:
    """For each (stage, job or manifest): every holder refused it at join, naming its digest; nothing travelled."""
    good = True
    for stage, launched in manifest_changes:
        a.stage = stage
        job, manifest = launched if isinstance(launched, tuple) else (a.job, launched)
        refusals, log = a.refused_at_join(job, manifest)
        seen = manifest.digest_hex()  # named whole, as `gputravel job approve --digest` takes it
        named = {r.holder for r in refusals if r.claim == "job" and f"runs job {seen};" in r.said}
        good = good and named == set(JOB_HOLDERS) and not log.approved and log.travels == 0 and \
            manifest.digest() != a.manifest.digest()
    a.stage = ""
    return good


@job_row("edited-workload", "host", tried="the holders approved a manifest whose workload is the file digits.py; "
         "the host launched the orchestrator with digits.py one line changed (its inputs scaled by 1/254, not 1/255) "
         "and that file's manifest", stopped_by=REFUSED_AT_JOIN)
def edited_workload(a: JobArena) -> bool:
    job = a.job.replace(workload_code=edit_one_line(a.job.workload_code))
    return _refused_everywhere(a, [("one line changed", (job, a.manifest_of(job)))])


@job_row("changed-job", "host", tried="the approved code, launched once with another recipient (the host's own key "
         "in place of dana's) and once with another learning rate (2e-3 for 1e-3)", stopped_by=REFUSED_AT_JOIN)
def changed_job(a: JobArena) -> bool:
    host_key = raw_public(X25519PrivateKey.generate())
    faster = a.job.replace(lr=2 * a.job.lr)
    return _refused_everywhere(a, [("another recipient", a.manifest_of(a.job, {"host": host_key})),
                                   ("another lr", (faster, a.manifest_of(faster)))])


# ----------------------------------------------------------------------------- the replay, at the quote
class _Quoter:
    """A real quoting enclave and an orchestrator's TLS certificate: the quotes a holder checks at join."""

    def __init__(self) -> None:
        root = Authority.self_signed(TEE_QUOTING_ROOT_CN)
        self.trust = TrustStore((), (root.cert_der,))
        self.enclave = EmulatedQuotingEnclave.provision(root)
        key = new_key()
        cert = issue_certificate(subject=subject_name("orchestrator"), public_key=key.public_key(),
                                 issuer=subject_name("orchestrator"), issuer_key=key,
                                 not_before=datetime.now(timezone.utc) - timedelta(minutes=5), days=1, is_ca=False)
        self.cert = cert.public_bytes(serialization.Encoding.DER)

    def check(self, policy: Policy, mrtd: bytes, extended: tuple[bytes, ...], named: bytes) -> Quoted:
        nonce = os.urandom(32)
        rtmr = (ZERO_RTMRS[0], ZERO_RTMRS[1], ZERO_RTMRS[2], rtmr_after(extended))
        quote = self.enclave.quote(mrtd, report_data_for_tls(spki_der(self.cert), nonce), rtmr)
        claim = said = ""
        try:
            verify_bound_quote(quote, self.cert, nonce, policy, self.trust, datetime.now(timezone.utc),
                               job_digest=named)
        except AttestationError as exc:
            claim, said = exc.claim, str(exc)
        return Quoted(extended=tuple(d.hex()[:16] for d in extended), named=named.hex()[:16], claim=claim, said=said)


@job_row("replayed-approval", "host", tried="a holder approved job A (the honest manifest); the orchestrator runs "
         "job B (the same job at another lr), its RTMR[3] extended with B, and names A in its attestation evidence "
         "(the approval replayed); then RTMR[3] extended with A before B, naming either (real quotes of the "
         "emulated TDX quoting enclave, checked as a holder checks them at join)", stopped_by="the replay check: "
         "the job the evidence names must replay to the quoted RTMR[3] (SHA-384 extend from zero, as TDX) and be "
         "approved: naming A over a register holding B, naming B (not approved) and a register holding A then B "
         "were all refused [job]; only a register holding exactly A, named A, was accepted (control)")
def replayed_approval(a: JobArena) -> bool:
    quoter, mrtd = _Quoter(), hashlib.sha384(b"the orchestrator the holder pinned").digest()
    old, new = a.manifest.digest(), a.manifest_of(a.job.replace(lr=2 * a.job.lr)).digest()
    policy = Policy((mrtd,), approved_jobs=(old,))
    tries = [("A named over B", (new,), old), ("B named over B", (new,), new), ("A then B, A named", (old, new), old),
             ("A then B, B named", (old, new), new)]
    refused = True
    for stage, extended, named in tries:
        a.stage = stage
        seen = quoter.check(policy, mrtd, extended, named)
        a.keep(seen)
        refused = refused and seen.claim == "job"
    a.stage = "control"
    control = quoter.check(policy, mrtd, (old,), old)
    a.keep(control)
    a.stage = ""
    replay = next(r for r in a.evidence if isinstance(r, Quoted) and r.stage == "A named over B")
    return refused and not control.claim and "does not match the job the orchestrator names" in replay.said


# ----------------------------------------------------------------------------- what a finished job leaves
@job_row("host-reads-run-dir", "host", tried="after the honest job trained and released its model, the host read "
         "every file of the orchestrator's run directory (checkpoint.pt, model.sealed, model.release, metrics.csv, "
         "plots, report.json) and its signed travel log, and searched them for the holders' canary and digit images",
         stopped_by="sealing at rest: checkpoint.pt and model.sealed are AES-256-GCM under the key broker's key for "
         "the orchestrator's own MRTD and job, model.release is HPKE-sealed to the recipient; no plaintext reader "
         "loads them; the manifest lets no text sample out (no sample.txt); the rest are numbers and names")
def host_reads_run_dir(a: JobArena) -> bool:
    honest = a.honest
    files = sorted(p for p in honest.run_dir.rglob("*") if p.is_file()) + [honest.audit_log]
    a.read += files
    sealed = {}
    for path in files:
        data = path.read_bytes()
        sealed[path.name] = _sealed(path.name, data)
        a.keep(FileRead(name=path.name, nbytes=len(data), sealed=sealed[path.name], said=_plain_load(path)))
    control = a.control()
    a.keep(Control(what="canary and digit images in the holders' own datasets", nbytes=control.total))
    kept = all(sealed.get(n) for n in (CHECKPOINT, SEALED_MODEL, RELEASE_FILE))
    return kept and "sample.txt" not in sealed and control.total > 0


def _sealed(name: str, data: bytes) -> bool:
    if name == RELEASE_FILE:
        try:
            read_release(data)
        except GputravelError:
            return False
        return True
    return is_sealed(data)


def _plain_load(path: Path) -> str:
    """What a plaintext reader (torch) makes of a checkpoint or model: its refusal, "" for other files."""
    if path.name not in (CHECKPOINT, SEALED_MODEL, RELEASE_FILE):
        return ""
    import torch  # lazy: only this row loads a model

    from gputravel.train.rundir import load_checkpoint  # lazy: torch, as above

    try:
        load_checkpoint(path, torch.nn.Linear(1, 1))
    except GputravelError as exc:
        return f"a plaintext reader (torch) cannot load it ({type(exc).__name__})"
    return "LOADED as a plaintext checkpoint"


@job_row("outsider-opens-release", "host+holder", tried="mallory (a holder that signed, not a recipient) and the "
         "host, each with an X25519 key of its own, opened model.release, then tried HPKE on each sealed data key "
         "directly", stopped_by="HPKE (RFC 9180: X25519, HKDF-SHA256, AES-256-GCM): the model's data key is sealed "
         "to dana's public key alone, so another private key opens no sealed key (NotARecipient from open_release, "
         "an authentication failure from HPKE itself); dana's key opens it (control)")
def outsider_opens_release(a: JobArena) -> bool:
    path = a.honest.run_dir / RELEASE_FILE
    blob = path.read_bytes()
    a.read.append(path)
    release = read_release(blob)
    shut = True
    for who in (MALLORY, "host"):
        key = X25519PrivateKey.generate()
        shut = _open(a, who, "model.release", lambda k=key: open_release(blob, k)[1], NotARecipient) and shut
        for sealed in release.sealed:
            what = f"{sealed.recipient}'s sealed data key by HPKE"
            shut = _open(a, who, what, lambda k=key, s=sealed: SUITE.decrypt(s.enc, k, info=release.statement.digest()),
                         Exception) and shut
    statement, model = open_release(blob, a.recipient)
    a.stage = "control"
    a.keep(Opened(who=RECIPIENT, what="model.release", error="", said="", nbytes=len(model)))
    a.stage = ""
    return shut and len(model) > 0 and statement.job_digest == a.manifest.digest()


def _open(a: JobArena, who: str, what: str, opening: Callable[[], bytes], expected: type[Exception]) -> bool:
    """An outsider's try: True if it was refused as `expected`; what it opened counts against the row."""
    try:
        got = opening()
    except expected as exc:  # noqa: BLE001 (HPKE's own failure is whatever cryptography raises)
        a.keep(Opened(who=who, what=what, error=type(exc).__name__, said=str(exc)[:200], nbytes=0))
        return True
    a.opened += len(got)
    a.keep(Opened(who=who, what=what, error="", said="", nbytes=len(got)))
    return False


# ----------------------------------------------------------------------------- the release's signatures
def _released(a: JobArena, run: str, report: dict, run_dir: Path) -> Released:
    rel = report.get("release") or {}
    return Released(run=run, signed=tuple(rel.get("signed", ())), declined=tuple(sorted(rel.get("declined", {}))),
                    released_to=tuple(rel.get("released_to", ())),
                    files=tuple(sorted(p.name for p in run_dir.iterdir())))


def _seal(a: JobArena, what: str, model: bytes, statement: ReleaseStatement,
          signatures: tuple[ReleaseSignature, ...]) -> SealTried:
    """seal_release as the orchestrator calls it, with these signatures, under the honest cohort's CA."""
    release = read_release((a.honest.run_dir / RELEASE_FILE).read_bytes())
    try:
        blob = seal_release(model, statement, signatures, QUORUM, holders=a.manifest.release.holders,
                            certificates=release.certificates, ca_cert_der=a.honest.ca_der)
    except ReleaseRefused as exc:
        return SealTried(what=what, signatures=len(signatures), quorum=QUORUM, error=type(exc).__name__,
                         said=str(exc), nbytes=0)
    return SealTried(what=what, signatures=len(signatures), quorum=QUORUM, error="", said="", nbytes=len(blob))


def _genuine(a: JobArena) -> tuple[ReleaseStatement, tuple[ReleaseSignature, ...], bytes]:
    """The honest release's statement and genuine signatures, and its model (the recipient's control open)."""
    blob = (a.honest.run_dir / RELEASE_FILE).read_bytes()
    release = read_release(blob)
    return release.statement, release.signatures, open_release(blob, a.recipient)[1]


@job_row("release-short-of-quorum", "host", tried="a run of the approved job (quorum 2 of 3) in which only alice "
         "signs (bob and mallory decline); then seal_release given one genuine signature of the honest release",
         stopped_by="the quorum: the orchestrator sealed the model to its own measurement and job only "
         "(model.sealed) and wrote no model.release; seal_release refused k-1 valid signatures (ReleaseRefused); "
         "the same call with k of them sealed it (control)")
def release_short_of_quorum(a: JobArena) -> bool:
    a.stage = "run"
    run, report, _, _ = a.train("short", decline=(BOB, MALLORY))
    short = _released(a, "the run alice alone signed", report, run)
    a.keep(short)
    a.stage = "library"
    statement, signatures, model = _genuine(a)
    refused = _seal(a, "one of the honest release's signatures", model, statement, signatures[: QUORUM - 1])
    a.keep(refused)
    a.stage = "control"
    control = _seal(a, "two of them", model, statement, signatures[:QUORUM])
    a.keep(control)
    a.stage = ""
    run_held = short.signed == (ALICE,) and not short.released_to and RELEASE_FILE not in short.files \
        and SEALED_MODEL in short.files
    return run_held and refused.error == "ReleaseRefused" and not control.error


@job_row("signature-over-other-model", "host", tried="the honest release's three genuine holder signatures, "
         "presented for a statement of another model (the host's own), for the real model released to the host's "
         "key instead of dana's, and relabelled to name that other statement's digest", stopped_by="the signed "
         "statement: a holder signs exactly (model SHA-384, job digest, recipients); a signature over another "
         "statement is not counted, one relabelled does not verify under the holder's certificate, so each release "
         "was refused (ReleaseRefused, 0 of 2); the genuine statement with the same signatures sealed (control)")
def signature_over_other_model(a: JobArena) -> bool:
    statement, signatures, model = _genuine(a)
    other = b"the host's own model " + os.urandom(64)
    to_host = {"host": raw_public(X25519PrivateKey.generate())}
    forged = [("another model", other, ReleaseStatement.of(other, statement.job_digest, statement.recipients),
               signatures),
              ("another recipient", model, ReleaseStatement.of(model, statement.job_digest, to_host), signatures)]
    relabelled = forged[0][2]
    forged.append(("relabelled", other, relabelled,
                   tuple(structs.replace(s, statement=relabelled.digest()) for s in signatures)))
    refused = True
    for stage, blob, forgery, sigs in forged:
        a.stage = stage
        tried = _seal(a, f"genuine signatures for {stage}", blob, forgery, sigs)
        a.keep(tried)
        refused = refused and tried.error == "ReleaseRefused" and f"0 of {QUORUM}" in tried.said
    a.stage = "control"
    control = _seal(a, "the genuine statement", model, statement, signatures)
    a.keep(control)
    a.stage = ""
    return refused and not control.error


# ----------------------------------------------------------------------------- the checkpoint
@job_row("foreign-resume", "host", tried="a second cohort whose orchestrator has another measurement (another "
         "measured setting: its holder timeout) and the honest run's key broker (the same broker_dir, so the same "
         "secret) asked the broker for the checkpoint key and resumed from the honest run's sealed checkpoint.pt",
         stopped_by="the key broker derives the checkpoint key from the requester's own quoted MRTD and RTMR[3]: the "
         "foreign orchestrator was granted a key, but another one, and the checkpoint did not open (SealedError); "
         "nothing was trained from it, no chunk travelled to it")
def foreign_resume(a: JobArena) -> bool:
    honest = a.honest
    checkpoint = honest.run_dir / CHECKPOINT
    a.read.append(checkpoint)
    a.keep(Measured(run="honest", mrtd=honest.measurement.hex()[:16], job=a.manifest.digest_hex()[:16],
                    broker=str(honest.broker_dir.relative_to(a.tmp))))
    error = said = ""
    try:
        a.train("foreign", resume=checkpoint, broker_dir=honest.broker_dir, travel_timeout=121.0)
    except GputravelError as exc:
        error, said = type(exc).__name__, str(exc)
    a.keep(Resumed(run="foreign", error=error, said=said))
    measured = {r.run: r for r in a.evidence if isinstance(r, Measured)}
    foreign = measured.get("foreign")
    other = foreign is not None and foreign.mrtd != honest.measurement.hex()[:16] and foreign.job == \
        a.manifest.digest_hex()[:16]
    logs = [r for r in a.evidence if isinstance(r, JobLog)]  # the foreign run's: nothing travelled to it
    untrained = bool(logs) and logs[-1].travels == 0
    return other and untrained and error == "SealedError" and "another orchestrator measurement or job" in said


JOB_ATTACKS: tuple[JobAttack, ...] = (
    edited_workload, changed_job, replayed_approval, host_reads_run_dir, outsider_opens_release,
    release_short_of_quorum, signature_over_other_model, foreign_resume, operator_made_keys,
)


def run_jobs(tmp: Path, chosen: list[JobAttack],
             on_result: Callable[[JobAttack, Verdict], None] | None = None) -> list[Verdict]:
    """Each chosen job row in turn, on the job arena in `tmp`; its verdict, with what it found of the canaries."""
    arena = JobArena(tmp)
    verdicts = []
    try:
        for attack in chosen:
            arena.begin()
            verdict = _run_one(attack, arena)
            verdicts.append(verdict)
            if on_result is not None:
                on_result(attack, verdict)
    finally:
        arena.close()
    return verdicts


def _run_one(attack: JobAttack, a: JobArena) -> Verdict:
    try:
        stopped = attack.run(a)
    except Exception as exc:  # noqa: BLE001 (a typed error, or the row's own bug: either fails this row alone)
        return Verdict(False, f"not carried out: {type(exc).__name__}: {exc}", tuple(a.evidence))
    # A model or checkpoint an outsider opened counts whole: it was trained on the holders' data.
    found = a.found(attack.adversary) + Found(sample_bytes=a.opened)
    return Verdict(stopped, attack.stopped_by, tuple(a.evidence), found)
