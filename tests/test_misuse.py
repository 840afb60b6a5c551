"""Bad input and misuse, as a new user would try them, on one long-lived
engine (SmolLM2, so text prompts and stop strings are covered): each case
raises the right exception naming the field, and a normal greedy generate
right after gives the same tokens as before the misuse."""
from __future__ import annotations

import asyncio
import gc
import math
import signal
import threading
import weakref

import numpy as np
import pytest
import torch

from rollout_engine import RolloutEngine, SamplingParams, fidelity

GREEDY = SamplingParams(max_new_tokens=8, temperature=0)
PROMPT = ["What is the capital of France?"]


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return RolloutEngine(smollm2_dir, max_total_tokens=2048)


@pytest.fixture(scope="module")
def baseline(engine):
    return engine.generate(PROMPT, sampling_params=GREEDY)[0].output_token_ids


def _sp(**kw):
    return lambda e: SamplingParams(**kw)


def _gen(**kw):
    return lambda e: e.generate(**kw)


def _stream(**kw):
    return lambda e: list(e.stream(**kw))


def _nan_update(e):
    w = e.get_weight("model.layers.0.mlp.down_proj.weight")
    w[0, 0] = float("nan")
    e.update_weights({"model.layers.0.mlp.down_proj.weight": w})


def _restore(e):
    """After a refused update the weights are a mix: load them all again."""
    from rollout_engine.weights.loader import iter_safetensors

    e.update_weights(list(iter_safetensors(e.config.model)))


def _score(sequences):
    return lambda e: fidelity.score(e, sequences)


def _paused_generate(e):
    e.pause_generation("keep")
    e.generate(PROMPT, sampling_params=GREEDY)


# (id, action, exception, words the message must contain, clean-up)
CASES = [
    ("max_new_tokens=-1", _sp(max_new_tokens=-1), ValueError, "max_new_tokens", None),
    ("max_new_tokens=1.5", _sp(max_new_tokens=1.5), ValueError, "max_new_tokens", None),
    ("temperature=-1", _sp(temperature=-1.0), ValueError, "temperature", None),
    ("temperature=inf", _sp(temperature=math.inf), ValueError, "temperature", None),
    ("temperature=nan", _sp(temperature=math.nan), ValueError, "temperature", None),
    ("temperature='hot'", _sp(temperature="hot"), ValueError, "temperature", None),
    ("top_p=0", _sp(top_p=0.0), ValueError, "top_p", None),
    ("top_p=1.5", _sp(top_p=1.5), ValueError, "top_p", None),
    ("top_p=nan", _sp(top_p=math.nan), ValueError, "top_p", None),
    ("top_k=-2", _sp(top_k=-2), ValueError, "top_k", None),
    ("min_p=2", _sp(min_p=2.0), ValueError, "min_p", None),
    ("n=0", _sp(n=0), ValueError, "sampling_params.n ", None),
    ("seed=-1", _sp(seed=-1), ValueError, "seed", None),
    ("seed=2**64", _sp(seed=2**64), ValueError, "seed", None),
    ("seed+n-1 overflows", _sp(seed=2**63 - 1, n=2), ValueError, "seed", None),
    ("seed='1'", _sp(seed="1"), ValueError, "seed", None),
    ("stop_token_ids=[-1]", _sp(stop_token_ids=[-1]), ValueError, "stop_token_ids", None),
    ("stop=['']", _sp(stop=[""]), ValueError, "stop", None),
    ("stop='x'", _sp(stop="x"), ValueError, "stop", None),
    ("top_logprobs=-1", _sp(top_logprobs=-1), ValueError, "top_logprobs", None),
    ("logprob_mode", _sp(logprob_mode="bogus"), ValueError, "logprob_mode", None),
    ("ignore_eos='yes'", _sp(ignore_eos="yes"), ValueError, "ignore_eos", None),
    ("no prompts", _gen(), ValueError, "prompts", None),
    ("prompts and input_ids", _gen(prompts=PROMPT, input_ids=[[1]]), ValueError, "prompts", None),
    ("prompts is a string", _gen(prompts="hi"), ValueError, "prompts must be a list of strings, got one string: "
                                                            "pass ['hi']", None),
    ("empty prompt", _gen(prompts=[""]), ValueError, "prompts", None),
    ("prompt not a string", _gen(prompts=[3]), ValueError, "prompts", None),
    ("empty input_ids", _gen(input_ids=[[]]), ValueError, "input_ids", None),
    ("float token", _gen(input_ids=[[1.5]]), ValueError, "integer", None),
    ("nested token", _gen(input_ids=[[[1, 2]]]), ValueError, "nested", None),
    ("token >= vocab", _gen(input_ids=[[10**6]]), ValueError, "vocabulary", None),
    ("negative token", _gen(input_ids=[[-1]]), ValueError, "vocabulary", None),
    ("input_ids a string", _gen(input_ids="abc"), ValueError, "input_ids", None),
    ("input_ids one flat list", _gen(input_ids=[1, 2, 3]), ValueError, "for one prompt pass [ids]", None),
    ("input_ids one flat array", _gen(input_ids=np.array([1, 2, 3])), ValueError, "for one prompt pass [ids]", None),
    ("params list too short", _gen(prompts=PROMPT * 2, sampling_params=[GREEDY]), ValueError, "sampling_params",
     None),
    ("params not SamplingParams", _gen(prompts=PROMPT, sampling_params=[{"n": 1}]), ValueError, "sampling_params",
     None),
    ("duplicate request ids", _gen(prompts=PROMPT * 2, request_ids=["a", "a"]), ValueError, "request_ids", None),
    ("sample ids clash", _gen(prompts=PROMPT * 2, request_ids=["a", "a-1"],
                              sampling_params=[SamplingParams(n=2), SamplingParams()]), ValueError, "'a-1'", None),
    ("request ids wrong length", _gen(prompts=PROMPT, request_ids=["a", "b"]), ValueError, "request_ids", None),
    ("beyond the context", _gen(prompts=PROMPT, sampling_params=SamplingParams(max_new_tokens=10**6)), ValueError,
     "max_new_tokens", None),
    ("top_logprobs > vocab", _gen(prompts=PROMPT, sampling_params=SamplingParams(top_logprobs=10**6)), ValueError,
     "top_logprobs", None),
    ("stop token outside vocab", _gen(prompts=PROMPT, sampling_params=SamplingParams(stop_token_ids=[10**6])),
     ValueError, "stop_token_ids", None),
    ("stream, bad token", _stream(input_ids=[[10**6]]), ValueError, "input_ids", None),
    ("stream, bad params list", _stream(prompts=PROMPT, sampling_params=[]), ValueError, "sampling_params", None),
    ("score: sequences a number", _score(5), ValueError, "sequences must be a list", None),
    ("score: sequences None", _score(None), ValueError, "sequences must be a list", None),
    ("score: one output, not a list", lambda e: fidelity.score(e, e.generate(PROMPT, sampling_params=GREEDY)[0]),
     ValueError, "sequences must be a list", None),
    ("score: prompt a number", _score([(5, [1])]), ValueError, "sequences[0] prompt", None),
    ("score: token >= vocab", _score([([1, 2], [3]), ([1, 2], [3, 10**6])]), ValueError,
     "sequences[1] output contains 1000000", None),
    ("score: float token", _score([([1, 2.5], [3])]), ValueError, "sequences[0] prompt must hold integer", None),
    ("score: beyond the context", _score([([1] * 8192, [2])]), ValueError, "sequences[0] has 8193 tokens", None),
    ("update: unknown name", lambda e: e.update_weights({"nope.weight": torch.zeros(2)}), ValueError, "nope.weight",
     None),
    ("update: wrong shape", lambda e: e.update_weights({"model.norm.weight": torch.zeros(3)}), ValueError,
     "shape", None),
    ("update: NaN", _nan_update, ValueError, "down_proj", _restore),
    ("update: bad version", lambda e: e.update_weights({}, version=-1), ValueError, "version", None),
    ("update: version past 64 bits", lambda e: e.update_weights({}, version=2**70), ValueError,
     "version must be an integer in [0, 9223372036854775807]", None),
    ("update from a missing folder", lambda e: e.update_weights_from_disk("/nonexistent"), ValueError, "path", None),
    ("get_weight unknown", lambda e: e.get_weight("nope"), ValueError, "nope", None),
    ("release without memory saver", lambda e: e.release_memory(), RuntimeError, "enable_memory_saver", None),
    ("release an unknown tag", lambda e: e.release_memory(["bogus"]), ValueError,  # the input first, whatever the state
     "tags: unknown ['bogus']; known: ['weights', 'kv_cache', 'cuda_graph']", None),
    ("pause mode", lambda e: e.pause_generation("bogus"), ValueError, "mode", None),
    ("abort with a string", lambda e: e.abort("req-1"), ValueError, "request_ids", None),
    ("generate while paused", _paused_generate, RuntimeError, "paused", lambda e: e.continue_generation()),
    ("generate(temperature=)", lambda e: e.generate(PROMPT, temperature=0.5), TypeError,
     "'temperature' (a sampling parameter: pass it in SamplingParams, as sampling_params=", None),
    ("params where input_ids go", lambda e: e.generate(PROMPT, GREEDY), ValueError,
     "the second positional argument is input_ids", None),
    ("stream(top_k=)", lambda e: list(e.stream(PROMPT, top_k=3)), TypeError, "RolloutEngine.stream() got", None),
    ("generate_async misspelled", lambda e: asyncio.run(e.generate_async(PROMPT, sampling_param=GREEDY)), TypeError,
     "did you mean 'sampling_params'", None),
    ("chat template of a string", lambda e: e.apply_chat_template("hi"), ValueError,
     "messages: a list of {'role': ..., 'content': ...} dicts, got a string; for one user turn pass", None),
    ("chat turn without content", lambda e: e.apply_chat_template([{"role": "user"}]), ValueError,
     "messages[0]: a dict with a 'role' string and a 'content'", None),
    ("chat turn of a number", lambda e: e.apply_chat_template([{"role": "user", "content": 5}]), ValueError,
     "messages[0]: content must be a string (or a list of parts), got int", None),
    ("chat of no turns", lambda e: e.apply_chat_template([]), ValueError, "messages: empty", None),
    ("chat content the template cannot join", lambda e: e.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]), ValueError,
     "messages: the model's chat template refuses them", None),
]


@pytest.mark.parametrize("action,exc,words,cleanup", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_misuse_is_refused_and_the_engine_stays_usable(engine, baseline, action, exc, words, cleanup):
    with pytest.raises(exc) as info:
        action(engine)
    assert words in str(info.value), str(info.value)
    if cleanup is not None:
        cleanup(engine)
    assert engine.generate(PROMPT, sampling_params=GREEDY)[0].output_token_ids == baseline
    engine.check_integrity()


def _within(seconds, fn):
    """fn() on a thread: its result, or a failure once `seconds` pass
    (a call that hangs fails the test instead of blocking the suite)."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"no answer after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


async def _collect(stream):
    return [out async for out in stream]


EMPTY_CALLS = {
    "generate input_ids": lambda e: e.generate(input_ids=[]),
    "generate prompts": lambda e: e.generate(prompts=[], sampling_params=[], progress=True),
    "stream": lambda e: list(e.stream(input_ids=[])),
    "generate_async": lambda e: asyncio.run(e.generate_async(prompts=[])),
    "stream_async": lambda e: asyncio.run(_collect(e.stream_async(input_ids=[]))),
    "fidelity.score": lambda e: fidelity.score(e, []),
    "fidelity.score processed": lambda e: fidelity.score(e, (), SamplingParams(temperature=0.7, top_k=5)),
}


@pytest.mark.parametrize("kwargs,words", [({"max_total_token": 4096}, "did you mean 'max_total_tokens'"),
                                          ({"bogus": 1}, "'bogus'"),
                                          ({"temperature": 0.5}, "a sampling parameter: pass it in SamplingParams")])
def test_an_unknown_engine_option_is_named_as_the_engines(kwargs, words):
    """Refused before anything loads, naming RolloutEngine (not an internal
    class) and the closest option."""
    with pytest.raises(TypeError, match=f"RolloutEngine\\(\\) got an unexpected keyword argument .*{words}"):
        RolloutEngine("smollm2-135m", **kwargs)


@pytest.mark.parametrize("model,kwargs,end", [
    ("smollm2-135m", {"dtype": "fp16"}, "got 'fp16'; did you mean 'float16'?"),
    ("smollm2-135m", {"dtype": torch.bfloat16}, "got torch.bfloat16; did you mean 'bfloat16'?"),
    ("smollm2-135m", {"dtype": "int8"}, "got 'int8'"),
    ("smolm2-135m", {}, "or a preset with load_format='dummy'; did you mean 'smollm2-135m'?"),
    ("qwen3-0.6b", {}, "it is a preset, shapes without weights or a tokenizer: pass load_format='dummy' for random "
                       "weights of its shapes"),
])
def test_a_wrong_model_or_dtype_names_the_closest(model, kwargs, end):
    """Refused before anything loads, with the value meant where one is close."""
    with pytest.raises(ValueError) as exc:
        RolloutEngine(model, device="cpu", **kwargs)
    assert str(exc.value).endswith(end), exc.value


@pytest.mark.parametrize("kwargs,words", [({"temprature": 0.5}, "did you mean 'temperature'"),
                                          ({"max_tokens": 8}, "did you mean 'max_new_tokens'"),
                                          ({"bogus": 1}, "'bogus' \\(the options: rollout_engine.SamplingParams")])
def test_an_unknown_sampling_parameter_names_the_closest_field(kwargs, words):
    with pytest.raises(TypeError, match=f"SamplingParams\\(\\) got an unexpected keyword argument .*{words}"):
        SamplingParams(**kwargs)
    assert SamplingParams(temperature=0.5, max_new_tokens=8).max_new_tokens == 8  # known ones as before


@pytest.mark.parametrize("call", EMPTY_CALLS.values(), ids=EMPTY_CALLS.keys())
def test_no_prompts_give_no_outputs_at_once(engine, baseline, call):
    assert _within(10, lambda: call(engine)) == []
    assert engine.num_unfinished_requests() == 0
    assert engine.generate(PROMPT, sampling_params=GREEDY)[0].output_token_ids == baseline


def test_enough_misuse_cases():
    assert len(CASES) >= 40


def test_a_refused_update_changes_nothing_and_generation_goes_on(engine, baseline):
    version = engine.weight_version
    with pytest.raises(ValueError, match="NaN"):
        _nan_update(engine)
    assert engine.weight_version == version and engine.metrics()["invalid_weights"] == 0
    assert engine.generate(PROMPT, sampling_params=GREEDY)[0].output_token_ids == baseline


def test_numpy_and_torch_token_ids_are_accepted(engine):
    ids = engine.tokenizer.encode(PROMPT[0])
    want = engine.generate(input_ids=[ids], sampling_params=GREEDY)[0].output_token_ids
    for form in (np.array(ids), [np.int64(t) for t in ids], torch.tensor(ids), [torch.tensor(t) for t in ids]):
        assert engine.generate(input_ids=[form], sampling_params=GREEDY)[0].output_token_ids == want
    assert engine.generate(input_ids=np.array([ids]), sampling_params=GREEDY)[0].output_token_ids == want


def test_an_abort_never_reaches_later_requests(engine, baseline):
    assert engine.abort() == 0  # idle: nothing to stop
    assert engine.abort(["job-1"]) == 0  # not submitted yet
    out = engine.generate(PROMPT, sampling_params=GREEDY, request_ids=["job-1"])[0]
    assert out.finish_reason != "abort" and out.output_token_ids == baseline


def test_memory_state_lists_only_held_tags(engine):
    assert engine.memory_state() == {"weights": "resident", "kv_cache": "resident"}


def test_shutdown_frees_the_engine_and_refuses_later_calls(smollm2_dir):
    engine = RolloutEngine(smollm2_dir, max_total_tokens=512)
    engine.generate(PROMPT, sampling_params=GREEDY)
    weight = weakref.ref(next(engine.core.parts.model.parameters()))
    engine.shutdown()
    gc.collect()
    assert weight() is None
    for call in (lambda: engine.generate(PROMPT), lambda: list(engine.stream(PROMPT)), engine.memory_state,
                 lambda: engine.update_weights({}), engine.flush_cache, lambda: engine.abort()):
        with pytest.raises(RuntimeError, match="engine is shut down"):
            call()
    engine.shutdown()  # a second shutdown is harmless


def test_a_model_too_large_for_memory_is_refused_with_its_size(monkeypatch):
    from rollout_engine.runner import model_loader

    monkeypatch.setattr(model_loader, "available_bytes", lambda device: 1 << 30)
    with pytest.raises(ValueError, match=r"needs 2\.\d GiB .* only 1\.0 GiB") as info:
        RolloutEngine("qwen3-0.6b", load_format="dummy", device="cpu", dtype="float32", max_total_tokens=64)
    assert "qwen3-0.6b" in str(info.value)


CLI_CASES = [
    (["generate", "-n", "0", "hi"], "-n"),
    (["generate", "--temperature", "-1", "hi"], "--temperature"),
    (["generate", "--page-size", "3", "hi"], "--page-size"),
    (["generate", "--dtype", "foo", "hi"], "--dtype"),
    (["generate", "--max-new-tokens", "abc", "hi"], "--max-new-tokens"),
    (["generate", "--seed", "-5", "hi"], "--seed"),
    (["bench", "--workload", "nope"], "--workload"),
]


@pytest.mark.parametrize("argv,flag", CLI_CASES, ids=[" ".join(a) for a, _ in CLI_CASES])
def test_cli_misuse_is_one_line_and_the_engine_stays_usable(engine, baseline, argv, flag, capsys, monkeypatch):
    from rollout_engine import cli

    monkeypatch.setattr(cli, "_make_engine", lambda config: pytest.fail("the model was loaded"))
    try:
        status = cli.main(argv)
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and flag in err, err
    assert engine.generate(PROMPT, sampling_params=GREEDY)[0].output_token_ids == baseline


def test_closing_a_stream_early_aborts_its_requests(engine, baseline):
    long = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True, n=2)
    it = engine.stream(PROMPT, sampling_params=long)
    next(it), next(it)
    assert engine.num_unfinished_requests() == 2
    it.close()
    assert engine.num_unfinished_requests() == 0
    engine.check_integrity()
    assert engine.generate(PROMPT, sampling_params=GREEDY)[0].output_token_ids == baseline


def test_ctrl_c_in_generate_aborts_its_requests(engine, baseline, monkeypatch):
    step = engine.core.scheduler.step
    calls = []

    def interrupted_step():  # on the engine's loop thread: a real SIGINT reaches the waiting main thread
        calls.append(1)
        if len(calls) == 3:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        return step()

    assert engine.num_unfinished_requests() == 0
    monkeypatch.setattr(engine.core.scheduler, "step", interrupted_step)
    # As run from a terminal: a suite started as a background job has SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.generate(PROMPT * 3, sampling_params=SamplingParams(max_new_tokens=1000, temperature=0,
                                                                       ignore_eos=True))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert engine.num_unfinished_requests() == 0
    assert len(calls) < 500  # the wait was interrupted, not the whole rollout run
    monkeypatch.undo()
    engine.check_integrity()
    assert engine.generate(PROMPT, sampling_params=GREEDY)[0].output_token_ids == baseline


def test_metrics_snapshot_counts_what_ran(engine):
    before = engine.metrics()
    outs = engine.generate(PROMPT * 2, sampling_params=SamplingParams(max_new_tokens=5, temperature=0,
                                                                       ignore_eos=True, n=2))
    after = engine.metrics()
    assert after["output_tokens"] - before["output_tokens"] == sum(len(o.output_token_ids) for o in outs) == 20
    assert after["finished"]["length"] - before["finished"].get("length", 0) == 4
    assert after["steps_timed"] > before["steps_timed"] and after["step_seconds_mean"] > 0
    assert after["ttft_count"] - before["ttft_count"] == 4 and after["ttft_seconds_mean"] > 0
    assert after["running_requests"] == after["waiting_requests"] == 0
    assert after["cache"]["queried_tokens"] > before["cache"]["queried_tokens"]
    assert after["memory"] == {"weights": "resident", "kv_cache": "resident"}
    assert after["weight_version"] == engine.weight_version


def test_closing_a_stream_while_paused_runs_no_batch(engine, baseline):
    other = engine.core.add_requests(PROMPT, None, SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True),
                                  None)
    it = engine.stream(PROMPT, sampling_params=SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True))
    next(it)
    engine.pause_generation("keep")
    held = [r.num_output_tokens for r in other]
    it.close()
    assert [r.num_output_tokens for r in other] == held and not any(r.finished for r in other)
    assert engine.num_unfinished_requests() == len(other)
    engine.abort()
    engine.continue_generation()
    assert engine.generate(PROMPT, sampling_params=GREEDY)[0].output_token_ids == baseline
    assert engine.num_unfinished_requests() == 0
