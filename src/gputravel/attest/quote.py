"""CVM quotes, TDX-style: a measurement of the CVM (MRTD), its four runtime measurement
registers (RTMRs) and 64 bytes of report data, signed by a quoting key that chains to the
emulated CPU-TEE quoting root (format in docs/attestation.md).

The measurement (what holders pin) is SHA-384 over a label, every src/gputravel/**/*.py and
the orchestrator's canonical config less its job; the job is extended into RTMR[3] after boot
(`JOB_RTMR`, `rtmr_after`). `EmulatedQuotingEnclave` only signs; in a cohort it lives in the
emulated TDX module's process, which takes the measurement from the launcher and the RTMRs
from its own registers, never from the CVM it quotes.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import msgpack
from cryptography.hazmat.primitives.asymmetric import ec

import gputravel
from gputravel.attest.chain import check_now, sha384, sign_p384, verify_chain, verify_p384
from gputravel.attest.errors import AttestationError, ClaimTracker
from gputravel.attest.roots import Authority, TrustStore
from gputravel.attest.verifier import Verifier
from gputravel.crypto.certs import new_key
from gputravel.errors import BadInput
from gputravel.protocol.codec import Message, encode

TEE = "emulated-tdx"
MEASUREMENT_BYTES = 48
REPORT_DATA_BYTES = 64
RTMR_COUNT = 4
JOB_RTMR = 3  # the register the orchestrator extends with its job digest, once, before its first quote
ZERO_RTMRS: tuple[bytes, bytes, bytes, bytes] = (bytes(MEASUREMENT_BYTES),) * RTMR_COUNT
QUOTE_CHAIN_LENGTH = 2
_MEASUREMENT_LABEL = b"gputravel cvm measurement v1\x00"


# ----------------------------------------------------------------------------- measurement
def measure_code(package_dir: Path | None = None) -> bytes:
    """SHA-384 over the sorted relative paths and contents of every *.py under the package."""
    root = Path(package_dir) if package_dir is not None else Path(gputravel.__file__).resolve().parent
    if not root.is_dir():
        raise BadInput(f"{root} is not a directory")
    files = sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*.py") if p.is_file())
    if not files:
        raise BadInput(f"{root} holds no Python source files")
    entries = [[rel, path.read_bytes()] for rel, path in files]
    return sha384(msgpack.packb(entries, use_bin_type=True))


def canonical_json(config: Mapping[str, object]) -> bytes:
    """Sorted keys, no whitespace, UTF-8, no NaN: the same config always gives the same bytes."""
    try:
        text = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        raise BadInput("the configuration must be JSON: str keys, finite numbers, lists, objects") from None
    return text.encode("utf-8")


def orchestrator_measurement(config: Mapping[str, object], *, package_dir: Path | None = None) -> bytes:
    """The 48-byte measurement of an orchestrator CVM running this code with this config."""
    if not isinstance(config, Mapping):
        raise BadInput("the orchestrator configuration must be a JSON object")
    return sha384(_MEASUREMENT_LABEL + measure_code(package_dir) + sha384(canonical_json(config)))


def rtmr_extend(old: bytes, digest: bytes) -> bytes:
    """TDX's extend: new = SHA-384(old || digest), both 48 bytes."""
    if len(old) != MEASUREMENT_BYTES or len(digest) != MEASUREMENT_BYTES:
        raise BadInput(f"an RTMR and what extends it are {MEASUREMENT_BYTES} bytes each")
    return sha384(old + digest)


def rtmr_after(digests: Iterable[bytes]) -> bytes:
    """An RTMR's value after extending its 48 zero bytes with `digests` in order (an event log replayed)."""
    value = bytes(MEASUREMENT_BYTES)
    for digest in digests:
        value = rtmr_extend(value, digest)
    return value


# ----------------------------------------------------------------------------- quote
class QuoteBody(Message, tag="attest.cvm.quote_body"):
    tee: str
    mr_td: bytes
    report_data: bytes
    rtmr: tuple[bytes, bytes, bytes, bytes]


class Quote(Message, tag="attest.cvm.quote"):
    body: bytes
    signature: bytes
    cert_chain: tuple[bytes, ...]  # quoting-key certificate, quoting root


@dataclass(frozen=True)
class EmulatedQuotingEnclave:
    """Stands in for the TDX module + quoting enclave: signs (measurement, RTMRs, report data)."""

    key: ec.EllipticCurvePrivateKey = field(repr=False)
    cert_chain: tuple[bytes, ...]

    @classmethod
    def provision(cls, tee_root: Authority, *, now: datetime | None = None, days: int = 365) -> EmulatedQuotingEnclave:
        key = new_key()
        cert = tee_root.issue("EMULATED TDX quoting key (not Intel)", key.public_key(), is_ca=False,
                              now=now, days=days)
        return cls(key, (cert, tee_root.cert_der))

    def quote(self, measurement: bytes, report_data: bytes,
              rtmr: tuple[bytes, bytes, bytes, bytes] = ZERO_RTMRS) -> bytes:
        """An encoded Quote over `measurement` (48 bytes), `report_data` (64 bytes) and four 48-byte RTMRs."""
        if not isinstance(measurement, bytes) or len(measurement) != MEASUREMENT_BYTES:
            raise BadInput(f"measurement must be {MEASUREMENT_BYTES} bytes")
        if not isinstance(report_data, bytes) or len(report_data) != REPORT_DATA_BYTES:
            raise BadInput(f"report data must be {REPORT_DATA_BYTES} bytes")
        if not _rtmrs_shaped(rtmr):
            raise BadInput(f"a quote carries {RTMR_COUNT} RTMRs of {MEASUREMENT_BYTES} bytes each")
        body = encode(QuoteBody(TEE, measurement, report_data, tuple(rtmr)))  # type: ignore[arg-type]
        return encode(Quote(body, sign_p384(self.key, body), self.cert_chain))


# ----------------------------------------------------------------------------- verification
class CVM:
    """Claim names for a verified CVM quote."""

    OVERALL = "x-gputravel-cvm-overall-att-result"
    PARSED = "x-gputravel-cvm-quote-parsed"
    CHAIN = "x-gputravel-cvm-quote-cert-chain-validated"
    SIGNATURE = "x-gputravel-cvm-quote-signature-verified"
    MEASUREMENT = "x-gputravel-cvm-measurement"
    RTMR = "x-gputravel-cvm-rtmr"
    ACCEPTED = "x-gputravel-cvm-measurement-accepted"
    BOUND = "x-gputravel-cvm-report-data-bound"
    TEE = "x-gputravel-cvm-tee"
    EMULATED = "x-gputravel-emulated"


_ON_FAIL = {"format": (CVM.PARSED, False), "chain": (CVM.CHAIN, False), "expired": (CVM.CHAIN, False),
            "signature": (CVM.SIGNATURE, False), "measurement": (CVM.ACCEPTED, False),
            "binding": (CVM.BOUND, False)}


class QuoteClaims(Message, tag="attest.cvm.claims"):
    tee: str
    measurement: bytes
    report_data: bytes
    quote_digest: bytes
    verified_at: int
    emulated: bool
    rtmr: tuple[bytes, bytes, bytes, bytes]

    def eat(self) -> dict[str, object]:
        return {CVM.OVERALL: True, CVM.TEE: self.tee, "iat": self.verified_at, CVM.PARSED: True,
                CVM.CHAIN: True, CVM.SIGNATURE: True, CVM.MEASUREMENT: self.measurement.hex(),
                CVM.RTMR: [r.hex() for r in self.rtmr],
                CVM.ACCEPTED: True, CVM.BOUND: True, CVM.EMULATED: self.emulated,
                "x-gputravel-quote-sha384": self.quote_digest.hex()}


class EmulatedQuoteVerifier(Verifier[QuoteClaims]):
    """Verifies an emulated quote: chain to the quoting root, signature, accepted
    measurement, and report data equal to the expected challenge."""

    def __init__(self, trust: TrustStore, accepted_measurements: Iterable[bytes]) -> None:
        self._trust = trust
        self._accepted = frozenset(accepted_measurements)

    def verify(self, evidence: bytes, challenge: bytes, now: datetime) -> QuoteClaims:
        check_now(now)
        if not isinstance(challenge, bytes) or len(challenge) != REPORT_DATA_BYTES:
            raise BadInput(f"expected report data must be {REPORT_DATA_BYTES} bytes")
        p = ClaimTracker({CVM.OVERALL: False, CVM.EMULATED: True}, _ON_FAIL)
        quote = p.decode(evidence, Quote, "quote")
        try:
            leaf = verify_chain(quote.cert_chain, self._trust.tee_roots, now, what="quote",
                                length=QUOTE_CHAIN_LENGTH)
        except AttestationError as e:
            p.reraise(e)
        p.ok(CVM.CHAIN)
        if not verify_p384(leaf.public_key(), quote.signature, quote.body):
            p.fail("signature", "quote signature does not verify with the quoting key")
        p.ok(CVM.SIGNATURE)
        body = p.decode(quote.body, QuoteBody, "quote")
        if (body.tee != TEE or len(body.mr_td) != MEASUREMENT_BYTES or len(body.report_data) != REPORT_DATA_BYTES
                or not _rtmrs_shaped(body.rtmr)):
            p.fail("format", "quote body has an unknown TEE type or wrong field sizes")
        p.ok(CVM.PARSED)
        p.ok(CVM.TEE, body.tee)
        p.ok(CVM.MEASUREMENT, body.mr_td.hex())
        p.ok(CVM.RTMR, [r.hex() for r in body.rtmr])
        if body.mr_td not in self._accepted:
            p.fail("measurement", f"CVM measurement {body.mr_td.hex()[:16]}... is not in the accepted list")
        p.ok(CVM.ACCEPTED)
        if not hmac.compare_digest(body.report_data, challenge):
            p.fail("binding", "quote report data does not bind the expected TLS key and nonce")
        return QuoteClaims(body.tee, body.mr_td, body.report_data, sha384(bytes(evidence)), int(now.timestamp()), True,
                           body.rtmr)


def _rtmrs_shaped(rtmr: object) -> bool:
    return (isinstance(rtmr, tuple) and len(rtmr) == RTMR_COUNT
            and all(isinstance(r, bytes) and len(r) == MEASUREMENT_BYTES for r in rtmr))


class EmulatedRankTee:
    """A data-parallel rank's CVM as ddp/keys.py needs it: its own emulated quoting enclave
    (`attest`) and the quote verifier every rank runs on its peers (`verify`). Report data
    shorter than a quote's 64 bytes is padded with zeros, on both sides alike."""

    def __init__(self, enclave_root: Authority, trusted_root_cert: bytes, measurement: bytes) -> None:
        self.measurement = measurement
        self.enclave = EmulatedQuotingEnclave.provision(enclave_root)
        self.verifier = EmulatedQuoteVerifier(TrustStore((), (trusted_root_cert,)), [measurement])

    def attest(self, data: bytes) -> bytes:
        return self.enclave.quote(self.measurement, padded_report_data(data))

    def verify(self, peer: int, evidence: bytes, data: bytes) -> None:
        self.verifier.verify(evidence, padded_report_data(data), datetime.now(timezone.utc))


def padded_report_data(data: bytes) -> bytes:
    """A rank's report data, zero-padded to a quote's 64 bytes (on both sides alike)."""
    if len(data) > REPORT_DATA_BYTES:
        raise BadInput(f"report data longer than {REPORT_DATA_BYTES} bytes")
    return data + bytes(REPORT_DATA_BYTES - len(data))
