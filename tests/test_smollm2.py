"""The real default model, SmolLM2-135M-Instruct: token parity with HF on chat prompts."""
from __future__ import annotations

import pytest
import torch

from rollout_engine import RolloutEngine, SamplingParams

CHATS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the moon.",
    "How many legs does a spider have?",
]


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    engine = RolloutEngine(smollm2_dir, max_total_tokens=4096)
    return engine


def test_greedy_chat_matches_hf(smol, smollm2_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos: run the full length
    ids = [smol.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    outs = smol.generate(input_ids=ids, sampling_params=params)
    for prompt, out in zip(ids, outs):
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=40, do_sample=False, pad_token_id=2)
        assert out.output_token_ids == ref[0, len(prompt):].tolist()
        assert len(out.output_token_ids) >= 32
    assert "Paris" in outs[0].text


def test_text_prompts_and_stop_strings(smol):
    chat = smol.apply_chat_template([{"role": "user", "content": CHATS[0]}])
    prompt_text = smol.tokenizer.decode(chat)
    out = smol.generate(prompts=[prompt_text], sampling_params=SamplingParams(
        max_new_tokens=40, temperature=0, stop=["France"]))[0]
    assert out.finish_reason == "stop"
    assert "France" not in out.text and out.text  # the stop string is cut off
    full = smol.tokenizer.decode(out.output_token_ids)
    assert "France" in full


def test_an_empty_text_prompt_is_named(smol):
    with pytest.raises(ValueError, match=r"^request 1: prompts holds an empty string"):
        smol.generate(prompts=["Hi", ""], sampling_params=SamplingParams(max_new_tokens=2))
    assert len(smol.generate(prompts=["Hi"], sampling_params=SamplingParams(max_new_tokens=2))[0].output_token_ids)


@pytest.mark.slow  # up to 200 tokens of real SmolLM2 (~20 s on 2 cores); run by .ci/run after the fast tests
def test_eos_finishes_with_stop(smol):
    ids = smol.apply_chat_template([{"role": "user", "content": CHATS[3]}])
    out = smol.generate(input_ids=[ids], sampling_params=SamplingParams(max_new_tokens=200, temperature=0))[0]
    assert out.finish_reason == "stop"
    assert out.output_token_ids[-1] == smol.tokenizer.eos_token_id


def test_a_chat_the_template_refuses_is_a_value_error_with_its_reason():
    """A template's own refusal (jinja's raise_exception: roles out of order)."""
    import jinja2

    from rollout_engine.tokenizer import chat_token_ids

    class Strict:
        def apply_chat_template(self, messages, **kw):
            raise jinja2.exceptions.TemplateError("Conversation roles must alternate user/assistant/user/assistant")

    with pytest.raises(ValueError, match="messages: the model's chat template refuses them .*roles must alternate"):
        chat_token_ids(Strict(), [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
