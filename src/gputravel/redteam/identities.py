"""The red team's row on who makes the keys of a release (issue 28 on the deployed services): whoever runs
`cohort init` makes keys of its own under two holders' names and signs the release with them, at the
orchestrator's count and in a release file it hands the recipient. Each holder made its own identity,
and the manifest every holder approved names its certificate: the operator's count for nothing."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from gputravel.crypto.certs import load_key
from gputravel.crypto.pki import self_signed_member
from gputravel.errors import GputravelError
from gputravel.manifest import JobManifest
from gputravel.orchestrator.release import RELEASE_FILE, Ending, end_job
from gputravel.protocol.codec import decode, encode
from gputravel.protocol.travel import JobResults, ReleaseSigned
from gputravel.redteam.arena import ALICE, BOB, MALLORY
from gputravel.redteam.evidence import Opened, Released
from gputravel.redteam.jobarena import JobArena, job_row
from gputravel.release import ReleaseStatement, open_release, seal_release, sign_release
from gputravel.release.seal import check_approved, read_release

Identity = tuple[bytes, bytes]  # (certificate DER, key PEM)


def member_identity(d: Path, name: str) -> Identity:
    d.mkdir(parents=True, exist_ok=True)
    der = x509.load_pem_x509_certificate(self_signed_member(d, name)).public_bytes(Encoding.DER)
    return der, (d / f"{name}.key").read_bytes()


class SigningLink:
    """A holder's end of its TLS link, as the orchestrator's release count sees it: the certificate it
    presents, and a signature of the statement it is asked for with the key it holds."""

    def __init__(self, name: str, who: Identity) -> None:
        self.name, (self.cert, self.key), self.reply = name, who, None

    def send(self, asked: JobResults) -> None:
        statement = decode(asked.statement, expect=ReleaseStatement)
        self.reply = ReleaseSigned(signature=encode(sign_release(statement, self.name, load_key(self.key))))

    def recv(self, timeout: float, expect: object) -> SimpleNamespace:
        return SimpleNamespace(message=self.reply)

    def peer_certificate(self) -> bytes:
        return self.cert


def _count(a: JobArena, manifest: JobManifest, run: str, links: dict[str, Identity], model: bytes) -> Released:
    """The orchestrator's end of the job (orchestrator/release.py end_job) with these links signing."""
    run_dir = a.tmp / f"identities-{run}"
    run_dir.mkdir(parents=True, exist_ok=True)
    sealer = SimpleNamespace(seal=lambda data: b"sealed to the orchestrator: " + hashlib.sha384(data).digest())
    ending = Ending(manifest, manifest.digest(), tuple(c for c, _ in links.values()), sealer,  # type: ignore[arg-type]
                    5.0, SimpleNamespace())  # type: ignore[arg-type]
    out = end_job(ending, model, {}, {n: SigningLink(n, who) for n, who in links.items()}, run_dir, None)  # type: ignore[misc]
    a.read.extend(sorted(p for p in run_dir.iterdir() if p.is_file()))  # what the operator reads there
    return Released(run=run, signed=tuple(out.signed), declined=tuple(sorted(out.declined)),
                    released_to=tuple(out.released_to), files=tuple(sorted(p.name for p in run_dir.iterdir())))


def _recipient_check(a: JobArena, manifest: JobManifest, what: str, signers: dict[str, Identity],
                     model: bytes) -> Opened:
    """The recipient opening a release file as `model open --manifest` does (release/seal.py check_approved)."""
    statement = ReleaseStatement.of(model, manifest.digest(), manifest.recipient_keys())
    sigs = [sign_release(statement, n, load_key(k)) for n, (_, k) in signers.items()]
    blob = seal_release(model, statement, sigs, len(sigs), holders=manifest.release.holders,
                        certificates={n: c for n, (c, _) in signers.items()}, ca_cert_der=[c for c, _ in signers.values()])
    try:
        check_approved(read_release(blob), manifest.digest(), manifest.recipient_keys(), manifest.release.holders,
                       manifest.release.certificates, manifest.release.quorum)
        _, opened = open_release(blob, a.recipient)
    except GputravelError as exc:
        return Opened(who="the recipient", what=what, error=type(exc).__name__, said=str(exc)[:200], nbytes=0)
    a.opened += len(opened) if what != "the honest release" else 0
    return Opened(who="the recipient", what=what, error="", said="", nbytes=len(opened))


@job_row("operator-made-keys", "host", tried="whoever ran cohort init made keys of its own under bob's and "
         "mallory's names (self-signed certificates, as a holder's own are) and signed the release of the approved "
         "job with them: at the orchestrator's count (alice declining), and in a release file of another model, "
         "sealed to the real recipient, that it handed the recipient with those certificates inside",
         stopped_by="the manifest every holder approved names each holder's own certificate (release.certificates):"
         " the orchestrator counted no signature over a certificate it does not name (0 of 2: nothing released), "
         "and `model open --manifest` refused the forged file (0 of 2 verify under the certificates the manifest "
         "names); the holders' own keys released and opened (control)")
def operator_made_keys(a: JobArena) -> bool:
    own = {n: member_identity(a.tmp / "identities" / n, n) for n in (ALICE, BOB, MALLORY)}
    forged = {n: member_identity(a.tmp / "identities" / f"operator-{n}", n) for n in (BOB, MALLORY)}
    named = {n: hashlib.sha384(c).hexdigest() for n, (c, _) in own.items()}
    manifest = a.manifest.with_parties(named, a.manifest.broker.identity)
    model = b"the approved job's model " + hashlib.sha384(a.tmp.name.encode()).digest()
    a.stage = "orchestrator's count"
    count = _count(a, manifest, "operator-signed", {BOB: forged[BOB], MALLORY: forged[MALLORY]}, model)
    a.keep(count)
    a.stage = "recipient's check"
    check = _recipient_check(a, manifest, "a release signed with the operator's keys", forged,
                             b"the operator's own model")
    a.keep(check)
    a.stage = "control"
    honest = _count(a, manifest, "holders-signed", {ALICE: own[ALICE], BOB: own[BOB]}, model)
    opened = _recipient_check(a, manifest, "the honest release", {ALICE: own[ALICE], BOB: own[BOB]}, model)
    a.keep(honest, opened)
    a.stage = ""
    held = not count.signed and not count.released_to and RELEASE_FILE not in count.files
    refused = check.error == "BadInput" and "only 0 of the release's signatures" in check.said
    return held and refused and bool(honest.released_to) and not opened.error
