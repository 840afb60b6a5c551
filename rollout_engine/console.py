"""The `rollout-engine` command's entry point.

The commands that run a model import torch and the engine first, which
takes a second or more. A KeyboardInterrupt raised in the middle of an
import can leave modules half-initialised and end in a traceback from deep
inside a library, so while those imports run, Ctrl-C only sets a flag; the
imports finish (or stop at the next one), then the command ends with one
line and exit status 130, as Ctrl-C later does. After the command, a Ctrl-C
while the interpreter shuts down exits at once with 130 and prints nothing;
a command that ended in 130 skips that shutdown (a second or more of
torch's teardown, during which another Ctrl-C would end the process by the
signal instead of with 130).
A Ctrl-C before Python has started running this module (its own startup, a
few tens of milliseconds) is the interpreter's. A command started with
Ctrl-C ignored (a script's background job) keeps ignoring it throughout."""
from __future__ import annotations

import os
import signal
import sys

from rollout_engine.interrupts import DeferredInterrupt

INTERRUPTED = "rollout-engine: error: interrupted"
# Commands that load a model, and what they import before they can start.
HEAVY_IMPORTS = {command: ("torch", "rollout_engine.engine")
                 for command in ("generate", "demo", "run", "bench", "serve")}


def _quiet_exit(signum, frame) -> None:
    os._exit(130)


def import_deferring_interrupts(argv: list[str]):
    """Import the command line and the modules `argv`'s command needs with
    Ctrl-C deferred; the cli's `main`, or None if Ctrl-C came meanwhile."""
    deferred = DeferredInterrupt()
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.SIG_IGN:  # started with Ctrl-C ignored (a script's background job): keep so
        signal.signal(signal.SIGINT, deferred)
    try:
        from rollout_engine.cli import main as cli_main

        command = next((a for a in argv if not a.startswith("-")), None)
        for module in HEAVY_IMPORTS.get(command, ()):
            if deferred.hit:
                break
            try:
                __import__(module)
            except ImportError:  # the command says what is missing, with its own message
                break
    finally:
        signal.signal(signal.SIGINT, previous)
    return None if deferred.hit else cli_main


def main() -> int:
    try:
        cli_main = import_deferring_interrupts(sys.argv[1:])
    except KeyboardInterrupt:  # a handler other than ours was in place (e.g. an embedding program's)
        cli_main = None
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    try:
        if cli_main is None:
            print(INTERRUPTED, file=sys.stderr)
            return 130
        return cli_main()
    except KeyboardInterrupt:  # a second Ctrl-C while the command was cleaning up after the first
        return 130
    finally:
        if not ignored:
            signal.signal(signal.SIGINT, _quiet_exit)


def entry() -> None:
    """The console script: `main`, then exit with its status; an interrupted
    command (130) has nothing left to finish, so it exits without the
    interpreter's teardown."""
    code = main()
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(code)


if __name__ == "__main__":
    entry()
