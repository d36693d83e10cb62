"""What a Flower deployment needs on disk: the Flower App (only a pyproject.toml naming this
package's apps; nothing is installed at run time, so it works offline), the Flower CLI's
configuration, and TLS as the travels have it: a CA made for this deployment only.
"""

from __future__ import annotations

import ipaddress
from datetime import datetime, timezone
from pathlib import Path

from cryptography import x509

from gputravel.crypto.certs import cert_pem, issue_certificate, key_pem, new_key, subject_name, write_private

APP_NAME = "gputravel-fedavg"
PUBLISHER = "gputravel"
CONNECTION = "gputravel"

_PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{name}"
version = "1.0.0"
description = "FedAvg baseline of gputravel: GPT-2 on the holders' tokens"
license = "Apache-2.0"
dependencies = ["flwr>=1.42.0"]

[tool.flwr.app]
publisher = "{publisher}"

[tool.flwr.app.components]
serverapp = "gputravel.fl.server_app:app"
clientapp = "gputravel.fl.client_app:app"

[tool.flwr.app.config]
job = ""
"""

_CLI_CONFIG = """\
[superlink]
default = "{name}"

[superlink.{name}]
address = "{address}"
root-certificates = "{ca}"
"""


def write_app(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pyproject.toml").write_text(_PYPROJECT.format(name=APP_NAME, publisher=PUBLISHER))
    return directory


def write_cli_config(flwr_home: Path, address: str, ca: Path) -> None:
    flwr_home.mkdir(parents=True, exist_ok=True)
    (flwr_home / "config.toml").write_text(_CLI_CONFIG.format(name=CONNECTION, address=address, ca=ca))


def write_tls(directory: Path, host: str) -> tuple[Path, Path, Path]:
    """(CA certificate, SuperLink certificate, SuperLink key) for ``host``; the CA's key is never written."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = datetime.now(timezone.utc)
    ca_key, key = new_key(), new_key()
    ca_name = subject_name("gputravel FL baseline CA")
    ca = issue_certificate(subject=ca_name, public_key=ca_key.public_key(), issuer=ca_name, issuer_key=ca_key,
                           not_before=now, days=2, is_ca=True)
    san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))])
    eku = x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH])
    leaf = issue_certificate(subject=subject_name("superlink"), public_key=key.public_key(), issuer=ca_name,
                             issuer_key=ca_key, not_before=now, days=2, is_ca=False,
                             extensions=((san, False), (eku, False)))
    paths = directory / "ca.pem", directory / "superlink.pem", directory / "superlink.key"
    paths[0].write_bytes(cert_pem(ca))
    paths[1].write_bytes(cert_pem(leaf))
    write_private(paths[2], key_pem(key))
    return paths
