"""RA-TLS: binding a CVM quote to the orchestrator's TLS key and a holder's 32-byte nonce, by one rule:

    report_data = SHA-512("gputravel ra-tls report data v1\\0" || SHA-384(SPKI DER) || nonce)

The quote travels on the established TLS connection (`verify_bound_quote`) or in a certificate
minted for the nonce (`make_ra_tls_certificate`, `verify_ra_tls`); a man in the middle with its
own TLS key, or a quote for another nonce, fails the binding.
"""

from __future__ import annotations

from datetime import datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from gputravel.attest.chain import CVM_QUOTE_OID, check_now, sha384
from gputravel.attest.errors import AttestationError
from gputravel.attest.gpu import NONCE_BYTES
from gputravel.attest.policy import Policy
from gputravel.attest.quote import ZERO_RTMRS, EmulatedQuoteVerifier, EmulatedQuotingEnclave, QuoteClaims
from gputravel.attest.roots import TrustStore
from gputravel.crypto.certs import issue_certificate, new_key, subject_name, utc_now
from gputravel.errors import BadInput

RA_TLS_LABEL = b"gputravel ra-tls report data v1\x00"


def report_data_for_tls(tls_public_key_der: bytes, nonce: bytes) -> bytes:
    """The 64 bytes of report data that bind a TLS key (SPKI DER) and a 32-byte nonce."""
    if not isinstance(tls_public_key_der, bytes) or not tls_public_key_der:
        raise BadInput("tls_public_key_der must be the DER SubjectPublicKeyInfo")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise BadInput(f"the RA-TLS nonce must be {NONCE_BYTES} bytes")
    h = hashes.Hash(hashes.SHA512())
    h.update(RA_TLS_LABEL + sha384(tls_public_key_der) + nonce)
    return h.finalize()


def _load(cert_der: bytes) -> x509.Certificate:
    try:
        return x509.load_der_x509_certificate(cert_der)
    except (ValueError, TypeError):
        raise AttestationError("format", "peer certificate is not DER") from None


def spki_der(cert_der: bytes) -> bytes:
    return _load(cert_der).public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def quote_extension(quote: bytes) -> x509.UnrecognizedExtension:
    """A (non-critical) certificate extension carrying an encoded quote."""
    return x509.UnrecognizedExtension(CVM_QUOTE_OID, quote)


def extract_quote(cert_der: bytes) -> bytes:
    try:
        ext = _load(cert_der).extensions.get_extension_for_oid(CVM_QUOTE_OID).value
    except x509.ExtensionNotFound:
        raise AttestationError("format", "peer certificate carries no CVM quote extension") from None
    if not isinstance(ext, x509.UnrecognizedExtension):
        raise AttestationError("format", "peer certificate's quote extension is malformed")
    return ext.value


def make_ra_tls_certificate(enclave: EmulatedQuotingEnclave, measurement: bytes, nonce: bytes, *,
                            common_name: str = "orchestrator", now: datetime | None = None, days: int = 1,
                            rtmr: tuple[bytes, bytes, bytes, bytes] = ZERO_RTMRS,
                            ) -> tuple[bytes, ec.EllipticCurvePrivateKey]:
    """A fresh TLS key and self-signed certificate whose extension holds a quote over
    (this certificate's SPKI, nonce). Returns (certificate DER, private key)."""
    key = new_key()
    spki = key.public_key().public_bytes(serialization.Encoding.DER,
                                         serialization.PublicFormat.SubjectPublicKeyInfo)
    quote = enclave.quote(measurement, report_data_for_tls(spki, nonce), rtmr)
    name = subject_name(common_name)
    cert = issue_certificate(subject=name, public_key=key.public_key(), issuer=name, issuer_key=key,
                  not_before=utc_now(now), days=days, is_ca=False, extensions=[
                      (x509.SubjectAlternativeName([x509.DNSName(common_name)]), False),
                      (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False),
                      (quote_extension(quote), False)])
    return cert.public_bytes(serialization.Encoding.DER), key


def verify_bound_quote(quote: bytes, tls_cert_der: bytes, nonce: bytes, policy: Policy, roots: TrustStore,
                       now: datetime, *, job_digest: bytes) -> QuoteClaims:
    """Verify `quote` under `policy`, that it binds `tls_cert_der`'s key and `nonce`, and that its
    RTMR[3] holds `job_digest` (the orchestrator's word, replayed), a job `policy` approves."""
    check_now(now)
    cert = _load(tls_cert_der)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise AttestationError("expired", "the orchestrator's TLS certificate is outside its validity period")
    expected = report_data_for_tls(spki_der(tls_cert_der), nonce)
    claims = EmulatedQuoteVerifier(roots, policy.orchestrator_measurements).verify(quote, expected, now)
    policy.check_job(claims.rtmr, job_digest)
    return claims


def verify_ra_tls(peer_cert_der: bytes, nonce: bytes, policy: Policy, roots: TrustStore, now: datetime, *,
                  job_digest: bytes) -> QuoteClaims:
    """Verify the quote carried in a peer's RA-TLS certificate (see module docstring), running `job_digest`."""
    return verify_bound_quote(extract_quote(peer_cert_der), peer_cert_der, nonce, policy, roots, now,
                              job_digest=job_digest)
