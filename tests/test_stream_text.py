"""Streamed text: complete characters only, stop strings never streamed, and a
stream adds up to what `generate` returns (the incremental detokenizer in
rollout_engine/detokenizer.py, shared with stop-string detection)."""
from __future__ import annotations

import gc

import pytest

from rollout_engine import RolloutEngine, SamplingParams
from rollout_engine.detokenizer import IncrementalDetokenizer
from rollout_engine.request import Request
from rollout_engine.scheduler.stop import StopChecker

FFFD = "\ufffd"
MIXED = "héllo wörld 你好 🙂 ok"


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def engine():
    return RolloutEngine("smollm2-135m", max_total_tokens=4096)


class CharTokenizer:
    """Token i is chr(i); id 0 is a special token (skipped)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


def char_ids(s: str) -> list[int]:
    return [ord(c) for c in s]


def run(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Increments of feeding `ids` one at a time, then the flush."""
    return [detok.feed([i]) for i in ids] + [detok.finish()]


# ---- (a) multi-byte characters --------------------------------------------------
def test_multibyte_chars_are_never_split(tok):
    ids = tok.encode(MIXED, add_special_tokens=False)
    assert any(tok.decode([i]).endswith(FFFD) for i in ids)  # the tokenizer does split characters
    detok = IncrementalDetokenizer(tok)
    incs = run(detok, ids)
    assert all(FFFD not in s for s in incs)
    assert "".join(incs) == tok.decode(ids) == MIXED == detok.text
    assert "" in incs[:-1]  # partial characters were held back
    assert "你" in incs and "好" in incs


@pytest.mark.parametrize("chunk", [2, 3, 5, 100])
def test_feeding_in_chunks_gives_the_same_text(tok, chunk):
    ids = tok.encode(MIXED, add_special_tokens=False) + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok)
    incs = [detok.feed(ids[i:i + chunk]) for i in range(0, len(ids), chunk)] + [detok.finish()]
    assert all(FFFD not in s for s in incs)
    assert "".join(incs) == tok.decode(ids, skip_special_tokens=True) == MIXED


def test_incomplete_char_at_the_end_is_flushed_like_decode(tok):
    ids = tok.encode("ok 你", add_special_tokens=False)
    ids = ids[:-1]  # cut inside 你
    detok = IncrementalDetokenizer(tok)
    incs = [detok.feed([i]) for i in ids]
    assert all(FFFD not in s for s in incs)
    last = detok.finish()
    assert last.endswith(FFFD)
    assert "".join(incs) + last == tok.decode(ids)


def test_decoding_window_stays_small(tok):
    calls = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode(MIXED * 30, add_special_tokens=False)
    detok = IncrementalDetokenizer(Counting(), stop=["never"])
    assert "".join(run(detok, ids)) == MIXED * 30
    assert len(calls) <= 2 * len(ids) + 1 and max(calls) <= 8  # linear, not a re-decode of everything


def test_stream_of_non_ascii_text(engine):
    ids = engine.apply_chat_template([{"role": "user", "content": "Write three emoji."}])
    params = SamplingParams(max_new_tokens=12, temperature=0)
    engine.flush_cache()  # both calls compute the prompt alike
    gen = engine.generate(input_ids=[ids], sampling_params=params)[0]
    engine.flush_cache()
    deltas = list(engine.stream(input_ids=[ids], sampling_params=params))
    tokens = [t for d in deltas for t in d.output_token_ids]
    assert tokens == gen.output_token_ids
    full = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    assert any(ord(c) > 0x7F for c in full)
    assert any(d.output_token_ids and d.text == "" for d in deltas)  # a partial character was held back
    assert all(FFFD not in d.text for d in deltas[:-1])
    assert FFFD not in deltas[-1].text or full.endswith(FFFD)  # only a cut inside a character at the end
    assert "".join(d.text for d in deltas) == gen.text == full
    assert engine.core.scheduler.stop.num_detokenizers == 0


# ---- (b) stop strings -----------------------------------------------------------
def test_stop_strings_stream_equals_generate(engine):
    # Greedy: "The capital of France is Paris." = The| capital| of| France| is| Paris|.|<|im_end|>
    ids = engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    cases = [
        (["ce is Pa"], "The capital of Fran"),  # spans three tokens, starts and ends inside one
        (["France is"], "The capital of "),  # spans two tokens
        (["xyz", "is Parma"], "The capital of France is Paris."),  # a prefix shows up, never completes
        (None, "The capital of France is Paris."),
    ]
    params = [SamplingParams(max_new_tokens=16, temperature=0, stop=stop) for stop, _ in cases]
    engine.flush_cache()  # both calls compute the prompt alike
    gens = engine.generate(input_ids=[ids] * len(cases), sampling_params=params)
    engine.flush_cache()
    deltas = list(engine.stream(input_ids=[ids] * len(cases), sampling_params=params, request_ids=list("abcd")))
    for rid, (stop, want), gen in zip("abcd", cases, gens):
        mine = [d for d in deltas if d.request_id == rid]
        text = "".join(d.text for d in mine)
        tokens = [t for d in mine for t in d.output_token_ids]
        logprobs = [lp for d in mine for lp in d.output_logprobs]
        assert text == gen.text == want
        assert tokens == gen.output_token_ids and logprobs == pytest.approx(gen.output_logprobs, abs=1e-4)
        assert len(tokens) == len(logprobs)
        assert [d.finish_reason for d in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1].finish_reason == gen.finish_reason == "stop"
        full = engine.tokenizer.decode(tokens, skip_special_tokens=True)
        if stop and want != full:
            # Every sampled token is kept, the stop string's included; the
            # text ends right before the stop string, and no delta shows it.
            (s,) = [s for s in stop if s in full]
            assert full.startswith(want + s)
            assert s not in engine.tokenizer.decode(tokens[:-1]) and s not in engine.tokenizer.decode(tokens[-1:])
            assert all(s not in d.text for d in mine)
    # "is", a prefix of "is Parma", was held back and came out once it diverged.
    mine = [d for d in deltas if d.request_id == "c"]
    held = [d for d in mine if engine.tokenizer.decode(d.output_token_ids).endswith(" is")]
    assert held and all(not d.text.endswith("is") for d in held)
    assert engine.core.scheduler.stop.num_detokenizers == 0


def test_seeded_sampling_stream_equals_generate(engine):
    ids = engine.apply_chat_template([{"role": "user", "content": "Say hello in Chinese and Japanese."}])
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7, n=2, stop=["。", "\n"])
    engine.flush_cache()  # both calls compute the prompt alike
    gens = engine.generate(input_ids=[ids], sampling_params=params, request_ids=["g"])
    engine.flush_cache()
    deltas = list(engine.stream(input_ids=[ids], sampling_params=params, request_ids=["s"]))
    for j, gen in enumerate(gens):
        mine = [d for d in deltas if d.request_id == f"s-{j}"]
        assert [t for d in mine for t in d.output_token_ids] == gen.output_token_ids
        assert "".join(d.text for d in mine) == gen.text
        assert all(FFFD not in d.text for d in mine[:-1])
        assert "。" not in gen.text and "\n" not in gen.text
    assert engine.core.scheduler.stop.num_detokenizers == 0


def test_aborted_stream_keeps_tokens_and_text(engine):
    ids = engine.apply_chat_template([{"role": "user", "content": "Write three emoji."}])
    params = SamplingParams(max_new_tokens=64, temperature=0, stop=["never seen"])
    deltas = []
    for d in engine.stream(input_ids=[ids], sampling_params=params, request_ids=["ab"]):
        deltas.append(d)
        if len(deltas) == 4:
            engine.abort(["ab"])
    assert deltas[-1].finish_reason == "abort"
    tokens = [t for d in deltas for t in d.output_token_ids]
    assert 4 <= len(tokens) < 64
    assert "".join(d.text for d in deltas) == engine.tokenizer.decode(tokens, skip_special_tokens=True)
    assert engine.core.scheduler.stop.num_detokenizers == 0


# ---- (c) hold-back logic ----------------------------------------------------------
def test_stop_prefix_is_held_then_released():
    detok = IncrementalDetokenizer(CharTokenizer(), stop=["abc"])
    assert run(detok, char_ids("xabd")) == ["x", "", "", "abd", ""]
    assert detok.text == "xabd" and not detok.stopped


def test_stop_string_and_what_follows_are_dropped():
    detok = IncrementalDetokenizer(CharTokenizer(), stop=["abc"])
    assert run(detok, char_ids("xabcde")) == ["x", "", "", "", "", "", ""]
    assert detok.stopped and detok.text == "x" and detok.num_tokens == 6


def test_held_tail_is_released_at_finish():
    detok = IncrementalDetokenizer(CharTokenizer(), stop=["abc"])
    assert run(detok, char_ids("xab")) == ["x", "", "", "ab"]
    assert detok.finish() == "" and detok.text == "xab"
    with pytest.raises(RuntimeError):
        detok.feed([1])


def test_overlapping_prefixes():
    # "aab" after "aa": the held tail shrinks to the longest still-possible start.
    detok = IncrementalDetokenizer(CharTokenizer(), stop=["aab"])
    assert run(detok, char_ids("aaab")) == ["", "", "a", "", ""]
    assert detok.text == "a" and detok.stopped


def test_first_stop_string_in_the_text_wins():
    # "cd" completes before "bcde" could: the text is cut before "cd".
    detok = IncrementalDetokenizer(CharTokenizer(), stop=["bcde", "cd"])
    assert "".join(run(detok, char_ids("abcdef"))) == "ab"
    # Both complete with the same token: the one that starts first wins.
    detok = IncrementalDetokenizer(CharTokenizer(), stop=["cd", "bcd"])
    assert detok.feed(char_ids("ab")) == "a"
    assert detok.feed(char_ids("cd")) == "" and detok.text == "a"


def test_stop_string_inside_one_multi_char_token():
    class WordTokenizer:
        words = ["", "hello", " wor", "ld", "!"]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.words[i] for i in ids)

    detok = IncrementalDetokenizer(WordTokenizer(), stop=["lo w"])
    assert run(detok, [1, 2, 3]) == ["hel", "", "", ""]
    detok = IncrementalDetokenizer(WordTokenizer(), stop=["o wo", "ld!"])
    assert run(detok, [1, 2, 3, 4]) == ["hell", "", "", "", ""]  # "o" held, then "o wo" found
    assert detok.text == "hell"


def test_special_tokens_are_skipped():
    detok = IncrementalDetokenizer(CharTokenizer(), stop=["b"])
    assert run(detok, [ord("a"), 0, 0, ord("c")]) == ["a", "", "", "c", ""]


def test_read_cursor():
    detok = IncrementalDetokenizer(CharTokenizer())
    detok.feed(char_ids("ab"))
    detok.feed(char_ids("c"))
    assert detok.read() == "abc" and detok.read() == ""
    detok.feed(char_ids("d"))
    detok.feed(char_ids("e"))
    assert detok.read() == "de"
    assert detok.read(from_start=True) == "abcde" and detok.read() == ""


def test_stop_checker_finds_a_stop_string_across_tokens(tok):
    ids = tok.encode("The capital of France is Paris.", add_special_tokens=False)
    checker = StopChecker((tok.eos_token_id,), 8192, tok)
    req = Request(request_id="r", prompt_ids=[1], params=SamplingParams(stop=["ce is Pa"], max_new_tokens=99), seed=0)
    reasons = []
    for t in ids:
        req.output_ids.append(t)
        reasons.append(checker.check(req))
        if reasons[-1]:
            break
    assert reasons[-1] == "stop" and reasons[:-1] == [None] * (len(reasons) - 1)
    assert req.text == "The capital of Fran"
    assert tok.decode(req.output_ids).startswith("The capital of France is Pa")
    assert checker.num_detokenizers == 1
    del req
    gc.collect()
    assert checker.num_detokenizers == 0  # an entry goes with its request


def test_stop_checker_without_tokenizer_keeps_text_none():
    checker = StopChecker((2,), 8192)
    req = Request(request_id="r", prompt_ids=[1], params=SamplingParams(max_new_tokens=2), seed=0)
    req.output_ids += [5, 6]
    assert checker.check(req) == "length"
    assert checker.detokenizer(req) is None and req.text is None
