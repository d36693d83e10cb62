"""The requester's side of the key broker: an attested CVM (the orchestrator) asks for its key, and
takes it only from the broker it was launched to trust (its identity key, measured in its config)."""

from __future__ import annotations

import time
from collections.abc import Callable

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gputravel.broker.machine import (
    KeyChallenge, KeyEvidence, KeyGrant, KeyRefused, KeyRequest, grant_signed_by, key_report_data, load_broker_key,
    open_grant,
)
from gputravel.errors import PeerTimeout, ProtocolError, RemoteError
from gputravel.transport.unix import connect_unix

__all__ = ["KeyBrokerRefused", "UntrustedBroker", "fetch_key"]


class KeyBrokerRefused(RemoteError):
    """The key broker released no key; its reason names the claim that failed."""


class UntrustedBroker(ProtocolError):
    """A grant not signed by the broker identity this orchestrator was launched with: another process
    answered on the broker's socket, and its key (one it may know) is not used."""


def fetch_key(socket_path: str, purpose: str, quote: Callable[[bytes], bytes], timeout: float,
              broker_key: str) -> bytes:
    """The 32-byte key of `purpose` for this CVM's quoted measurement and job. `quote` maps 64 bytes of
    report data to a quote (the orchestrator's `request_quote` partial); the key arrives sealed to a
    key made here for this request alone, and signed by `broker_key` (SubjectPublicKeyInfo DER, hex)."""
    trusted = load_broker_key(broker_key)  # a malformed one is refused before anything is sent
    deadline = time.monotonic() + timeout
    private = X25519PrivateKey.generate()
    public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    with connect_unix(socket_path, "key-broker", timeout=timeout) as conn:
        conn.send(KeyRequest(purpose=purpose, public_key=public))
        challenge = conn.recv(timeout=_left(deadline), expect=(KeyChallenge, KeyRefused)).message
        _refused(challenge)
        assert isinstance(challenge, KeyChallenge)
        conn.send(KeyEvidence(quote=quote(key_report_data(challenge.nonce, public))))
        grant = conn.recv(timeout=_left(deadline), expect=(KeyGrant, KeyRefused)).message
        _refused(grant)
        assert isinstance(grant, KeyGrant)
    if not grant_signed_by(trusted, grant, challenge.nonce, public, purpose):
        raise UntrustedBroker(f"the {purpose} key from {socket_path} is not signed by the key broker this "
                              "orchestrator was launched to trust (its measured broker_key): refused")
    return open_grant(grant.sealed, private, purpose, challenge.nonce)


def _refused(msg: object) -> None:
    if isinstance(msg, KeyRefused):
        raise KeyBrokerRefused(f"the key broker refused the key: {msg.reason}")


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise PeerTimeout("the key broker did not answer in time")
    return left
