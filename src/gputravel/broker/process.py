"""The key broker as its own party and OS process (emulating Trustee/KBS: docs/fidelity.md).

It listens on a unix socket, verifies each requester's quote against the CPU-TEE quoting root and
the orchestrator measurements it accepts, and releases keys derived from a 32-byte secret kept in
its own state directory, so a restarted broker releases the same keys (a killed run resumes); it
signs each grant with the identity key kept beside it (state.py), which the orchestrator checks.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import socket
import sys
import time
import tomllib
from datetime import datetime, timezone
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gputravel.attest.quote import JOB_RTMR, EmulatedQuoteVerifier
from gputravel.attest.roots import TEE_ROOT_CERT, TrustStore
from gputravel.broker.machine import CHALLENGE_S, KeyBroker, KeyRefused, Reply, Verify
from gputravel.broker.state import IDENTITY_FILE, SECRET_FILE, broker_identity, broker_secret
from gputravel.errors import BadInput, GputravelError, PeerTimeout, ProtocolError, TransportClosed
from gputravel.protocol.control import Ready
from gputravel.transport.stream import StreamTransport
from gputravel.transport.unix import listen_unix

__all__ = ["IDENTITY_FILE", "SECRET_FILE", "BrokerConfig", "broker_secret", "load_config", "quote_verifier", "run",
           "serve"]

HEX96 = r"^[0-9a-f]{96}$"


class BrokerConfig(BaseModel):
    """Where the broker listens and keeps its secret, whom it trusts, which orchestrators it serves."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    socket: str = Field(min_length=1, max_length=107)  # a unix socket's path limit
    state_dir: str = Field(min_length=1)
    trust_dir: str = Field(min_length=1)  # holds the CPU-TEE quoting root's certificate (attest/roots.py)
    accepted_measurements: tuple[str, ...] = Field(default=(), max_length=64)  # MRTDs, 96 hex each
    challenge_s: float = Field(default=CHALLENGE_S, gt=0, le=600)

    @field_validator("accepted_measurements")
    @classmethod
    def _mrtds(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not all(re.fullmatch(HEX96, m) for m in value):
            raise ValueError("each is 96 lower-case hex characters (an MRTD)")
        return value


def load_config(path: Path) -> BrokerConfig:
    """The broker's TOML file; BadInput naming the file and key at fault."""
    try:
        raw = tomllib.loads(Path(path).read_text())
        return BrokerConfig(**raw)
    except OSError as exc:
        raise BadInput(f"{path}: cannot read the key broker's config ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"{path}: not TOML ({exc})") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "config"
        raise BadInput(f"{path}: {key}: {err['msg']}") from None


# ----------------------------------------------------------------------------- verification
def quote_verifier(trust_dir: Path, accepted: tuple[str, ...]) -> Verify:
    """The broker's check of a quote: chain to the CPU-TEE root, signature, an accepted MRTD, the report data."""
    path = Path(trust_dir) / TEE_ROOT_CERT
    try:
        root = x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(serialization.Encoding.DER)
    except (OSError, ValueError):
        raise BadInput(f"{path} is missing or not a PEM certificate: the broker needs the CPU-TEE quoting root") from None
    verifier = EmulatedQuoteVerifier(TrustStore((), (root,)), [bytes.fromhex(m) for m in accepted])

    def verify(quote: bytes, report_data: bytes, now: float) -> tuple[bytes, bytes]:
        claims = verifier.verify(quote, report_data, datetime.fromtimestamp(now, timezone.utc))
        return claims.measurement, claims.rtmr[JOB_RTMR]

    return verify


# ----------------------------------------------------------------------------- the process
def serve(config: BrokerConfig, control: StreamTransport) -> None:
    """As a supervised party (cohort/entry.py): Ready once listening, serve until the launcher hangs up."""
    run(config, control)


def run(config: BrokerConfig, control: StreamTransport | None = None) -> None:
    state = Path(config.state_dir)
    broker = KeyBroker(broker_secret(state), quote_verifier(Path(config.trust_dir), config.accepted_measurements),
                       identity=broker_identity(state), challenge_s=config.challenge_s)
    _clear_stale(config.socket)
    listener = listen_unix(config.socket)
    os.chmod(config.socket, 0o666)  # any local process may ask; the quote decides what it gets
    listener.setblocking(False)
    try:
        if control is not None:
            control.send(Ready(role="key-broker", detail={"accepted": len(config.accepted_measurements)}))
        _log("up", socket=config.socket, accepted=len(config.accepted_measurements))
        _Server(broker, listener, control).run()
    finally:
        listener.close()


def _clear_stale(path: str) -> None:
    """A socket file left by a broker that died is removed; a live broker's is refused by the bind."""
    if not os.path.exists(path):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            os.unlink(path)


class _Server:
    def __init__(self, broker: KeyBroker, listener: socket.socket, control: StreamTransport | None) -> None:
        self.broker, self.listener, self.control = broker, listener, control
        self.conns: dict[int, StreamTransport] = {}
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener.fileno(), selectors.EVENT_READ, "listener")
        if control is not None:
            self.sel.register(control.fileno(), selectors.EVENT_READ, "control")

    def run(self) -> None:
        while True:
            deadline = self.broker.next_deadline()
            timeout = None if deadline is None else max(0.0, deadline - time.time())
            for key, _ in self.sel.select(timeout):
                if key.data == "control":
                    return  # the launcher sent something or hung up: a broker takes no orders, so it ends
                if key.data == "listener":
                    self._accept()
                else:
                    self._read(key.data)
            for reply in self.broker.expire(time.time()):
                self._send(reply)

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:  # gone already, or out of descriptors: keep serving
            return
        conn = StreamTransport(sock, "requester")
        self.conns[conn.fileno()] = conn
        self.sel.register(conn.fileno(), selectors.EVENT_READ, conn.fileno())
        self.broker.opened(conn.fileno(), time.time())

    def _read(self, cid: int) -> None:
        conn = self.conns[cid]
        try:
            msg = conn.recv(timeout=2).message
        except (ProtocolError, PeerTimeout) as exc:
            self._send(Reply(cid, KeyRefused(reason=f"malformed message: {exc}"), close=True))
            return
        except TransportClosed:
            self._close(cid)
            return
        self._send(self.broker.receive(cid, msg, time.time()))

    def _send(self, reply: Reply) -> None:
        conn = self.conns.get(reply.conn)
        if conn is None:
            return
        if isinstance(reply.message, KeyRefused):
            _log("refused", reason=reply.message.reason)  # claim names and digests prefixes only
        else:
            _log("granted" if reply.close else "challenged")
        try:
            conn.send(reply.message)
        except GputravelError:
            reply = Reply(reply.conn, reply.message, close=True)
        if reply.close:
            self._close(reply.conn)

    def _close(self, cid: int) -> None:
        self.broker.drop(cid)
        conn = self.conns.pop(cid)
        self.sel.unregister(cid)
        conn.close()


def _log(event: str, **fields: object) -> None:
    print(json.dumps({"ts": round(time.time(), 3), "party": "key-broker", "event": event, **fields}),
          file=sys.stderr, flush=True)
