"""Releasing the trained model: to the recipients the job manifest names, sealed with HPKE, only after a
quorum of holders signed exactly (model digest, job digest, recipients)."""

from gputravel.release.keys import keygen, load_private_key, load_public_key, public_key_from_hex, raw_public
from gputravel.release.seal import NotARecipient, ReleaseFile, open_release, read_release, seal_release
from gputravel.release.statement import (
    ReleaseRefused,
    ReleaseSignature,
    ReleaseStatement,
    check_signatures,
    sign_release,
    signature_verdicts,
)

__all__ = [
    "NotARecipient",
    "ReleaseFile",
    "ReleaseRefused",
    "ReleaseSignature",
    "ReleaseStatement",
    "check_signatures",
    "keygen",
    "load_private_key",
    "load_public_key",
    "open_release",
    "public_key_from_hex",
    "raw_public",
    "read_release",
    "seal_release",
    "sign_release",
    "signature_verdicts",
]
