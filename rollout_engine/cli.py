"""`rollout-engine` command line: download, generate, demo, run, bench.

Every failure the user can act on ends in one line, `rollout-engine: error:
...`, and a non-zero exit status (2 for bad input, 1 for a failure at run
time, 130 for Ctrl-C); flags are checked before any model is loaded. Set
ROLLOUT_ENGINE_DEBUG=1 to get the traceback of a run-time failure instead.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, NoReturn

from rollout_engine.cli_args import (INPUT_IDS_HELP, add_engine_args, add_sampling_args, build_config, build_sampling,
                                     check_engine_args, check_prompt_args, check_tp_args, has_tokenizer, input_ids,
                                     said_as_flags)
from rollout_engine.script_args import HelpFormatter, UsageError
from rollout_engine.suggest import unrecognized, with_choice_hint
from rollout_engine.config import EngineConfig
from rollout_engine.interrupts import DeferredInterrupt, generate_keeping_partials
from rollout_engine.logs import LEVELS as LOG_LEVELS, show_logs
from rollout_engine.model_zoo import ZOO
from rollout_engine.progress import Ticking

log = logging.getLogger("rollout_engine.cli")
PROG = "rollout-engine"
LOG_HELP = ("show the engine's log lines from this level on, with time and level (default: warnings and errors, "
            "unadorned); before or after the command")
DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning to program.",
    "Explain what a prime number is in one sentence.",
]


class Parser(argparse.ArgumentParser):
    """Reports a usage error as one line (through main) instead of usage + exit.
    A flag is taken only as spelled in full (a shortened or misspelled one is
    an error, not another flag)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{with_choice_hint(message)} (see '{self.prog} --help')")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        # The top parser names a flag it does not know (argparse would say the command is missing).
        first = next(iter(sys.argv[1:] if args is None else args), "")
        if self._subparsers is not None and first.startswith("-"):
            if first.split("=")[0] not in self._option_string_actions:
                self.error(unrecognized(self, [first]))
        return super().parse_known_args(args, namespace)


class SubcommandParser(Parser):
    """A subcommand's parser: an argument it does not know is reported here,
    pointing at the subcommand's help (argparse would leave it to the top
    parser, which points at `rollout-engine --help`)."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(unrecognized(self, extras))
        return parsed, extras


# ---- download ---------------------------------------------------------------------

def cmd_download(args: argparse.Namespace) -> int:
    from rollout_engine.model_zoo import ensure_model

    print(ensure_model(args.name))
    return 0


# ---- generate / demo ----------------------------------------------------------------

def cmd_generate(args: argparse.Namespace) -> int:
    config = build_config(args)
    params = build_sampling(args)
    if config.enable_return_routed_experts:  # the flag asks for the routes: every sample carries them
        params = dataclasses.replace(params, return_routed_experts=True)
    check_engine_args(config)
    from rollout_engine.model_zoo import resolve_model_path

    resolve_model_path(config.model, config.load_format)  # a zoo model's first download: its own progress first
    # From here on the work takes seconds (torch, transformers, the model's config, the weights): a slow
    # start (a loaded machine, a large model) shows a line every STARTING_TICK_S seconds.
    with Ticking(log, f"starting the engine ({config.model})", every_s=STARTING_TICK_S, quiet_if_quick=True):
        check_tp_args(config)
        prompts, ids = _prompts(args, config)
        check_prompt_args(config, prompts, ids, params)
        engine = _make_engine(config)
    handler = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    try:
        template = getattr(engine.tokenizer, "chat_template", None)
        if args.chat or (prompts is DEMO_PROMPTS and template):  # the demo's questions are chat turns
            ids = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
            _check_chat_ids(ids, engine.limits.vocab_size)
        kwargs = {"input_ids": ids} if ids is not None else {"prompts": prompts}
        start = time.perf_counter()
        outs, interrupted = generate_keeping_partials(engine, handler is not None, sampling_params=params,
                                                       progress=True, **kwargs)
        _print_outputs(outs, prompts or ids, params, time.perf_counter() - start)
        if interrupted:  # the samples so far are printed (finish=abort); then the one line and status 130
            raise KeyboardInterrupt
        stopped_at_once = any(o.finish_reason == "stop" and len(o.output_token_ids) <= 1 for o in outs)
        if not args.chat and ids is None and template and stopped_at_once:
            print("hint: the model stopped at once; chat models usually want --chat", file=sys.stderr)
    finally:
        note = DeferredInterrupt()  # a Ctrl-C raised inside the shutdown would cut it short, or land in a
        if handler is not None:     # library's cleanup ("Exception ignored ... KeyboardInterrupt"): noted
            signal.signal(signal.SIGINT, note)
        engine.shutdown()  # the step loop (and any tensor-parallel ranks) end before the interpreter does
        if handler is not None:
            signal.signal(signal.SIGINT, handler)  # as it was, whatever a Ctrl-C changed
        if note.hit:
            raise KeyboardInterrupt
    return 0


def _check_chat_ids(ids: list[list[int]], vocab_size: int) -> None:
    """The chat turns' ids, said as the text they came from: the user gave
    prompts, not --input-ids."""
    from rollout_engine.validation import past_vocabulary

    for i, row in enumerate(ids):
        past = past_vocabulary(row, vocab_size)
        if past:
            raise UsageError(f"argument --chat: prompt {i} encodes to token ids past the model's vocabulary "
                             f"[0, {vocab_size}): {past} (the tokenizer has tokens the model does not)")


def cmd_demo(args: argparse.Namespace) -> int:
    args.prompts, args.input_ids, args.chat = DEMO_PROMPTS, None, True
    return cmd_generate(args)


def _prompts(args: argparse.Namespace, config: EngineConfig) -> tuple[list[str] | None, list[list[int]] | None]:
    """(text prompts, token-id prompts), exactly one of them set."""
    if args.input_ids:
        if args.prompts:
            raise UsageError("argument --input-ids: pass text prompts or --input-ids, not both")
        if args.chat:
            raise UsageError("argument --chat: the chat template applies to text prompts, not to --input-ids")
        return None, args.input_ids
    if not has_tokenizer(config):
        what, remedy = ("the chat template needs", "--tokenizer FOLDER") if args.chat else \
            ("text prompts need", "--input-ids, or --tokenizer FOLDER")
        raise UsageError(f"{what} a tokenizer and {config.model!r} ({config.load_format}) has none: "
                         f"pass {remedy}")
    return args.prompts or DEMO_PROMPTS, None


STARTING_TICK_S = 5.0  # a start slower than this shows a line this often until it is done


def _make_engine(config: EngineConfig) -> Any:
    from rollout_engine import RolloutEngine

    kwargs = {k: getattr(config, k) for k in config.__dataclass_fields__ if k != "model"}
    return RolloutEngine(config.model, **kwargs)


LOGPROB_MODES = {"processed": "of the distribution sampled from, after temperature and top-k/top-p/min-p",
                 "raw": "of the model's unmodified softmax"}


def _print_outputs(outs: list[Any], prompts: list[Any], params: Any, elapsed: float) -> None:
    n = params.n
    for i, out in enumerate(outs):
        lps = out.output_logprobs or []
        mean_lp = f"{sum(lps) / len(lps):.3f}" if lps else "-"
        print(f"--- [{out.request_id}] {_short(prompts[i // n])}")
        # Without a tokenizer there is no text: the token ids are the output.
        print(repr(out.text) if out.text is not None else f"token ids: {out.output_token_ids}")
        count = len(out.output_token_ids)
        print(f"    {count} token{'s' if count != 1 else ''}, finish={out.finish_reason}, mean logprob={mean_lp}, "
              f"first logprobs={[round(x, 3) for x in lps[:5]]}")
        routes = out.routed_experts
        if routes is not None:  # [positions, MoE layers, top_k]
            print(f"    routed experts: {routes.shape[0]} positions x {routes.shape[1]} MoE layers x top "
                  f"{routes.shape[2]}; the last position's in layer 0: {routes[-1, 0].tolist() if len(routes) else []}")
    total = sum(len(o.output_token_ids) for o in outs)
    print(f"{len(outs)} sample{'s' if len(outs) != 1 else ''}, {total} output token{'s' if total != 1 else ''} in {elapsed:.2f} s: {total / elapsed:.1f} tok/s; "
          f"logprobs {params.logprob_mode} ({LOGPROB_MODES[params.logprob_mode]})")


def _short(prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return repr(prompt)
    return f"token ids: {prompt}" if len(prompt) <= 16 else f"token ids: {prompt[:16]}... ({len(prompt)})"


# ---- run ----------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    argv = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not argv:
        raise UsageError("run needs a program: rollout-engine run -- python train.py ...")
    if not _memory_saver_installed():
        raise UsageError('run needs torch-memory-saver: install the gpu extra (pip install -e ".[gpu]")')
    from rollout_engine.memory.launch import run

    return run(argv)


def _memory_saver_installed() -> bool:
    return importlib.util.find_spec("torch_memory_saver") is not None


# ---- parser -------------------------------------------------------------------------

def build_parser() -> Parser:
    parser = Parser(prog=PROG, description="LLM inference engine for RL rollouts.",
                    epilog="Errors are one line; ROLLOUT_ENGINE_DEBUG=1 shows the traceback of run-time failures.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, help=LOG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=SubcommandParser)
    _add_download(sub)
    _add_generate(sub)
    _add_demo(sub)
    _add_run(sub)
    _add_bench(sub)
    _add_serve(sub)
    return parser


def _version() -> str:
    """The installed distribution's version; the package's own in a source tree that is not installed."""
    try:
        return importlib.metadata.version("rollout-engine")
    except importlib.metadata.PackageNotFoundError:
        import rollout_engine

        return rollout_engine.__version__


def _subparser(sub: Any, name: str, help: str, log_level: bool = True) -> Parser:
    p = sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)
    if log_level:  # also after the command; given there, it wins over one before it
        p.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default=argparse.SUPPRESS,
                       help=LOG_HELP + ("; the HTTP server's too, info adding a line per request"
                                        if name == "serve" else ""))
    return p


def _add_download(sub: Any) -> None:
    p = _subparser(sub, "download", "fetch and convert a zoo model once")
    p.add_argument("name", choices=sorted(ZOO))
    p.set_defaults(func=cmd_download)


def _add_generate(sub: Any) -> None:
    p = _subparser(sub, "generate", "one-shot generation from text prompts or token ids")
    p.add_argument("prompts", nargs="*", help="text prompts (default: a few demo questions, in the model's chat "
                                              "template when it has one); they need a tokenizer")
    p.add_argument("--input-ids", type=input_ids, action="extend", metavar="IDS", help=INPUT_IDS_HELP)
    p.add_argument("--chat", action="store_true", help="wrap each text prompt in the model's chat template")
    add_engine_args(p)
    add_sampling_args(p, max_new_tokens=64, n=1)
    p.set_defaults(func=cmd_generate)


def _add_demo(sub: Any) -> None:
    # The demo always applies the chat template to its prompts: no --chat flag.
    p = _subparser(sub, "demo", "a rollout on chat prompts: n samples each, texts, logprobs, tok/s")
    add_engine_args(p)
    add_sampling_args(p, max_new_tokens=64, n=4)
    p.set_defaults(func=cmd_demo)


def _add_run(sub: Any) -> None:
    p = _subparser(sub, "run", "start a program with the memory-saver preload hook: run -- python train.py "
                               "(needs the gpu extra)", log_level=False)  # the program's own logs
    p.add_argument("program", nargs=argparse.REMAINDER, help="the program and its arguments, after --")
    p.set_defaults(func=cmd_run)


def _add_bench(sub: Any) -> None:
    from rollout_engine.bench.command import add_bench_args, cmd_bench

    p = _subparser(sub, "bench", "benchmark workloads (see BENCHMARKS.md)")
    add_bench_args(p)
    p.set_defaults(func=cmd_bench)


def _add_serve(sub: Any) -> None:
    from rollout_engine.server.command import add_serve_args, cmd_serve

    p = _subparser(sub, "serve", "an HTTP server for one engine: SGLang-compatible and OpenAI routes, RL controls "
                                 "(needs the server extra)")
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)


# ---- entry point --------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "log_level", None):
            show_logs(args.log_level)
        return args.func(args)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except UsageError as exc:
        message = str(exc)
        if args is not None and "--help')" not in message:  # a command's own check, after argparse's
            message += f" (see '{PROG} {args.command} --help')"
        return _fail(message, 2)
    except ValueError as exc:  # the engine's checks of its input, said as the flags that set it
        if os.environ.get("ROLLOUT_ENGINE_DEBUG") or args is None:
            return _fail(exc, 2, reraise=True)
        said = str(said_as_flags(exc))
        if said.startswith("argument "):  # a flag's: its help says what it takes (a file's problem has no flag)
            said += f" (see '{PROG} {args.command} --help')"
        return _fail(said, 2)
    except FileNotFoundError as exc:
        return _fail(exc, 2, reraise=True)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        return _fail(exc, 1, reraise=True)


def _fail(error: BaseException | str, status: int, reraise: bool = False) -> int:
    """Print `error` as one line and return `status`; with ROLLOUT_ENGINE_DEBUG
    set, raise an exception that did not come from our own checks instead."""
    if reraise and os.environ.get("ROLLOUT_ENGINE_DEBUG"):
        raise error  # type: ignore[misc]
    message = " ".join(str(error).split()) or type(error).__name__
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
