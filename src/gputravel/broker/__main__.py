"""``python -m gputravel.broker --config FILE``: the key broker in the foreground until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from gputravel.broker.process import load_config, run
from gputravel.errors import GputravelError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gputravel.broker", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="the key broker's TOML file")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwinds: the listener is closed
    try:
        run(load_config(args.config))
    except GputravelError as exc:
        print(f"key broker: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
