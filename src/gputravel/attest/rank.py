"""A data-parallel rank's CVM as ddp/keys.py needs it (issue 14): quotes from its own TDX module,
and the check on every peer before any gradient moves. A peer must chain to a trusted CPU-TEE
root, bind its report data, and carry *this CVM's own measurement and RTMR[3]* as its module
quoted them: a rank with other code, other settings or another job is refused."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from gputravel.attest.errors import AttestationError
from gputravel.attest.material import utcnow
from gputravel.attest.quote import JOB_RTMR, EmulatedQuoteVerifier, Quote, QuoteBody, padded_report_data
from gputravel.attest.roots import TrustStore
from gputravel.errors import BadInput, ProtocolError
from gputravel.protocol.codec import decode

Clock = Callable[[], datetime]


class QuotingRankTee:
    """`attest` and `verify` for establish_pair_keys, backed by a TDX module (`quote`: report
    data -> quote) and the roots in `trust`."""

    def __init__(self, quote: Callable[[bytes], bytes], trust: TrustStore, *, clock: Clock = utcnow) -> None:
        self._quote, self._trust, self._clock = quote, trust, clock
        self._verifier: EmulatedQuoteVerifier | None = None
        self._job = b""  # this CVM's own RTMR[3], as its module quoted it: every peer's must equal it

    def attest(self, data: bytes) -> bytes:
        evidence = self._quote(padded_report_data(data))
        if self._verifier is None:
            self._verifier = self._verifier_for(evidence, data)
        return evidence

    def verify(self, peer: int, evidence: bytes, data: bytes) -> None:
        if self._verifier is None:  # ddp/keys attests before it verifies; fail closed otherwise
            raise BadInput("a rank verifies its peers only after its own TDX module has quoted it")
        claims = self._verifier.verify(evidence, padded_report_data(data), self._clock())
        if claims.rtmr[JOB_RTMR] != self._job:
            raise AttestationError("job", f"rank {peer}'s RTMR[{JOB_RTMR}] differs from this rank's: it runs another job")

    def _verifier_for(self, own: bytes, data: bytes) -> EmulatedQuoteVerifier:
        """Peers must carry this CVM's own measurement: read it from the module's quote, and
        check that quote as a peer's would be (a module with a key outside the roots fails here)."""
        try:
            body = decode(decode(own, expect=Quote).body, expect=QuoteBody)
        except (ProtocolError, TypeError):
            raise ProtocolError("the TDX module's quote could not be decoded") from None
        verifier = EmulatedQuoteVerifier(self._trust, [body.mr_td])
        self._job = verifier.verify(own, padded_report_data(data), self._clock()).rtmr[JOB_RTMR]
        return verifier
