"""The same requests through Hugging Face `generate`, in the same process."""
from __future__ import annotations

import time
from typing import Any

import torch

from rollout_engine.models.presets import PRESETS


def hf_model(model: str, dtype: torch.dtype = torch.bfloat16):
    """An HF model of the preset's (or folder's) shapes, random weights."""
    import transformers

    if model in PRESETS:
        kw = dict(PRESETS[model])
        arch = kw.pop("architectures")[0]
        config = transformers.AutoConfig.for_model(kw.pop("model_type"), **kw)
        config.architectures = [arch]
    else:
        config = transformers.AutoConfig.from_pretrained(model)
    with torch.device("cuda"):
        net = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    net.generation_config.eos_token_id = None  # run every request to its length, like ignore_eos
    return net.eval()


def run_hf(net, input_ids: list[list[int]], output_lens: list[int], temperature: float,
           batch_size: int) -> dict[str, Any]:
    """Left-padded batches; each batch runs to its longest output, and only
    the tokens each request asked for count."""
    useful, start = 0, time.perf_counter()
    for b in range(0, len(input_ids), batch_size):
        ids, outs = input_ids[b: b + batch_size], output_lens[b: b + batch_size]
        width = max(map(len, ids))
        tokens = torch.tensor([[0] * (width - len(x)) + x for x in ids], device="cuda")
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device="cuda")
        with torch.no_grad():
            net.generate(tokens, attention_mask=mask, max_new_tokens=max(outs), do_sample=temperature > 0,
                         temperature=temperature or None, top_p=1.0, top_k=0, pad_token_id=0)
        useful += sum(outs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"requests": len(input_ids), "batch_size": batch_size, "seconds": round(seconds, 3),
            "output_tokens": useful, "output_tok_per_s": round(useful / seconds, 1)}
