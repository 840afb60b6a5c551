"""The closest flag, command, choice or keyword for a misspelled one, in the
usage errors of `rollout-engine` and the benchmark scripts and in those of
`RolloutEngine(...)` and `SamplingParams(...)`."""
from __future__ import annotations

import argparse
import difflib
import functools
import inspect
import re
from typing import Callable, Mapping, Sequence


def unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's 'unrecognized arguments' message, with the parser's flag
    closest to the first misspelled one (--temprature: did you mean
    --temperature?)."""
    options = parser._option_string_actions
    known = [flag for flag in options if flag.startswith("--")]
    for word in extras:
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            # a short flag written long (--n for -n); a shortened flag (--temp): the few flags it
            # begins; else the closest spelling
            begun = sorted(f for f in known if f.startswith(flag))
            close = [flag[1:]] if flag[1:] in options else begun if 0 < len(begun) <= 3 else \
                difflib.get_close_matches(flag, known, n=1, cutoff=0.7)
            if close:
                return f"unrecognized arguments: {' '.join(extras)}; did you mean {' or '.join(close)}?"
    return f"unrecognized arguments: {' '.join(extras)}"


# Other names of a choice: the closest spelling of float64 is float16, the closest dtype float32.
ALIASES = {"float64": "float32", "double": "float32", "fp64": "float32", "fp32": "float32", "float": "float32",
           "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def with_choice_hint(message: str) -> str:
    """argparse's 'invalid choice' message with the closest choice named
    (ofline: did you mean 'offline'?); other messages as they are."""
    found = re.match(r"argument \S+: invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if found:
        return message + did_you_mean(found.group(1), re.findall(r"'([^']*)'", found.group(2)))
    return message


def meant(given: str, known: Sequence[str]) -> str | None:
    """What `given` most likely meant among `known`: the same in another
    case (FP8: fp8), its other name (bf16: bfloat16), else the closest
    spelling; None if nothing is close."""
    low = given.lower()
    same = [k for k in known if k.lower() == low or k == ALIASES.get(low)]
    close = same or difflib.get_close_matches(given, list(known), n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(given: str, known: Sequence[str]) -> str:
    """"; did you mean 'x'?" naming what `given` meant (`meant`), or ''."""
    choice = meant(given, known)
    return f"; did you mean {choice!r}?" if choice else ""


def unknown_keyword(call: str, name: str, known: Sequence[str], where: str) -> TypeError:
    """The error of a keyword argument `call` does not take, with the closest
    known one (temprature: did you mean 'temperature'?), else where the
    options are listed."""
    close = meant(name, known)
    hint = f" (did you mean {close!r}?)" if close else f" (the options: {where})"
    return TypeError(f"{call} got an unexpected keyword argument {name!r}{hint}")


def keywords_checked(fn: Callable, check: Callable[[Mapping], None]) -> Callable:
    """`fn` (a function or a coroutine function) with `check(kwargs)` run
    first on every call: for errors that name a keyword `fn` does not take
    before Python's own bare TypeError would."""
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def checked_async(*args, **kwargs):
            check(kwargs)
            return await fn(*args, **kwargs)
        return checked_async

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        check(kwargs)
        return fn(*args, **kwargs)
    return checked
