"""`rollout-engine` refusing bad input: one line on standard error, exit
status 2, before any model loads (flags, prompts, models, devices,
misspellings), and errors escaping a command as one line too."""
from __future__ import annotations

import pytest
import torch

from cli_errors import one_line_error
from rollout_engine import cli
from rollout_engine.cli import main

@pytest.mark.parametrize("flags, named", [
    (["-n", "0"], "-n"),
    (["--temperature", "-1"], "--temperature"),
    (["--max-new-tokens", "-1"], "--max-new-tokens"),
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
    assert main(["bench", "--model", "no-such-model"]) == 2  # bench's dummy weights: the presets, and the zoo
    line = one_line_error(capsys)
    assert "qwen3-0.6b" in line and "with --load-format auto, a zoo model (smollm2-135m)" in line, line



def test_a_folder_that_is_no_model_is_named(tmp_path, capsys, no_model_load):
    assert main(["generate", "--model", str(tmp_path), "--input-ids", "1"]) == 2
    line = one_line_error(capsys)
    assert "--model" in line and "without a config.json" in line
    (tmp_path / "config.json").write_text("{not json")
    assert main(["generate", "--model", str(tmp_path), "--input-ids", "1"]) == 2
    line = one_line_error(capsys)
    assert "--model" in line and "config.json that is not valid JSON (Expecting property name" in line, line
    from rollout_engine import RolloutEngine

    with pytest.raises(ValueError, match="config.json that is not valid JSON"):
        RolloutEngine(str(tmp_path), device="cpu")


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


@pytest.mark.parametrize("argv, flag, extra, module", [
    (["--workload", "serve"], "--workload", "server", "httpx"),
    (["--workload", "grpo", "--replicas", "2"], "--replicas", "ray", "ray"),
])
def test_a_bench_workload_whose_extra_is_missing_is_one_line_before_the_model_loads(llama, argv, flag, extra, module,
                                                                                    capsys, monkeypatch):
    import importlib.util

    from rollout_engine.bench import run

    def never(args):
        raise AssertionError("the benchmark started")
    monkeypatch.setattr(run, "main", never)
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else found(name, *a))
    assert main(["bench", "--model", llama[1], *argv]) == 2
    line = one_line_error(capsys)
    assert f"argument {flag}" in line and module in line and f".[{extra}]" in line, line
    if module == "ray":  # --replicas only does something for grpo: elsewhere the run goes on (to the benchmark)
        with pytest.raises(AssertionError, match="the benchmark started"):
            main(["bench", "--model", llama[1], "--workload", "weights", "--replicas", "2"])


def test_serve_without_the_server_extra_is_one_line_naming_it(llama, capsys, monkeypatch, no_model_load):
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else found(name, *a))
    assert main(["serve", "--model", llama[1]]) == 2
    line = one_line_error(capsys)
    assert "serve needs uvicorn: pip install -e '.[server]'" in line, line
