"""The demo's RUN_DIR.keys (the key broker's secret and identity, the holders' identities) is carried
into a resumed run only if it is this account's alone (the second hostile review of issue 28 had
another account plant a broker secret it knew, which the next run carried on)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gputravel.errors import BadInput
from gputravel.service.init import carry_state, check_own_keys


def _keys(tmp: Path) -> Path:
    keys = tmp / "run.keys"
    (keys / "broker").mkdir(parents=True, mode=0o700)
    keys.chmod(0o700)
    secret = keys / "broker" / "broker.secret"
    secret.write_bytes(b"k" * 32)
    secret.chmod(0o600)
    return keys


def test_our_own_private_keys_pass(tmp_path: Path) -> None:
    check_own_keys(_keys(tmp_path))


@pytest.mark.parametrize("plant", ["open-dir", "link", "other-account"])
def test_planted_or_loose_keys_are_refused(tmp_path: Path, plant: str) -> None:
    keys = _keys(tmp_path)
    if plant == "open-dir":
        (keys / "broker").chmod(0o755)
    elif plant == "link":
        (keys / "broker" / "broker.key").symlink_to(tmp_path / "elsewhere")
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another account needs root")
        os.chown(keys / "broker" / "broker.secret", 65534, 65534)
    with pytest.raises(BadInput, match="refused"):
        check_own_keys(keys)
    with pytest.raises(BadInput, match="refused"):
        carry_state(tmp_path / "state", keys, ["h1"])  # nothing is written into planted keys either
