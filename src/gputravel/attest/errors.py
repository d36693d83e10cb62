"""The one error attestation raises: which claim failed, and why (never a secret)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NoReturn, TypeVar, cast

from gputravel.errors import ProtocolError, RemoteError
from gputravel.protocol.codec import decode

M = TypeVar("M")

CLAIMS = frozenset({
    "format",       # evidence, quote or claims could not be decoded
    "chain",        # certificate chain: signature, CA constraints, algorithm, trusted root
    "expired",      # a certificate outside its validity period, or claims older than allowed
    "signature",    # report / quote / claims signature does not verify
    "nonce",        # the evidence answers another nonce (replay)
    "fwid",         # firmware leaf FWID differs from the report's FWID
    "cc_mode",      # the GPU is not in confidential-computing mode
    "measurement",  # a measurement differs from its reference value / is not accepted
    "policy",       # a claim the holder's policy requires is absent or not accepted
    "binding",      # the quote's report data does not bind this TLS key and nonce
    "job",          # the quoted RTMR[3] is not the job named, or the holder approved no such job
})


class AttestationError(RemoteError):
    """Evidence was refused: `claim` (one of CLAIMS) failed; `claims`, those computed before it,
    for display (never a key or secret)."""

    def __init__(self, claim: str, reason: str, claims: Mapping[str, object] | None = None) -> None:
        if claim not in CLAIMS:
            raise ValueError(f"unknown attestation claim {claim!r}")
        super().__init__(f"attestation failed [{claim}]: {reason}")
        self.claim = claim
        self.reason = reason
        self.claims: Mapping[str, object] = MappingProxyType(dict(claims or {}))


class ClaimTracker:
    """Claims gathered while verifying; `fail` raises AttestationError with them, setting the key
    `on_fail` maps the failed claim to (claim key, value)."""

    def __init__(self, base: Mapping[str, object], on_fail: Mapping[str, tuple[str, object]]) -> None:
        self.claims: dict[str, object] = dict(base)
        self._on_fail = on_fail

    def ok(self, key: str, value: object = True) -> None:
        self.claims[key] = value

    def fail(self, claim: str, reason: str, **extra: object) -> NoReturn:
        if claim in self._on_fail:
            key, value = self._on_fail[claim]
            self.claims[key] = value
        self.claims.update(extra)
        raise AttestationError(claim, reason, self.claims)

    def reraise(self, err: AttestationError) -> NoReturn:
        self.fail(err.claim, err.reason)

    def decode(self, data: bytes, cls: type[M], what: str) -> M:
        """`data` decoded as a `cls`, or a failed "format" claim."""
        try:
            return cast(M, decode(data, expect=cls))
        except (ProtocolError, TypeError):  # TypeError: not bytes at all
            self.fail("format", f"{what} could not be decoded")
