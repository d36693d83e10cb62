"""`gputravel pki init` and `gputravel attest gpu|verify|measure`. Exit codes: 0 verified, 1 bad
input, 2 attestation refused (the failing claim named, and the claims table).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from gputravel.attest.errors import AttestationError
from gputravel.cli.output import Commands, console, hex_bytes
from gputravel.attest.gpu import NONCE_BYTES, ReferenceValues
from gputravel.attest.policy import Policy
from gputravel.attest.provision import REFERENCE_FILE, GpuDevice, provision_gpu
from gputravel.attest.quote import measure_code, orchestrator_measurement
from gputravel.attest.roots import (
    GPU_ROOT_CERT,
    GPU_ROOT_KEY,
    GPU_VENDOR_ROOT_CN,
    TEE_QUOTING_ROOT_CN,
    TEE_ROOT_CERT,
    TEE_ROOT_KEY,
    TrustStore,
    init_roots,
    load_authority,
)
from gputravel.attest.material import utcnow
from gputravel.attest.verifier import EmulatedGpuVerifier
from gputravel.cohort.trust import JOB_FIELDS, PLACEMENT_FIELDS
from gputravel.firmware.gpu import FirmwareProcess
from gputravel.orchestrator.job import job_digest
from gputravel.errors import BadInput
from gputravel.files import write_json

__all__ = ["attest_app", "pki_app"]

EVIDENCE_FORMAT = "gputravel-gpu-attestation-v1"
EXIT_REFUSED = 2  # bad input: 1, as every command

pki_app = typer.Typer(pretty_exceptions_show_locals=False, no_args_is_help=True, add_completion=False, cls=Commands,
                      help="Emulated roots of trust (stand-ins for NVIDIA's and Intel's; not theirs).")
attest_app = typer.Typer(pretty_exceptions_show_locals=False, no_args_is_help=True, add_completion=False, cls=Commands,
                         help="Attestation: emulated H100 evidence, CVM measurements, offline verification.")


def _refused(exc: AttestationError) -> typer.Exit:
    if exc.claims:
        _print_claims("claims (refused)", exc.claims)
    console.print(f"[red]refused:[/red] claim [bold]{exc.claim}[/bold]: {escape(exc.reason)}")
    return typer.Exit(EXIT_REFUSED)


def _print_claims(title: str, claims: Mapping[str, object]) -> None:
    table = Table(title=title, show_header=True, pad_edge=False)
    table.add_column("claim", no_wrap=True, min_width=max(map(len, claims), default=5))
    table.add_column("value", overflow="fold")
    for key, value in claims.items():
        shown = json.dumps(value) if not isinstance(value, str) else value
        good = value is True or value in ("success", "on")
        bad = value is False or value in ("fail", "off")
        style = "green" if good else "red" if bad else ""
        table.add_row(key, f"[{style}]{escape(shown)}[/{style}]" if style else escape(shown))
    console.print(table)


@pki_app.command("init")
def pki_init(
    directory: Path = typer.Option(..., "--dir", help="Directory for the emulated roots (must not hold any)."),
) -> None:
    """Create the emulated GPU vendor root and CPU-TEE quoting root (keys written 0600)."""
    init_roots(directory)
    console.print(f"[bold]EMULATED roots of trust[/bold] in {escape(str(directory))} (stand-ins, not vendor roots):")
    console.print(f"  {GPU_ROOT_CERT} / {GPU_ROOT_KEY} (0600): {escape(GPU_VENDOR_ROOT_CN)}")
    console.print(f"  {TEE_ROOT_CERT} / {TEE_ROOT_KEY} (0600): {escape(TEE_QUOTING_ROOT_CN)}")
    console.print("Verifiers need only the .pem files; the .key files stand for the vendors' HSMs.")


@attest_app.command("gpu")
def attest_gpu(
    state: Path = typer.Option(..., "--state", help="Emulated device directory (created on first use)."),
    json_out: Path = typer.Option(..., "--json", help="Where to write evidence, nonce and claims."),
    roots: Optional[Path] = typer.Option(None, "--roots", help="Roots from `pki init` (default: --state)."),
) -> None:
    """Fetch fresh evidence from the emulated GPU for a random nonce and verify it."""
    roots_dir = roots if roots is not None else state
    trust = TrustStore.load(roots_dir)
    if GpuDevice.exists(state):
        GpuDevice.load(state)  # checked; the firmware runs in a process of its own
    else:
        device = provision_gpu(load_authority(roots_dir, "gpu"))
        device.save(state)
        console.print(f"provisioned emulated GPU {device.serial} in {escape(str(state))} (5-certificate chain)")
    reference = ReferenceValues.load(state / REFERENCE_FILE)
    nonce = os.urandom(NONCE_BYTES)
    with FirmwareProcess(state) as gpu:
        evidence = gpu.evidence(nonce)
    try:
        claims = EmulatedGpuVerifier(trust, reference).verify(evidence, nonce, utcnow())
    except AttestationError as e:
        raise _refused(e) from None
    eat = claims.eat()
    out = {"format": EVIDENCE_FORMAT, "emulated": True, "nonce": nonce.hex(),
           "evidence": base64.b64encode(evidence).decode("ascii"),
           "evidence_sha384": claims.evidence_digest.hex(), "claims": eat}
    write_json(json_out, out)
    _print_claims("GPU attestation claims (emulated H100)", eat)
    console.print(f"wrote {escape(str(json_out))}")


def _read_json(path: Path, what: str) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested too deeply
        raise BadInput(f"{path}: cannot read {what} (missing file or invalid JSON)") from None


def _read_evidence(path: Path) -> bytes:
    raw = _read_json(path, "evidence")
    if not isinstance(raw, dict) or raw.get("format") != EVIDENCE_FORMAT or not isinstance(raw.get("evidence"), str):
        raise BadInput(f"{path}: not a {EVIDENCE_FORMAT} file")
    try:
        return base64.b64decode(raw["evidence"], validate=True)
    except (binascii.Error, ValueError):
        raise BadInput(f"{path}: evidence is not base64") from None


@attest_app.command("verify")
def attest_verify(
    evidence: Path = typer.Option(..., "--evidence", help="JSON written by `attest gpu`."),
    nonce: str = typer.Option(..., "--nonce", help="The nonce you expect the evidence to answer (hex)."),
    policy: Path = typer.Option(..., "--policy", help="Holder policy JSON."),
    roots: Path = typer.Option(Path("."), "--roots", help="Directory with gpu-vendor-root.pem."),
    reference: Optional[Path] = typer.Option(None, "--reference", help="Reference values (default: the policy's)."),
) -> None:
    """Verify saved GPU evidence offline; exit 2 naming the failing claim."""
    data = _read_evidence(evidence)
    expected = hex_bytes(nonce, NONCE_BYTES, f"--nonce must be {2 * NONCE_BYTES} hex characters")
    pol = Policy.load(policy)
    trust = TrustStore.load(roots)
    reference = reference if reference is not None else pol.gpu_reference_values
    if reference is None:
        raise BadInput("no GPU reference values: pass --reference or set gpu_reference_values in the policy")
    ref = ReferenceValues.load(reference)
    now = utcnow()
    try:
        claims = EmulatedGpuVerifier(trust, ref).verify(data, expected, now)
        pol.check_gpu(claims, now)
    except AttestationError as e:
        raise _refused(e) from None
    _print_claims("GPU attestation claims (verified offline)", claims.eat())
    console.print("[green]verified[/green]: the evidence meets the policy")


@attest_app.command("measure")
def attest_measure(
    config: Optional[Path] = typer.Option(None, "--config", help="Orchestrator config JSON (default: {})."),
    package: Optional[Path] = typer.Option(None, "--package", help="Package tree (default: installed gputravel)."),
) -> None:
    """Print the orchestrator measurement (MRTD) holders pin in their policy, and the digest of its
    job (RTMR[3]) that they approve, when the config names one."""
    cfg = {} if config is None else _read_json(config, "the configuration")
    # Where it runs is not measured, and its job goes into RTMR[3] instead (cohort/trust.py).
    measured = {k: v for k, v in cfg.items() if k not in PLACEMENT_FIELDS | JOB_FIELDS}
    value = orchestrator_measurement(measured, package_dir=package)
    code = measure_code(package)
    console.print(f"code sha384:              {code.hex()}", soft_wrap=True)
    console.print(f"orchestrator measurement: {value.hex()}", soft_wrap=True)
    if cfg.get("job_json") or cfg.get("manifest_json"):
        job = SimpleNamespace(job_json=str(cfg.get("job_json", "")), manifest_json=str(cfg.get("manifest_json", "")))
        console.print(f"job digest (RTMR[3]):     {job_digest(job).hex()}", soft_wrap=True)
