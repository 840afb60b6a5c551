"""Scoring sequences with the engine's own model and kernels (trainer side).

`score` gives the per-token logprobs of given sequences (raw, or processed
under given sampling parameters) in one forward-only pass per sequence,
through the engine: the trainer can check the engine's
rollout logprobs against it, or use it as its reference. With a
`deterministic=True` engine the scores equal the logprobs the engine
reported when it sampled those tokens, bit for bit (both are the same
computation on the same rows). `hf_gap` measures how far a Hugging Face
forward of the same model and dtype is from them."""
from __future__ import annotations

from typing import Sequence, Union

import torch

from rollout_engine.outputs import RolloutOutput
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.validation import Limits, token_list

Sequences = Sequence[Union[RolloutOutput, tuple[Sequence[int], Sequence[int]]]]


def _pairs(sequences: Sequences) -> list[tuple[list[int], list[int]]]:
    """The sequences as (prompt, output) lists of ints; errors name the
    caller's index (token ids are checked against a vocabulary later)."""
    if isinstance(sequences, RolloutOutput) or not isinstance(sequences, (list, tuple)):
        hint = " (put a single one in a list)" if isinstance(sequences, RolloutOutput) else ""
        raise ValueError(f"sequences must be a list of RolloutOutputs or (prompt_ids, output_ids) pairs, got "
                         f"{type(sequences).__name__}{hint}")
    pairs = []
    for i, s in enumerate(sequences):
        if isinstance(s, RolloutOutput):
            prompt, output = s.prompt_token_ids, s.output_token_ids
        elif isinstance(s, (tuple, list)) and len(s) == 2:
            prompt, output = s
        else:
            raise ValueError(f"sequences[{i}] must be a RolloutOutput or a (prompt_ids, output_ids) pair, got "
                             f"{type(s).__name__}")
        pairs.append((token_list(prompt, f"sequences[{i}] prompt"), token_list(output, f"sequences[{i}] output")))
        if not pairs[-1][0]:
            raise ValueError(f"sequences[{i}]: the prompt is empty (the first output token needs a context)")
    return pairs


def _check_fits(pairs: list[tuple[list[int], list[int]]], limits: Limits) -> None:
    """Every token in the engine's vocabulary, every sequence (plus the one
    position the scoring pass generates) within what it holds."""
    room = min(limits.max_context, limits.kv_capacity)
    for i, (prompt, output) in enumerate(pairs):
        for part, ids in (("prompt", prompt), ("output", output)):
            bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
            if bad is not None:
                raise ValueError(f"sequences[{i}] {part} contains {bad}, outside the vocabulary "
                                 f"[0, {limits.vocab_size})")
        if len(prompt) + len(output) + 1 > room:
            raise ValueError(f"sequences[{i}] has {len(prompt) + len(output)} tokens: scoring it needs one position "
                             f"more, and this engine holds at most {room} per sequence (the smaller of the model's "
                             f"context, {limits.max_context}, and the KV cache capacity, {limits.kv_capacity})")


def score(engine_or_model, sequences: Sequences, sampling_params: SamplingParams | None = None,
          **engine_kwargs) -> list[list[float]]:
    """Per sequence, the logprob of each output token given everything
    before it: raw (the model's log-softmax) without `sampling_params`, or
    as a token sampled under them is reported (their temperature, top-k,
    top-p, min-p and `logprob_mode`). `engine_or_model`: a RolloutEngine,
    or a model (name or folder) for a temporary engine built with
    `engine_kwargs`. With a deterministic engine the scores equal the
    logprobs it reported when it sampled those tokens, bit for bit."""
    from rollout_engine.engine import RolloutEngine

    if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams or None, got {type(sampling_params).__name__}")
    pairs = _pairs(sequences)
    if not pairs:
        return []
    own = not isinstance(engine_or_model, RolloutEngine)
    engine = RolloutEngine(engine_or_model, **engine_kwargs) if own else engine_or_model
    if sampling_params is None or sampling_params.logprob_mode == "raw":
        params = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=True)
    else:
        p = sampling_params
        params = SamplingParams(max_new_tokens=1, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                min_p=p.min_p, seed=0, prompt_logprobs=True, prompt_logprob_mode="processed")
    try:
        _check_fits(pairs, engine.limits)
        outs = engine.generate(input_ids=[p + o for p, o in pairs], sampling_params=params)
    finally:
        if own:
            engine.shutdown()
    return [list(out.prompt_logprobs[len(p):]) for out, (p, _) in zip(outs, pairs)]


def hf_gap(model_folder: str, sequences: Sequences, scores: list[list[float]], dtype: torch.dtype = torch.float32,
           device: str = "cpu") -> dict[str, float]:
    """Mean and max |score - Hugging Face logprob| over every output token,
    the HF model loaded from `model_folder` in `dtype` (needs transformers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=dtype).to(device).eval()
    gaps = []
    with torch.no_grad():
        for (prompt, output), ours in zip(_pairs(sequences), scores):
            ids = torch.tensor([prompt + output], device=device)
            logits = model(ids).logits[0, len(prompt) - 1: -1].float()
            ref = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
            gaps.append((ref.cpu() - torch.tensor(ours)).abs())
    gap = torch.cat(gaps) if gaps else torch.zeros(1)
    return {"mean_abs": float(gap.mean()), "max_abs": float(gap.max()), "tokens": int(gap.numel())}


def weights_checksum(named_tensors, dtype: torch.dtype | str, quantization: str | None = None) -> dict[str, str]:
    """The trainer's side of `RolloutEngine.weights_checksum`: name -> the
    same 16-hex-digit checksum, of each tensor cast to `dtype` (the engine's
    dtype), computed where the tensor is (one Triton pass on a GPU). Equal
    digests mean the engine holds exactly these values. `named_tensors`: a
    dict, or (name, tensor) pairs such as `model.named_parameters()` (names
    as the engine's, e.g. through integrations.fsdp.iter_hf_tensors).
    `quantization`: the engine's (`"fp8"`): the weights it quantizes are
    hashed as it holds them (rollout_engine/quantization.py), so equal
    digests still mean the engine holds exactly these weights, quantized."""
    from collections.abc import Mapping

    from rollout_engine.kernels.checksum import digest, many_sums, whole
    from rollout_engine.weights.loader import pairs

    resolved = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype (e.g. torch.bfloat16 or 'bfloat16')")
    dtype = resolved
    from rollout_engine.config import QUANTIZATIONS
    from rollout_engine.quantization import as_held, is_quantized

    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}")

    items = named_tensors.items() if isinstance(named_tensors, Mapping) else pairs(named_tensors)
    sums: dict[str, torch.Tensor] = {}
    pending: list[tuple[str, tuple]] = []  # GPU tensors hashed in batches of ~1 GiB (one launch each, one sum)

    def flush() -> None:
        for (name, _), row in zip(pending, many_sums([block for _, block in pending])):
            sums[name] = row
        pending.clear()

    with torch.no_grad():
        for name, tensor in items:
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{name}: expected a tensor, got {type(tensor).__name__}")
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # a DTensor shard
            held = as_held(full.detach(), dtype) if is_quantized(name, quantization) else full.detach().to(dtype)
            block = whole(held)
            if not full.is_cuda:
                sums[name] = many_sums([block])[0]
                continue
            pending.append((name, block))
            if sum(b[0].numel() * b[0].element_size() for _, b in pending) > 1 << 30:
                flush()
        flush()
        host = torch.stack([v.cpu() for v in sums.values()]).tolist() if sums else []
    return {name: digest((a, b)) for name, (a, b) in zip(sums, host)}
