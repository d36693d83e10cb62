"""What a holder confirms before it approves a job on the deployed services (`gputravel job
approve`): that the manifest names its own certificate, and that the key broker and every other
signer are the ones their operators told it of, not ones the cohort's operator put in `public/`
(the review of per-party identities swapped both and every holder approved)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from pathlib import Path

from gputravel.errors import BadInput
from gputravel.manifest import JobManifest, key_fingerprint
from gputravel.service.config import HolderService
from gputravel.service.job import certificate_sha384
from gputravel.service.status import HOLDER_PKI

__all__ = ["BROKER_FINGERPRINT", "SIGNER_PREFIX", "Pins", "broker_fingerprint", "signer_prefix", "vouch"]

BROKER_FINGERPRINT = re.compile(r"sha256:[0-9a-f]{32}")  # as `job show` and `cohort identity` print it
SIGNER_PREFIX = re.compile(r"[0-9a-f]{32,96}")  # the certificate's SHA-384, or its first 128 bits at least


def broker_fingerprint(text: str, flag: str = "--broker", what: str = "the key broker's") -> str:
    """`text` (a key's ``sha256:`` fingerprint, or the whole key in hex) as a fingerprint; BadInput."""
    text = text.strip().lower()
    if BROKER_FINGERPRINT.fullmatch(text):
        return text
    if len(text) >= 64 and len(text) % 2 == 0 and set(text) <= set("0123456789abcdef"):
        return key_fingerprint(bytes.fromhex(text))
    raise BadInput(f"{flag}: expected {what} fingerprint (sha256: and 32 hex digits, as `gputravel job show` "
                   f"prints it) or its key in hex, got {text[:80]!r}")


def signer_prefix(text: str) -> str:
    """`text` as a certificate's SHA-384 (or a prefix of 32 hex digits or more); BadInput otherwise."""
    text = text.strip().lower().removeprefix("sha384:")
    if not SIGNER_PREFIX.fullmatch(text):
        raise BadInput(f"--signer: expected a certificate's SHA-384 (at least its first 32 hex digits, as "
                       f"`gputravel cohort identity` prints it), got {text[:100]!r}")
    return text


def _own(m: JobManifest, where: Path, cfg: HolderService, source: Path) -> None:
    named = m.release.certificates.get(cfg.name)
    if named is None:
        raise BadInput(f"{where}: release.certificates names no certificate for {cfg.name}: on the deployed "
                       "services a manifest names each signer's own (gputravel job init --cohort D)")
    own = Path(cfg.state_dir) / HOLDER_PKI / f"{cfg.name}.pem"
    try:
        mine = certificate_sha384(own.read_bytes())
    except (OSError, BadInput):
        raise BadInput(f"{source}: {cfg.name} has no identity at {own} to compare with {where}'s "
                       f"release.certificates: make it with `gputravel cohort identity --config {source}`") from None
    if mine != named:
        raise BadInput(f"{where}: release.certificates.{cfg.name} is {named[:16]}..., not this holder's own "
                       f"certificate ({mine[:16]}...): another key would sign for {cfg.name}")


@dataclass(frozen=True)
class Pins:
    """What a holder confirmed, to keep in its [policy]; `told`: each party, and whether it was
    confirmed now or taken from the policy (which its operator may have written)."""

    broker: str
    signers: dict[str, str]
    recipients: dict[str, str]
    told: tuple[str, ...]


def vouch(m: JobManifest, where: Path, cfg: HolderService, source: Path, broker: str | None,
          signers: Mapping[str, str], recipients: Mapping[str, str] = MappingProxyType({})) -> Pins:
    """Check the identities `m` names against this holder's own and what it confirmed (`broker`,
    `signers`, `recipients`: given now, else pinned in its policy before); the pins to keep.
    BadInput naming the party to confirm, or the one that differs."""
    _own(m, where, cfg, source)
    if cfg.name in signers:
        raise BadInput(f"--signer {cfg.name}: this holder's own certificate is checked against its state, not confirmed")
    if not m.broker.identity:
        raise BadInput(f"{where}: broker.identity is empty: on the deployed services a manifest names the key broker "
                       "that seals the model (gputravel job init --cohort D)")
    named = key_fingerprint(bytes.fromhex(m.broker.identity))
    pin = broker_fingerprint(broker) if broker else cfg.policy.known_broker
    if not pin:
        raise BadInput(f"{where}: confirm the key broker with --broker FINGERPRINT, as its operator told you; the "
                       f"manifest names {named}: a broker of the cohort operator's would open the model")
    if pin != named:
        raise BadInput(f"{where}: broker.identity is {named}, not the key broker you confirmed ({pin}): another "
                       "broker would hold the keys that open the model")
    strangers = sorted(set(signers) - set(m.release.holders))
    if strangers:
        raise BadInput(f"--signer {strangers[0]}: not among {where}'s release.holders ({', '.join(m.release.holders)})")
    given = {name: signer_prefix(v) for name, v in signers.items()}
    known = {**cfg.policy.known_signers, **given}
    for other in (h for h in m.release.holders if h != cfg.name):
        cert = m.release.certificates[other]
        if other not in known:
            raise BadInput(f"{where}: confirm {other}'s certificate with --signer {other}=SHA384, as {other} told you; "
                           f"the manifest names {cert[:32]}...: a key the operator made could sign for {other}")
        if not cert.startswith(known[other]):
            raise BadInput(f"{where}: release.certificates.{other} is {cert[:32]}..., not the certificate you "
                           f"confirmed for {other} ({known[other][:32]}...): another key would sign for {other}")
    told = [f"key broker {named} ({'confirmed now' if broker else 'as pinned in [policy] known_broker'})"]
    told += [f"signer {h} {m.release.certificates[h][:32]}... ({'confirmed now' if h in given else 'as pinned'})"
             for h in m.release.holders if h != cfg.name]
    seen = _recipients(m, where, cfg, recipients, told)
    return Pins(pin, {k: v for k, v in known.items() if k != cfg.name}, seen, tuple(told))


def _recipients(m: JobManifest, where: Path, cfg: HolderService, given: Mapping[str, str],
                told: list[str]) -> dict[str, str]:
    """Each recipient's key as the holder confirmed it (`--recipient NAME=sha256:...`, or pinned):
    the review had the manifest's writer name its own key as "alice", and a quorum released to it."""
    named = {r.name: key_fingerprint(r.key_bytes()) for r in m.release.recipients}
    strangers = sorted(set(given) - set(named))
    if strangers:
        raise BadInput(f"--recipient {strangers[0]}: not among {where}'s release.recipients ({', '.join(named)})")
    now = {n: broker_fingerprint(v, "--recipient", f"recipient {n}'s") for n, v in given.items()}
    known = {**cfg.policy.known_recipients, **now}
    for name, fingerprint in named.items():
        if name not in known:
            raise BadInput(f"{where}: confirm recipient {name}'s key with --recipient {name}=FINGERPRINT, as {name} told "
                           f"you; the manifest names {fingerprint}: a key of the manifest writer's would open the model")
        if known[name] != fingerprint:
            raise BadInput(f"{where}: release.recipients {name} has key {fingerprint}, not the key you confirmed for "
                           f"{name} ({known[name]}): another party would open the model")
        told.append(f"recipient {name} {fingerprint} ({'confirmed now' if name in now else 'as pinned'})")
    return known
