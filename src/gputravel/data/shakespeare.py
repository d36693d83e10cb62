"""The shipped Shakespeare, the default training data (`gputravel demo`): nine plays, three per holder
(see demo_data/shakespeare/PROVENANCE.md for where they come from)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from gputravel.errors import BadInput

HOLDERS = ("tragedies", "comedies", "histories")


def shakespeare_holders() -> dict[str, Path]:
    """{"tragedies": dir, "comedies": dir, "histories": dir}, each a directory of .txt plays."""
    # Holders read plain files: the data must be on disk (a normal or editable install), not in a zip.
    root = Path(str(resources.files("gputravel") / "demo_data" / "shakespeare"))
    if not root.is_dir():
        raise BadInput(f"the demo data is missing from the installed package (looked in {root}); "
                       "reinstall gputravel from a source tree that includes gputravel/demo_data")
    holders = {name: root / name for name in HOLDERS}
    missing = [str(p) for p in holders.values() if not p.is_dir()]
    if missing:
        raise BadInput(f"demo holder directories are missing: {', '.join(missing)}; reinstall gputravel")
    return holders
