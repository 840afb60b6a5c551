"""Argument types and parsers shared by the `rollout-engine` command line and
the scripts under benchmarks/ and tests/: bad input as one line with exit
status 2 (`UsageError`, `ScriptParser`, `run_script`), number types, output
paths checked before the work starts, and the CUDA check."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Iterable, NoReturn

from rollout_engine.suggest import unrecognized, with_choice_hint


class UsageError(ValueError):
    """Bad command-line input; printed as one `rollout-engine: error:` line, exit status 2."""


def flag_of(field: str) -> str:
    return "-n" if field == "n" else "--" + field.replace("_", "-")


def _number(text: str, kind: type, ok, requirement: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {requirement}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "an integer >= 1")


def non_negative_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    return _number(text, float, lambda v: v > 0, "> 0")


def unit_fraction(text: str) -> float:
    """A float in (0, 1]."""
    return _number(text, float, lambda v: 0 < v <= 1, "in (0, 1]")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except absent ones (None, an off switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class _ScriptHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and the script's docstring kept as written."""


class ScriptParser(argparse.ArgumentParser):
    """The parser of a script under benchmarks/: its whole docstring as the
    help, defaults shown, and a usage error (a bad flag, a missing GPU) as
    one line with exit status 2, as `rollout-engine` does."""

    def __init__(self, prog: str, doc: str | None) -> None:
        super().__init__(prog=prog, description=doc, formatter_class=_ScriptHelpFormatter, allow_abbrev=False)

    def error(self, message: str) -> NoReturn:
        message = with_choice_hint(" ".join(message.split()))
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        """argparse's, with the closest flag named for a misspelled one."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unrecognized(self, extras))
        return parsed

    def parse_checked(self, argv: list[str] | None = None, outs: Iterable[str] = ("out",)) -> argparse.Namespace:
        """Parse, then check that every output path named by `outs` can be
        written (its folder exists) before any work starts."""
        args = self.parse_args(argv)
        for field in outs:
            try:
                check_out_path(flag_of(field), getattr(args, field))
            except UsageError as exc:
                self.error(str(exc))
        return args


def run_script(main: Callable[[], Any]) -> int:
    """The entry point of a script under benchmarks/: its exit status, with
    Ctrl-C one line (status 130) and the engine's refusal of its input (a
    ValueError or a missing file) one line (status 2), as `rollout-engine`
    does, instead of a traceback."""
    prog = os.path.basename(sys.argv[0]) or "script"
    try:
        code = main()
    except KeyboardInterrupt:
        print(f"{prog}: error: interrupted", file=sys.stderr)  # as rollout-engine says it
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return code if isinstance(code, int) else 0


def missing_extra(modules: Iterable[str], extra: str) -> str | None:
    """Which of `modules` are not installed here and how to get them
    ("fastapi, httpx: pip install -e '.[server]' ..."), or None when all are."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return f"{', '.join(missing)}: pip install -e '.[{extra}]' in a clone (or 'rollout-engine[{extra}]')"


def check_out_path(flag: str, path: str | None) -> None:
    """A report is written after the run: a path whose folder is missing
    should not cost the run."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or os.path.isdir(path):
        what = f"{path!r} is a folder" if os.path.isdir(path) else f"the folder of {path!r} does not exist"
        raise UsageError(f"argument {flag}: {what}")


def needs_cuda(parser: argparse.ArgumentParser, what: str, count: int = 1) -> None:
    """Stop with one line (exit status 2) when torch sees fewer than `count`
    CUDA GPUs; `what` says why they are needed."""
    import torch

    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if seen < count:
        gpus = "a CUDA GPU" if count == 1 else f"{count} CUDA GPUs"
        parser.error(f"needs {gpus} ({what}); torch sees {seen or 'none'}")
