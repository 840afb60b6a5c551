"""One side of an A/B of a module-level switch: sets `module.NAME=value`
(the value a Python literal of the switch's own type; `0`/`1` for a bool),
then runs `rollout-engine <args>` or a script of this folder (`<name>.py
<args>`) in this process. Alternate the sides in one device call:

    python3 benchmarks/ab_switch.py rollout_engine.layers.fp8_linear.FAST_ACCUM=1 \\
        rollout-engine bench --workload grpo --model qwen2.5-7b --quantization fp8 --out /tmp/fast.json
    python3 benchmarks/ab_switch.py rollout_engine.layers.fp8_linear.FAST_ACCUM=0 rollout-engine bench ...
    python3 benchmarks/ab_switch.py "rollout_engine.kernels.attention.DECODE_TILE=(64, 4, 3)" \\
        decode_attention.py --backends triton ...

Several settings may come before the program. The switch must already exist
in the module (a misspelt name is refused, not added); a switch that is None
takes any literal. Set the module that reads the switch: a name another
module imported by value (`from m import NAME`) keeps its own copy there.
A script that sets the switch itself (decode_attention.py sets E4M3_IN_F16
from its --backends) overrides this. A `rollout-engine bench` report records
the settings under "switches"."""
from __future__ import annotations

import ast
import importlib
import json
import os
import sys

from rollout_engine.script_args import ScriptParser, UsageError, run_script

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_setting(text: str) -> tuple[object, str, object]:
    """`module.NAME=value` -> (module, NAME, value), the value of the switch's type."""
    target, eq, raw = text.partition("=")
    module_name, _, name = target.rpartition(".")
    if not eq or not module_name or not name:
        raise UsageError(f"{text!r} is not of the form module.NAME=value")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"cannot import {module_name} ({e})") from None
    if not hasattr(module, name):
        raise UsageError(f"{module_name} has no {name}")
    old = getattr(module, name)
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw  # a bare word: a string
    if isinstance(old, bool) and type(value) is int and value in (0, 1):
        value = bool(value)
    if old is not None and type(value) is not type(old) and not (isinstance(old, float) and type(value) is int):
        kind = type(old).__name__
        hint = " (0 or 1)" if isinstance(old, bool) else ""
        raise UsageError(f"{name} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not {raw!r}{hint}")
    return module, name, value


def main(argv: list[str] | None = None) -> int:
    p = ScriptParser("ab_switch.py", __doc__)
    p.add_argument("settings", nargs="+", metavar="module.NAME=value", help="the switches to set")
    p.add_argument("program", help="rollout-engine or a script of benchmarks/ (name.py), then its arguments")
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        p.parse_args(argv[:1])
    n = next((i for i, a in enumerate(argv) if "=" not in a), len(argv))
    if n == 0:
        p.error(f"argument module.NAME=value: expected a setting first, got {argv[0]!r}" if argv else
                "argument module.NAME=value: expected one or more settings, then the program")
    if n == len(argv):
        p.error("argument program: expected rollout-engine or a script of benchmarks/ after the settings")
    program, rest = argv[n], argv[n + 1:]
    program = program.removeprefix("benchmarks/")  # as the examples spell the scripts
    if program != "rollout-engine" and not (program.endswith(".py") and os.path.exists(os.path.join(HERE, program))):
        p.error(f"argument program: {program!r} is neither rollout-engine nor a script of benchmarks/")
    try:
        settings = [parse_setting(a) for a in argv[:n]]
    except UsageError as e:
        p.error(f"argument module.NAME=value: {e}")
    for module, name, value in settings:
        setattr(module, name, value)
        print(f"ab_switch: {module.__name__}.{name} = {value!r}", file=sys.stderr, flush=True)
    from rollout_engine.bench.run import SWITCHES_ENV

    # recorded by `rollout-engine bench` reports
    os.environ[SWITCHES_ENV] = json.dumps({f"{m.__name__}.{n}": repr(v) for m, n, v in settings})
    return run_program(program, rest)


def run_program(program: str, args: list[str]) -> int:
    """`rollout-engine args` or the script `program` of this folder with
    `args`, in this process (the A/B scripts' second half)."""
    if program == "rollout-engine":
        from rollout_engine.console import main as console_main

        sys.argv = ["rollout-engine", *args]
        return console_main()
    sys.path.insert(0, HERE)
    script = importlib.import_module(program[:-3])
    sys.argv = [os.path.join(HERE, program), *args]  # every script's main reads sys.argv when given no list
    return script.main()


if __name__ == "__main__":
    raise SystemExit(run_script(main))
