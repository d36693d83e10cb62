"""A data-parallel rank's CVM as ddp/keys.py needs it (issue 14): quotes from its own TDX module,
and the check on every peer before any gradient moves. A peer must chain to a trusted CPU-TEE
root, bind its report data, and carry *this CVM's own measurement* as its module quoted it: a
rank with other code or another job's settings is refused."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from gputravel.attest.material import utcnow
from gputravel.attest.quote import EmulatedQuoteVerifier, Quote, QuoteBody, padded_report_data
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

    def attest(self, data: bytes) -> bytes:
        evidence = self._quote(padded_report_data(data))
        if self._verifier is None:
            self._verifier = self._verifier_for(evidence, data)
        return evidence

    def verify(self, peer: int, evidence: bytes, data: bytes) -> None:
        if self._verifier is None:  # ddp/keys attests before it verifies; fail closed otherwise
            raise BadInput("a rank verifies its peers only after its own TDX module has quoted it")
        self._verifier.verify(evidence, padded_report_data(data), self._clock())

    def _verifier_for(self, own: bytes, data: bytes) -> EmulatedQuoteVerifier:
        """Peers must carry this CVM's own measurement: read it from the module's quote, and
        check that quote as a peer's would be (a module with a key outside the roots fails here)."""
        try:
            measurement = decode(decode(own, expect=Quote).body, expect=QuoteBody).mr_td
        except (ProtocolError, TypeError):
            raise ProtocolError("the TDX module's quote could not be decoded") from None
        verifier = EmulatedQuoteVerifier(self._trust, [measurement])
        verifier.verify(own, padded_report_data(data), self._clock())
        return verifier
