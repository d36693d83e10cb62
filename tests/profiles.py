"""Hypothesis profiles: `thorough` (make test, CI) and `fast` (make check), chosen by
HYPOTHESIS_PROFILE; conftest.py loads one before any test module is imported.

A test states how many examples it wants in the thorough profile, through :func:`examples`;
the fast profile runs the same share of its own, fewer.
"""

from __future__ import annotations

import os

from hypothesis import settings

THOROUGH = 100  # the thorough profile's max_examples: what `examples(n)` counts against
PROFILES = {"thorough": THOROUGH, "fast": 10}

for _name, _count in PROFILES.items():
    settings.register_profile(_name, max_examples=_count, deadline=None)


def load() -> str:
    name = os.environ.get("HYPOTHESIS_PROFILE", "thorough")
    if name not in PROFILES:
        raise ValueError(f"HYPOTHESIS_PROFILE: expected one of {', '.join(PROFILES)}, got {name!r}")
    settings.load_profile(name)
    return name


def examples(thorough: int) -> int:
    """`thorough` examples under the thorough profile; the same share of the loaded one's."""
    return max(2, round(thorough * settings.default.max_examples / THOROUGH))
