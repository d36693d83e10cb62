"""The requester's side of the key broker: an attested CVM (the orchestrator) asks for its key."""

from __future__ import annotations

import time
from collections.abc import Callable

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gputravel.broker.machine import KeyChallenge, KeyEvidence, KeyGrant, KeyRefused, KeyRequest, key_report_data
from gputravel.broker.machine import open_grant
from gputravel.errors import PeerTimeout, RemoteError
from gputravel.transport.unix import connect_unix

__all__ = ["KeyBrokerRefused", "fetch_key"]


class KeyBrokerRefused(RemoteError):
    """The key broker released no key; its reason names the claim that failed."""


def fetch_key(socket_path: str, purpose: str, quote: Callable[[bytes], bytes], timeout: float = 30.0) -> bytes:
    """The 32-byte key of `purpose` for this CVM's quoted measurement and job. `quote` maps 64 bytes of
    report data to a quote (the orchestrator's `request_quote` partial); the key arrives sealed to a
    key made here for this request alone."""
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
    return open_grant(grant.sealed, private, purpose, challenge.nonce)


def _refused(msg: object) -> None:
    if isinstance(msg, KeyRefused):
        raise KeyBrokerRefused(f"the key broker refused the key: {msg.reason}")


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise PeerTimeout("the key broker did not answer in time")
    return left
