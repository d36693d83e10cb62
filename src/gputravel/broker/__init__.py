"""The key broker (issue 28): its own party and process, emulating Trustee/KBS. It releases to an
attested CVM a key derived from its secret and the CVM's own quoted MRTD and RTMR[3], HPKE-sealed
to a key bound in the quote, and signed by the broker's identity key (the orchestrator checks it
against the `broker_key` measured in its config); `Sealer` seals checkpoints and the unreleased model with it.

Start it with ``python -m gputravel.broker --config broker.toml`` (process.py: the TOML keys), or
from a launcher as a supervised party (``process.serve(config, control)``).
"""

from gputravel.broker.client import KeyBrokerRefused, UntrustedBroker, fetch_key
from gputravel.broker.machine import (
    PURPOSES, KeyBroker, KeyChallenge, KeyEvidence, KeyGrant, KeyRefused, KeyRequest, Reply, derive_key,
    key_report_data,
)
from gputravel.broker.seal import Sealer, is_sealed
from gputravel.broker.state import broker_public_key

__all__ = ["PURPOSES", "KeyBroker", "KeyBrokerRefused", "KeyChallenge", "KeyEvidence", "KeyGrant", "KeyRefused",
           "KeyRequest", "Reply", "Sealer", "UntrustedBroker", "broker_public_key", "derive_key", "fetch_key",
           "is_sealed", "key_report_data"]
