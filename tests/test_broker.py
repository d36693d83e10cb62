"""The key broker (broker/, issue 28): a key released to an attested orchestrator is the key of its
own quoted MRTD and RTMR[3]; whoever quotes another measurement or job gets another key, and a
refusal names the claim that failed.

red team: foreign-resume. A resumed orchestrator of another measurement (or job) asks the key broker
for the checkpoint key: it gets a key, but not the one the checkpoint was sealed with, so the
checkpoint does not open (or, if its measurement is not accepted, it gets no key at all).

The orchestrator takes a key only from the broker it was launched to trust: every grant is signed by
the broker's identity key, whose public half the orchestrator's measured config carries (broker_key).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gputravel.attest import Authority, AttestationError, EmulatedQuotingEnclave
from gputravel.attest.quote import JOB_RTMR, ZERO_RTMRS, rtmr_after
from gputravel.attest.roots import TEE_QUOTING_ROOT_CN, TEE_ROOT_CERT
from gputravel.service.party import unix_listening
from gputravel.broker import (
    KeyBroker, KeyBrokerRefused, KeyChallenge, KeyEvidence, KeyGrant, KeyRefused, KeyRequest, Sealer, UntrustedBroker,
    broker_public_key, derive_key, fetch_key, key_report_data,
)
from gputravel.broker.machine import grant_signed_by, open_grant
from gputravel.broker.process import IDENTITY_FILE, SECRET_FILE, BrokerConfig, broker_secret, load_config
from gputravel.broker.state import broker_identity, public_key_hex
from gputravel.cohort.broker import BrokerLaunch
from gputravel.cohort.placement import Placement
from gputravel.errors import BadInput, GputravelError, IntegrityError, ProtocolError, SealedError
from gputravel.transport.unix import accept_unix, listen_unix
from gputravel.processes import stop_process
from gputravel.train.rundir import RunDir, load_checkpoint

SECRET = bytes(range(32))
MRTD = bytes([1]) * 48
OTHER_MRTD = bytes([2]) * 48
JOB = bytes([7]) * 48  # a job (manifest) digest
RTMR3 = rtmr_after([JOB])
OTHER_RTMR3 = rtmr_after([bytes([8]) * 48])
IDENTITY = ec.generate_private_key(ec.SECP384R1())  # the broker's identity key
TRUSTED = public_key_hex(IDENTITY)  # what the orchestrator was launched with: its measured broker_key


# ----------------------------------------------------------------------------- a fake quote, a fake verify
def fake_quote(mr_td: bytes, rtmr3: bytes, report_data: bytes) -> bytes:
    return mr_td + rtmr3 + report_data


def fake_verify(accepted: tuple[bytes, ...] = (MRTD, OTHER_MRTD)):
    def verify(quote: bytes, report_data: bytes, now: float) -> tuple[bytes, bytes]:
        if len(quote) != 160:
            raise AttestationError("format", "quote could not be decoded")
        mr_td, rtmr3, bound = quote[:48], quote[48:96], quote[96:]
        if mr_td not in accepted:
            raise AttestationError("measurement", f"CVM measurement {mr_td.hex()[:16]}... is not in the accepted list")
        if bound != report_data:
            raise AttestationError("binding", "quote report data does not bind the expected key and nonce")
        return mr_td, rtmr3
    return verify


class Requester:
    """An orchestrator's side of one exchange, by hand: its ephemeral key, the nonce it was given."""

    def __init__(self, purpose: str = "checkpoint") -> None:
        self.purpose = purpose
        self.private = X25519PrivateKey.generate()
        self.public = self.private.public_key().public_bytes(serialization.Encoding.Raw,
                                                             serialization.PublicFormat.Raw)
        self.nonce = b""

    def request(self) -> KeyRequest:
        return KeyRequest(purpose=self.purpose, public_key=self.public)

    def evidence(self, challenge: object, mr_td: bytes = MRTD, rtmr3: bytes = RTMR3) -> KeyEvidence:
        assert isinstance(challenge, KeyChallenge)
        self.nonce = challenge.nonce
        return KeyEvidence(quote=fake_quote(mr_td, rtmr3, key_report_data(self.nonce, self.public)))

    def open(self, grant: object) -> bytes:
        assert isinstance(grant, KeyGrant), grant
        return open_grant(grant.sealed, self.private, self.purpose, self.nonce)


def exchange(broker: KeyBroker, mr_td: bytes = MRTD, rtmr3: bytes = RTMR3, purpose: str = "checkpoint",
             conn: int = 1, now: float = 1000.0) -> tuple[Requester, object]:
    r = Requester(purpose)
    challenge = broker.receive(conn, r.request(), now)
    assert not challenge.close
    reply = broker.receive(conn, r.evidence(challenge.message, mr_td, rtmr3), now + 1)
    assert reply.close  # a grant or a refusal ends the exchange
    return r, reply.message


def make_broker(secret: bytes = SECRET, verify=None, identity: ec.EllipticCurvePrivateKey = IDENTITY,
                **kw) -> KeyBroker:
    return KeyBroker(secret, verify or fake_verify(), identity=identity, **kw)


def refusal(message: object) -> str:
    assert isinstance(message, KeyRefused), message
    return message.reason


# ----------------------------------------------------------------------------- the machine
def test_a_grant_opens_to_the_key_of_the_quoted_measurement_and_job():
    broker = make_broker()
    r, grant = exchange(broker)
    key = r.open(grant)
    assert key == derive_key(SECRET, "checkpoint", MRTD, RTMR3) and len(key) == 32
    r2, grant2 = exchange(broker, conn=2)
    assert r2.open(grant2) == key  # the same orchestrator and job, asking again: the same key
    assert SECRET not in grant.sealed and key not in grant.sealed  # type: ignore[attr-defined]


def test_a_grant_opens_only_with_the_requests_own_key_and_nonce():
    broker = make_broker()
    r, grant = exchange(broker)
    assert isinstance(grant, KeyGrant)
    with pytest.raises(IntegrityError):
        open_grant(grant.sealed, X25519PrivateKey.generate(), "checkpoint", r.nonce)
    with pytest.raises(IntegrityError):
        open_grant(grant.sealed, r.private, "checkpoint", bytes(32))
    with pytest.raises(IntegrityError):
        open_grant(grant.sealed, r.private, "model", r.nonce)


def tiny_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_foreign_resume_of_another_measurement_or_job_gets_another_key_and_the_checkpoint_stays_shut(tmp_path):
    broker = make_broker()
    r, grant = exchange(broker)
    run = RunDir(tmp_path / "run")
    model, opt = tiny_model()
    run.save_checkpoint(model, opt, 5, {"world_size": 1}, sealer=Sealer(r.open(grant), "checkpoint", JOB))
    for conn, (mr_td, rtmr3) in enumerate(((OTHER_MRTD, RTMR3), (MRTD, OTHER_RTMR3), (OTHER_MRTD, OTHER_RTMR3))):
        foreign, granted = exchange(broker, mr_td, rtmr3, conn=10 + conn)
        key = foreign.open(granted)
        assert key != r.open(grant)
        with pytest.raises(SealedError, match="another orchestrator measurement or job"):
            load_checkpoint(run.checkpoint_path, tiny_model(1)[0], sealer=Sealer(key, "checkpoint", JOB))
    # The rightful orchestrator, restarted, asks again and resumes.
    again, granted = exchange(broker, conn=20)
    fresh = tiny_model(1)[0]
    step, extra = load_checkpoint(run.checkpoint_path, fresh, sealer=Sealer(again.open(granted), "checkpoint", JOB))
    assert (step, extra) == (5, {"world_size": 1})
    assert torch.equal(fresh.weight, model.weight)


def test_foreign_resume_of_a_measurement_not_accepted_gets_no_key():
    broker = make_broker(verify=fake_verify(accepted=(MRTD,)))
    _, reply = exchange(broker, mr_td=OTHER_MRTD)
    reason = refusal(reply)
    assert "[measurement]" in reason and "not in the accepted list" in reason


def test_refusals_name_the_claim_and_carry_no_key_material():
    broker = make_broker()
    r = Requester()
    challenge = broker.receive(1, r.request(), 0.0)
    evidence = r.evidence(challenge.message)
    bad = KeyEvidence(quote=evidence.quote[:-1] + bytes([evidence.quote[-1] ^ 1]))  # the report data altered
    reason = refusal(broker.receive(1, bad, 1.0).message)
    assert "[binding]" in reason
    challenge = broker.receive(2, r.request(), 0.0)
    assert "[format]" in refusal(broker.receive(2, KeyEvidence(quote=b"garbage"), 1.0).message)
    for secret in (SECRET, derive_key(SECRET, "checkpoint", MRTD, RTMR3)):
        assert secret.hex() not in reason and secret.hex()[:16] not in reason


def test_replayed_evidence_for_an_old_nonce_is_refused():
    broker = make_broker()
    r = Requester()
    first = broker.receive(1, r.request(), 0.0)
    old = r.evidence(first.message)
    assert isinstance(broker.receive(1, old, 1.0).message, KeyGrant)
    # The same evidence again on the same connection: the exchange is over.
    assert "without a pending challenge" in refusal(broker.receive(1, old, 2.0).message)
    # Replayed in a new exchange, with the same public key: the new nonce is not in it.
    second = broker.receive(2, r.request(), 3.0)
    assert isinstance(second.message, KeyChallenge) and isinstance(first.message, KeyChallenge)
    assert second.message.nonce != first.message.nonce
    assert "[binding]" in refusal(broker.receive(2, old, 4.0).message)


def test_unknown_purposes_and_bad_public_keys_are_refused_and_purposes_key_apart():
    broker = make_broker()
    r = Requester("weights")
    assert "unknown purpose 'weights'" in refusal(broker.receive(1, r.request(), 0.0).message)
    assert "X25519" in refusal(broker.receive(2, KeyRequest(purpose="model", public_key=b"short"), 0.0).message)
    assert "KeyRequest, then KeyEvidence" in refusal(broker.receive(3, KeyChallenge(nonce=b"x"), 0.0).message)
    checkpoint, model = derive_key(SECRET, "checkpoint", MRTD, RTMR3), derive_key(SECRET, "model", MRTD, RTMR3)
    assert checkpoint != model
    r, grant = exchange(broker, purpose="model", conn=4)
    assert r.open(grant) == model


def test_a_stale_challenge_is_refused_and_a_silent_requester_expires():
    broker = make_broker(challenge_s=10.0)
    r = Requester()
    challenge = broker.receive(1, r.request(), 100.0)
    assert broker.next_deadline() == 110.0
    assert "stale challenge" in refusal(broker.receive(1, r.evidence(challenge.message), 111.0).message)
    broker.receive(2, r.request(), 200.0)
    broker.opened(3, 205.0)
    assert broker.expire(209.0) == []
    expired = {reply.conn: refusal(reply.message) for reply in broker.expire(216.0)}
    assert "stale challenge" in expired[2] and "no key request" in expired[3]
    assert broker.next_deadline() is None


def test_the_broker_refuses_a_secret_of_the_wrong_size():
    with pytest.raises(BadInput, match="32 bytes"):
        make_broker(b"short")
    with pytest.raises(BadInput, match="P-384"):
        make_broker(identity=ec.generate_private_key(ec.SECP256R1()))


# ----------------------------------------------------------------------------- its identity
@contextmanager
def broker_on_socket(tmp_path: Path, broker: KeyBroker, exchanges: int,
                     tamper: Callable[[KeyGrant], KeyGrant] = lambda g: g) -> Iterator[str]:
    """`broker` (the machine) answering `exchanges` requesters in turn on a unix socket, in a thread;
    `tamper` rewrites the grants it sends (a host between the orchestrator and the socket)."""
    path = str(tmp_path / "broker.sock")
    listener = listen_unix(path)

    def serve() -> None:
        for conn_id in range(exchanges):
            with accept_unix(listener, "requester", timeout=30) as conn:
                while True:
                    try:
                        msg = conn.recv(timeout=30).message
                    except GputravelError:
                        break
                    reply = broker.receive(conn_id, msg, time.time())
                    conn.send(tamper(reply.message) if isinstance(reply.message, KeyGrant) else reply.message)
                    if reply.close:
                        break

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        thread.join(30)
        listener.close()


def fake_quote_of(mr_td: bytes = MRTD, rtmr3: bytes = RTMR3) -> Callable[[bytes], bytes]:
    return lambda report_data: fake_quote(mr_td, rtmr3, report_data)


def test_a_broker_of_another_identity_is_refused_and_its_key_never_used(tmp_path):
    with broker_on_socket(tmp_path, make_broker(), 1) as sock:
        assert fetch_key(sock, "checkpoint", fake_quote_of(), 30, TRUSTED) == derive_key(SECRET, "checkpoint", MRTD,
                                                                                          RTMR3)
    # The host's own broker on the same path: the same code, a secret the host knows, its own identity.
    known = bytes([9]) * 32
    impostor = make_broker(known, identity=ec.generate_private_key(ec.SECP384R1()))
    (tmp_path / "broker.sock").unlink()
    with broker_on_socket(tmp_path, impostor, 1) as sock:
        with pytest.raises(UntrustedBroker, match="not signed by the key broker this orchestrator was launched to "
                                                  "trust") as refused:
            fetch_key(sock, "checkpoint", fake_quote_of(), 30, TRUSTED)
    assert isinstance(refused.value, ProtocolError)
    for secret in (known, derive_key(known, "checkpoint", MRTD, RTMR3)):
        assert secret.hex()[:16] not in str(refused.value)


def test_an_unsigned_replayed_or_altered_grant_is_refused(tmp_path):
    broker = make_broker()
    first, grant = exchange(broker)  # a real grant of an earlier exchange: signed, but not for the next one
    assert isinstance(grant, KeyGrant)
    assert grant_signed_by(IDENTITY.public_key(), grant, first.nonce, first.public, "checkpoint")
    altered = grant.sealed[:-1] + bytes([grant.sealed[-1] ^ 1])
    for tamper in (lambda g: KeyGrant(sealed=g.sealed, signature=b""), lambda g: grant,
                   lambda g: KeyGrant(sealed=altered, signature=g.signature)):
        (tmp_path / "broker.sock").unlink(missing_ok=True)
        with broker_on_socket(tmp_path, broker, 1, tamper) as sock:
            with pytest.raises(UntrustedBroker):
                fetch_key(sock, "checkpoint", fake_quote_of(), 30, TRUSTED)


def test_a_malformed_broker_key_is_refused_before_anything_is_sent(tmp_path):
    p256 = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo).hex()
    for bad in ("", "zz", TRUSTED[:-2], p256):
        with pytest.raises(BadInput, match="broker_key is not a P-384 public key"):
            fetch_key(str(tmp_path / "nobody.sock"), "checkpoint", fake_quote_of(), 30, bad)


def test_the_identity_is_made_once_0600_and_refused_when_loose_or_malformed(tmp_path):
    state = tmp_path / "state"
    public = broker_public_key(state)
    path = state / IDENTITY_FILE
    assert broker_public_key(state) == public == public_key_hex(broker_identity(state))
    assert path.stat().st_mode & 0o777 == 0o600 and path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert not [p for p in state.iterdir() if p.name.endswith(".tmp")]
    path.chmod(0o644)
    with pytest.raises(BadInput, match="readable by others"):
        broker_public_key(state)
    p256 = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    for text in (b"not a key", p256):
        path.write_bytes(text)
        path.chmod(0o600)
        with pytest.raises(BadInput, match="malformed") as refused:
            broker_identity(state)
        assert str(path) in str(refused.value)


def launch_broker(tmp_path: Path, name: str, state_dir: str | None = None) -> BrokerLaunch:
    cohort = tmp_path / name
    cohort.mkdir()
    return BrokerLaunch(Placement(cohort, False), cohort, tmp_path / "roots", state_dir)


def test_the_launcher_makes_the_identity_the_broker_process_signs_with(tmp_path):
    launch = launch_broker(tmp_path, "cohort")
    state = Path(launch.config(MRTD)["state_dir"])
    assert launch.public_key == broker_public_key(state)  # the process loads what the launcher made
    kept = str(tmp_path / "kept")  # a broker_dir that outlives the cohort: a resumed run trusts the same broker
    first = launch_broker(tmp_path, "c1", kept).public_key
    assert launch_broker(tmp_path, "c2", kept).public_key == first != launch.public_key


# ----------------------------------------------------------------------------- its secret and config
def test_the_secret_is_made_once_0600_and_refused_when_loose_or_malformed(tmp_path):
    state = tmp_path / "state"
    secret = broker_secret(state)
    path = state / SECRET_FILE
    assert len(secret) == 32 and broker_secret(state) == secret
    assert path.stat().st_mode & 0o777 == 0o600
    assert not [p for p in state.iterdir() if p.name.endswith(".tmp")]
    path.chmod(0o640)
    with pytest.raises(BadInput, match="readable by others"):
        broker_secret(state)
    path.chmod(0o600)
    path.write_bytes(b"x" * 33)
    with pytest.raises(BadInput, match="malformed"):
        broker_secret(state)


def test_the_config_refuses_unknown_keys_and_bad_measurements(tmp_path):
    good = 'socket = "/tmp/b.sock"\nstate_dir = "/s"\ntrust_dir = "/t"\n'
    for text, needle in ((good + 'colour = "red"\n', "colour"),
                         (good + 'accepted_measurements = ["abc"]\n', "accepted_measurements"),
                         ('socket = "/tmp/b.sock"\n', "state_dir"), ("socket = [", "not TOML")):
        (tmp_path / "b.toml").write_text(text)
        with pytest.raises(BadInput, match=needle):
            load_config(tmp_path / "b.toml")
    (tmp_path / "b.toml").write_text(good + f'accepted_measurements = ["{MRTD.hex()}"]\n')
    assert load_config(tmp_path / "b.toml").accepted_measurements == (MRTD.hex(),)


# ----------------------------------------------------------------------------- the process
def _start(config: Path, sock: str, scale: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "gputravel.broker", "--config", str(config)],
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60 * scale
    while not unix_listening(sock):
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "the broker exited"
        assert time.monotonic() < deadline, "the key broker did not listen in time"
        time.sleep(0.05)
    return proc


def test_a_broker_process_releases_the_same_key_after_a_restart(tmp_path, processes):
    root = Authority.self_signed(TEE_QUOTING_ROOT_CN)
    trust = tmp_path / "trust"
    trust.mkdir()
    (trust / TEE_ROOT_CERT).write_bytes(root.cert.public_bytes(serialization.Encoding.PEM))
    enclave = EmulatedQuotingEnclave.provision(root)
    sock = str(tmp_path / "broker.sock")
    config = tmp_path / "broker.toml"
    config.write_text(f'socket = "{sock}"\nstate_dir = "{tmp_path / "state"}"\ntrust_dir = "{trust}"\n'
                      f'accepted_measurements = ["{MRTD.hex()}"]\n')
    rtmrs = tuple(RTMR3 if i == JOB_RTMR else r for i, r in enumerate(ZERO_RTMRS))

    trusted = broker_public_key(tmp_path / "state")  # made first, as the launcher does, then loaded by the broker

    def quote(mr_td: bytes, registers: tuple = rtmrs):
        return lambda report_data: enclave.quote(mr_td, report_data, registers)

    def fetch(q, broker_key: str = trusted) -> bytes:
        return fetch_key(sock, "checkpoint", q, 30 * processes, broker_key)

    proc = _start(config, sock, processes)
    try:
        key = fetch(quote(MRTD))
        secret = (tmp_path / "state" / SECRET_FILE).read_bytes()
        assert key == derive_key(secret, "checkpoint", MRTD, RTMR3)
        other_job = tuple(OTHER_RTMR3 if i == JOB_RTMR else r for i, r in enumerate(ZERO_RTMRS))
        assert fetch(quote(MRTD, other_job)) != key
        with pytest.raises(KeyBrokerRefused, match=r"\[measurement\]"):
            fetch(quote(OTHER_MRTD))
        with pytest.raises(KeyBrokerRefused, match=r"\[binding\]"):
            fetch(lambda rd: enclave.quote(MRTD, os.urandom(64), rtmrs))
        with pytest.raises(UntrustedBroker):  # an orchestrator launched to trust another broker takes nothing here
            fetch(quote(MRTD), public_key_hex(ec.generate_private_key(ec.SECP384R1())))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert stop_process(proc, 10, asked=True) == 0  # asked: a second SIGTERM could land at its exit
    log = proc.stderr.read().decode() if proc.stderr else ""
    proc = _start(config, sock, processes)  # a kill and --resume: the same state directory, the same identity
    try:
        assert fetch(quote(MRTD)) == key
    finally:
        stop_process(proc, 10)
    log += proc.stderr.read().decode() if proc.stderr else ""
    assert '"event": "granted"' in log and "[measurement]" in log  # the refusal is logged, by its claim
    assert key.hex() not in log and secret.hex() not in log
    assert (tmp_path / "state" / IDENTITY_FILE).read_bytes().split(b"\n")[1].decode() not in log


def test_broker_config_takes_keyword_arguments_as_a_launcher_passes_them():
    cfg = BrokerConfig(socket="/tmp/b.sock", state_dir="/s", trust_dir="/t", accepted_measurements=(MRTD.hex(),))
    assert cfg.challenge_s == 30.0
