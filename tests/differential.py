"""Differential stress testing of the engine against a reference forward that
does not share its fast path.

A random sequence of calls runs on one long-lived engine (prompts sharing
prefixes at random lengths, repeated prompts, follow-up turns, n > 1, random
`max_new_tokens` including 1, aborts mid-stream, batches that grow and shrink).
Every output is then teacher-forced through the reference (a Hugging Face
model in fp32) and checked token by token:

- greedy: the emitted token's reference logprob is within `margin` nats of
  the reference's best token at that position (robust to near-ties in low
  precision; a token continuing another request's context is off by nats);
- every token (greedy or sampled, logprobs asked in "raw" mode): the
  engine's logprob is within `logprob_tol` of the reference's.

The largest gaps seen are reported, so the margins can be tightened.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from rollout_engine import SamplingParams


MEAN_MIN_TOKENS = 16


@dataclass
class Call:
    prompts: list[list[int]]
    params: list[SamplingParams]
    # Abort request `abort_index` (of the call's outputs) after this many
    # streamed deltas; None: a plain generate.
    abort_after: int | None = None
    abort_index: int = 0


@dataclass
class Report:
    requests: int = 0
    calls: int = 0
    tokens: int = 0
    aborted: int = 0
    max_greedy_gap: float = 0.0  # reference best - reference logprob of the emitted greedy token
    max_logprob_diff: float = 0.0  # |engine raw logprob - reference logprob|
    max_mean_diff: float = 0.0  # the same, averaged over one request's tokens
    violations: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.calls} calls, {self.requests} requests, {self.tokens} tokens, {self.aborted} aborted; "
                f"largest greedy gap {self.max_greedy_gap:.4f} nats, largest logprob difference "
                f"{self.max_logprob_diff:.4f} (largest request mean {self.max_mean_diff:.4f}); "
                f"{len(self.violations)} violations")


class WorkloadGenerator:
    """Random calls whose prompts overlap the way RL traffic does."""

    def __init__(self, seed: int, token_range: tuple[int, int], base_prompts: list[list[int]] | None = None,
                 max_prompt_len: int = 80, max_new_tokens: int = 24, max_batch: int = 40):
        self.rng = random.Random(seed)
        self.lo, self.hi = token_range
        self.base = base_prompts or []
        self.max_prompt_len = max_prompt_len
        self.max_new_tokens = max_new_tokens
        self.max_batch = max_batch
        self.history: list[list[int]] = []  # prompts, and prompts + outputs, seen so far

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.lo, self.hi) for _ in range(n)]

    def prompt(self) -> list[int]:
        r = self.rng.random()
        if self.history and r < 0.25:  # the same prompt again
            return list(self.rng.choice(self.history)[: self.max_prompt_len])
        if self.history and r < 0.55:  # a shared prefix of random length, then something new
            old = self.rng.choice(self.history)
            cut = self.rng.randint(1, min(len(old), self.max_prompt_len - 1))
            return old[:cut] + self._tokens(self.rng.randint(1, max(1, self.max_prompt_len - cut)))
        if self.base and r < 0.8:
            return list(self.rng.choice(self.base))
        return self._tokens(self.rng.randint(1, self.max_prompt_len))

    def params(self) -> SamplingParams:
        rng = self.rng
        max_new = 1 if rng.random() < 0.15 else rng.randint(2, self.max_new_tokens)
        common = dict(max_new_tokens=max_new, logprob_mode="raw", ignore_eos=rng.random() < 0.5)
        if rng.random() < 0.65:
            return SamplingParams(temperature=0.0, n=rng.choice([1, 1, 1, 2]), **common)
        return SamplingParams(temperature=1.0, n=rng.choice([1, 2, 4]), seed=rng.randrange(1 << 40), **common)

    def call(self) -> Call:
        rng = self.rng
        num = rng.choice([1, 1, 2, 3, 5, 8, 13, rng.randint(1, self.max_batch)])
        prompts = [self.prompt() for _ in range(num)]
        params = [self.params() for _ in range(num)]
        self.history += prompts
        call = Call(prompts, params)
        if rng.random() < 0.15:
            call.abort_after = rng.randint(0, 6)
            call.abort_index = rng.randrange(sum(p.n for p in params))
        return call

    def observe(self, prompt: list[int], output: list[int]) -> None:
        """Follow-up turns: a finished sequence can be extended later."""
        if output and self.rng.random() < 0.3:
            self.history.append(prompt + output)


def run_call(engine, call: Call, tag: str) -> list:
    """Run one call; returns its outputs (input order, samples adjacent)."""
    ids = [f"{tag}-{i}" for i in range(len(call.prompts))]
    if call.abort_after is None:
        return engine.generate(input_ids=call.prompts, sampling_params=call.params, request_ids=ids)
    # Sample ids as the engine names them: the call's outputs, in order.
    expanded = [rid if p.n == 1 else f"{rid}-{j}" for rid, p in zip(ids, call.params) for j in range(p.n)]
    merged: dict[str, _Streamed] = {}
    for k, delta in enumerate(engine.stream(input_ids=call.prompts, sampling_params=call.params, request_ids=ids)):
        m = merged.setdefault(delta.request_id, _Streamed(delta.request_id, delta.prompt_token_ids))
        m.output_token_ids += delta.output_token_ids
        m.output_logprobs += delta.output_logprobs or []
        m.finish_reason = delta.finish_reason
        if delta.routed_experts is not None:
            m.routed_experts = delta.routed_experts
        if k == call.abort_after:
            engine.abort([expanded[call.abort_index]])
    return [merged[rid] for rid in expanded]


@dataclass
class _Streamed:
    """A streamed request's deltas put together, shaped like a RolloutOutput."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    routed_experts: Any = None  # return_routed_experts: on the last delta


class Reference:
    """Teacher-forced log-softmax of whole sequences through a Hugging Face
    model in fp32 (its own attention, no paged cache, no graphs)."""

    def __init__(self, hf_model, device: str):
        self.model = hf_model.to(device, torch.float32).eval()
        self.device = device

    @torch.no_grad()
    def output_logprobs(self, pairs: list[tuple[list[int], list[int]]], chunk: int = 16) -> list[torch.Tensor]:
        """For each (prompt, output): [len(output), vocab], the distributions
        the output tokens were drawn from. Right-padded batches."""
        result: list[torch.Tensor] = []
        for i in range(0, len(pairs), chunk):
            part = pairs[i: i + chunk]
            seqs = [p + o for p, o in part]
            width = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros(len(seqs), width, dtype=torch.long)
            for j, s in enumerate(seqs):
                ids[j, : len(s)] = torch.tensor(s)
                mask[j, : len(s)] = 1
            logits = self.model(ids.to(self.device), attention_mask=mask.to(self.device)).logits
            for j, (p, o) in enumerate(part):
                result.append(torch.log_softmax(logits[j, len(p) - 1: len(p) + len(o) - 1].float(), dim=-1))
        return result


def fp8_oracle(hf, tp_size: int = 1):
    """A copy of `hf` computing what the fp8 engine computes, in fp32: each
    quantized linear layer holds its weight as fp8 holds it and quantizes
    its input per token; at `tp_size` > 1 the input of a row-split layer
    (o_proj, down_proj) per token and rank, the part each rank holds. MoE
    experts hold their weights as fp8 holds them and take their inputs
    unquantized."""
    import copy

    from rollout_engine.kernels.fp8 import dequantize_rows, quantize_rows
    from rollout_engine.quantization import as_held, is_quantized

    model = copy.deepcopy(hf).float()
    with torch.no_grad():  # MoE experts (fused [E, rows, K], or a Linear each): weight-only, inputs as they are
        for name, p in model.named_parameters():
            if ".experts." in name and is_quantized(name, "fp8"):
                p.copy_(as_held(p, torch.float32))
    hooked = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and is_quantized(f"{name}.weight", "fp8") and ".experts." not in name:
            with torch.no_grad():
                module.weight.copy_(as_held(module.weight, torch.float32))
            group = module.in_features // tp_size if name.endswith(("o_proj", "down_proj")) else None
            module.register_forward_pre_hook(lambda m, args, group=group: (dequantize_rows(
                *quantize_rows(args[0].reshape(-1, args[0].shape[-1]), group), group).reshape(args[0].shape),))
            hooked += 1
    assert hooked
    return model


def fp8_kv_oracle(hf_model):
    """A copy of `hf_model` whose attention reads K/V as an e4m3 KV cache
    holds them (`kv_cache_dtype="fp8_e4m3"`: the rotated keys and the values
    clamped and rounded to e4m3, scale 1); everything else as HF computes it."""
    import copy

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rollout_engine.kernels.e4m3 import to_kv
    from rollout_engine.kernels.fp8 import FP8

    def attend(module, query, key, value, *args, **kwargs):
        key, value = to_kv(key, FP8).to(query.dtype), to_kv(value, FP8).to(query.dtype)
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("fp8_kv_sdpa", attend)
    model = copy.deepcopy(hf_model)
    model.set_attn_implementation("fp8_kv_sdpa")
    return model


def check_outputs(reference: Reference, call: Call, outputs: list, report: Report, margin: float,
                  logprob_tol: float, tag: str, mean_tol: float | None = None) -> None:
    """`margin`: greedy tokens; `logprob_tol`: every token; `mean_tol`: the
    mean logprob difference of a request of MEAN_MIN_TOKENS tokens or more
    (default: logprob_tol)."""
    mean_tol = logprob_tol if mean_tol is None else mean_tol
    params = [p for p in call.params for _ in range(p.n)]
    report.calls += 1
    checked = []
    for out, p in zip(outputs, params):
        report.requests += 1
        toks = out.output_token_ids
        report.aborted += out.finish_reason == "abort"
        if out.finish_reason == "length" and len(toks) != p.max_new_tokens:
            report.violations.append(f"{tag}/{out.request_id}: 'length' after {len(toks)} of {p.max_new_tokens}")
        if out.finish_reason != "abort" and not toks:
            report.violations.append(f"{tag}/{out.request_id}: finished with no tokens")
        if toks:
            checked.append((out, p))
    all_lps = reference.output_logprobs([(o.prompt_token_ids, o.output_token_ids) for o, _ in checked])
    for (out, p), lps in zip(checked, all_lps):
        toks = out.output_token_ids
        report.tokens += len(toks)
        ids = torch.tensor(toks, device=lps.device)
        ref = lps.gather(-1, ids[:, None]).squeeze(1)
        diff = (torch.tensor(out.output_logprobs, device=lps.device) - ref).abs()
        report.max_logprob_diff = max(report.max_logprob_diff, float(diff.max()))
        if len(toks) >= MEAN_MIN_TOKENS:  # one outlier token does not make a short request's mean
            report.max_mean_diff = max(report.max_mean_diff, float(diff.mean()))
        if len(toks) >= MEAN_MIN_TOKENS and float(diff.mean()) > mean_tol:
            report.violations.append(f"{tag}/{out.request_id}: mean logprob difference {float(diff.mean()):.3f}")
        if float(diff.max()) > logprob_tol:
            t = int(diff.argmax())
            report.violations.append(f"{tag}/{out.request_id}: token {t} logprob {out.output_logprobs[t]:.3f} vs "
                                     f"reference {float(ref[t]):.3f}")
        if p.greedy:
            gap = lps.max(-1).values - ref
            report.max_greedy_gap = max(report.max_greedy_gap, float(gap.max()))
            if float(gap.max()) > margin:
                t = int(gap.argmax())
                report.violations.append(f"{tag}/{out.request_id}: greedy token {t} is {float(gap[t]):.2f} nats "
                                         f"below the reference's best")


def stress(engine, reference: Reference, gen: WorkloadGenerator, num_calls: int, margin: float,
           logprob_tol: float, mean_tol: float | None = None) -> Report:
    """Run `num_calls` random calls on `engine`, checking every output and the
    KV bookkeeping after every call."""
    report = Report()
    for c in range(num_calls):
        call = gen.call()
        outputs = run_call(engine, call, f"c{c}")
        check_outputs(reference, call, outputs, report, margin, logprob_tol, f"call {c}", mean_tol)
        for out in outputs:
            gen.observe(out.prompt_token_ids, out.output_token_ids)
        engine.check_integrity()
    return report


def tight_pool_stress(engine, hf, seed: int, num_calls: int = 40) -> Report:
    """The CPU stress of an engine with a tight pool (max_total_tokens=400,
    prefill chunks of 48): random calls of prompts up to 60 tokens over a
    512-token range, each output within 1e-3 of Hugging Face fp32 (`hf`)."""
    gen = WorkloadGenerator(seed=seed, token_range=(0, 512), max_prompt_len=60, max_new_tokens=30, max_batch=16)
    report = stress(engine, Reference(hf, "cpu"), gen, num_calls=num_calls, margin=1e-3, logprob_tol=1e-3)
    print(report.summary())
    assert not report.violations, report.violations[:5]
    return report


PROMPT_LOGPROB_PROMPTS = [[(7 * i + j) % 500 for j in range(13 + 5 * i)] for i in range(6)]


def prompt_logprob_outputs(engine) -> list:
    """Greedy outputs with raw logprobs and prompt logprobs (every row's
    logits) of six prompts, 13 to 38 tokens, on `engine`."""
    params = SamplingParams(max_new_tokens=9, temperature=0.0, logprobs=True, prompt_logprobs=True)
    return engine.generate(input_ids=PROMPT_LOGPROB_PROMPTS, sampling_params=params)


def assert_outputs_close(expected: list, got: list, tol: float) -> None:
    """The same tokens; logprobs and prompt logprobs within `tol`."""
    for a, b in zip(expected, got, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=tol)
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        assert [x for x in a.prompt_logprobs if x is not None] == pytest.approx(
            [x for x in b.prompt_logprobs if x is not None], abs=tol)
