"""The `rollout-engine` command's entry point. The command's modules import
torch, which takes a second or more: Ctrl-C in that time ends the command as
Ctrl-C later does (one line, exit status 130), not with a traceback."""
from __future__ import annotations

import sys


def main() -> int:
    try:
        from rollout_engine.cli import main as cli_main
    except KeyboardInterrupt:
        print("rollout-engine: error: interrupted", file=sys.stderr)
        return 130
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
