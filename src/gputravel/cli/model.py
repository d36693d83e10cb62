"""`gputravel model ...`: a recipient's key pair, and the released model: shown, or opened with the
recipient's private key (docs/training.md, "Releasing the model")."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.markup import escape

from gputravel.cli.output import Commands, check_output_file, console, named_subcommand
from gputravel.errors import BadInput
from gputravel.files import read_plain
from gputravel.manifest import key_fingerprint, load_manifest
from gputravel.release import (ReleaseFile, keygen as make_keys, load_private_key, load_public_key, open_release,
                               read_release)
from gputravel.release.seal import MAX_RELEASE_BYTES, anchors, check_approved

model_app = typer.Typer(pretty_exceptions_show_locals=False, no_args_is_help=True, cls=Commands, callback=named_subcommand,
                        help="The released model: recipients' keys, and opening a release sealed to them.")
MAX_CA_BYTES = 64 << 10


def _read(path: Path, what: str, limit: int) -> bytes:
    try:
        data = read_plain(path, limit + 1)  # follows no link, never blocks on a FIFO
    except FileNotFoundError:
        raise BadInput(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise BadInput(f"{what} {path} cannot be read ({exc.strerror or 'not a plain file'})") from None
    if len(data) > limit:
        raise BadInput(f"{what} {path} is above the {limit:,} bytes it may be")
    return data


def _print_statement(release: ReleaseFile, ca: Path | None, checked: bool = False) -> None:
    s = release.statement
    console.print(f"model SHA-384  {s.model_sha384.hex()}", soft_wrap=True)
    console.print(f"job digest     {s.job_digest.hex()}", soft_wrap=True)
    for name, key in s.recipients:
        console.print(f"recipient      {escape(name)}  {key.hex()}", soft_wrap=True)
    signers = ", ".join(release.signers)
    console.print(f"signed by      {escape(signers)} ({len(release.signers)} of a quorum of {release.quorum})")
    if ca is None:
        if not checked:
            console.print("[yellow]signatures not checked: pass --manifest with the job's manifest (or --ca with "
                          "the cohort CA's certificate) to check them[/yellow]")
        return
    counted = release.counted(anchors(_read(ca, "--ca", MAX_CA_BYTES)))
    if len(counted) < release.quorum:
        raise BadInput(f"only {len(counted)} of the release's signatures ({', '.join(counted) or 'none'}) verify "
                       f"under the cohort CA {ca}: below its quorum of {release.quorum}")
    console.print(f"[green]signatures verify under the cohort CA[/green]: {escape(', '.join(counted))}")


def _check_manifest(release: ReleaseFile, path: Path) -> None:
    """The release is of the job `path` names, to its recipients, signed by at least its quorum of
    the holders it names, each under the certificate it names for that holder (not the file's own
    word on any of it: the second review forged one with certificates of its own in D/public)."""
    m = load_manifest(path)
    try:
        counted = check_approved(release, m.digest(), m.recipient_keys(), m.release.holders, m.release.certificates,
                                 m.release.quorum)
    except BadInput as exc:
        raise BadInput(f"{path}: {exc}") from None
    console.print(f"[green]signatures verify under the manifest's certificates[/green]: {escape(', '.join(counted))} "
                  f"(quorum {m.release.quorum})")


@model_app.command()
def keygen(
    name: str = typer.Argument(..., help="The recipient's name (a-z, 0-9, '-'), as the job manifest names it."),
    out: Path = typer.Option(..., "--out", help="Directory for NAME.key (private, 0600) and NAME.pub."),
) -> None:
    """Make a recipient's X25519 key pair: give NAME.pub to the consortium, keep NAME.key."""
    key_path, pub_path = make_keys(name, out)
    console.print(escape(f"wrote {key_path} (private: keep it) and {pub_path} (public: goes into the job "
                         "manifest's recipients)"), soft_wrap=True)
    fingerprint = key_fingerprint(load_public_key(pub_path))
    console.print(escape(f"its fingerprint, which each holder confirms with you (job approve --recipient "
                         f"{name}=...): {fingerprint}"), soft_wrap=True)


@model_app.command()
def show(
    release: Path = typer.Argument(..., help="The release file the orchestrator wrote."),
    ca: Path | None = typer.Option(None, "--ca", help="The cohort CA's certificate (ca.pem): check the signatures."),
    manifest: Path | None = typer.Option(None, help="The job manifest: check the release is its job's, to its "
                                                    "recipients, signed by its quorum under the certificates it names."),
) -> None:
    """Print what the holders signed (model and job digests, recipients) and who signed; no key needed."""
    parts = read_release(_read(release, "release", MAX_RELEASE_BYTES))
    _print_statement(parts, ca, checked=manifest is not None)
    if manifest is not None:
        _check_manifest(parts, manifest)


@model_app.command(name="open")
def open_(
    release: Path = typer.Argument(..., help="The release file the orchestrator wrote."),
    key: Path = typer.Option(..., "--key", help="The recipient's private key (NAME.key from model keygen)."),
    out: Path = typer.Option(..., "--out", help="Where to write the weights (the state_dict file, torch.load it)."),
    ca: Path | None = typer.Option(None, "--ca", help="The cohort CA's certificate (ca.pem): check the signatures."),
    manifest: Path | None = typer.Option(None, help="The job manifest: check the release against it first."),
) -> None:
    """Open a release sealed to your key: write the trained weights and print what the holders signed."""
    check_output_file(out, "--out")
    if out.exists() or out.is_symlink():
        raise BadInput(f"--out {out} already exists: choose a new file for the weights")
    private = load_private_key(key)
    blob = _read(release, "release", MAX_RELEASE_BYTES)
    parts = read_release(blob)
    _print_statement(parts, ca, checked=manifest is not None)  # before anything is written: a failed check
    if manifest is not None:                                     # writes nothing
        _check_manifest(parts, manifest)
    _, model = open_release(blob, private)
    _write_new(out, model)
    console.print(escape(f"wrote the weights ({len(model):,} bytes, SHA-384 as signed) to {out}"), soft_wrap=True)


def _write_new(path: Path, data: bytes) -> None:
    """The recipient's plaintext: 0600, never over a file or through a link; no torn file is left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise
