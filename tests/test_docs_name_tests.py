"""docs/security.md backs every claim with the tests it names: each named test must exist,
so that renaming or deleting one fails here instead of leaving a claim unbacked."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# `tests/test_x.py::name` or, after one in the same row, `::name` (a parameter id may follow).
REFERENCE = re.compile(r"`(tests/test_\w+\.py)?(?:::(\w+)(?:\[[^\]`]*\])?)?`")


def named_tests(text: str) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for line in text.splitlines():
        current = None
        for m in REFERENCE.finditer(line):
            current = m.group(1) or current
            if current is not None:
                found.add((current, m.group(2) or ""))
    return found


def test_every_test_security_md_names_exists() -> None:
    named = named_tests((ROOT / "docs" / "security.md").read_text())
    assert len(named) > 100  # the pattern still reads the table
    missing = []
    for path, name in sorted(named):
        source = ROOT / path
        if not source.is_file():
            missing.append(path)
        elif name and not re.search(rf"^\s*(?:async )?(?:def|class) {name}\b", source.read_text(), re.M):
            missing.append(f"{path}::{name}")
    assert not missing, f"docs/security.md names tests that do not exist: {missing}"


def test_every_test_the_other_docs_name_exists() -> None:
    """The same for every other page in docs/ (workloads.md, training.md, ...)."""
    missing = []
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for path, name in sorted(named_tests(doc.read_text())):
            source = ROOT / path
            if not source.is_file():
                missing.append(f"{doc.name}: {path}")
            elif name and not re.search(rf"^\s*(?:async )?(?:def|class) {name}\b", source.read_text(), re.M):
                missing.append(f"{doc.name}: {path}::{name}")
    assert not missing, f"docs name tests that do not exist: {missing}"
