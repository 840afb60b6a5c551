"""Device measurements and the rooflines of docs/benchmarks.md, computed from them."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rollout_engine.models.config import ModelConfig


@dataclass(frozen=True)
class DeviceLimits:
    bandwidth: float  # bytes/s, copy (read + write)
    flops: float  # bf16 GEMM FLOP/s

    def times(self, k: int) -> "DeviceLimits":
        """The limits of k such devices working as one (tensor parallelism:
        each reads and computes 1/k of the model)."""
        return DeviceLimits(bandwidth=k * self.bandwidth, flops=k * self.flops)


def _timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def measure_device() -> DeviceLimits:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / _timed(lambda: dst.copy_(src), 20)
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    flops = 2 * 8192 ** 3 / _timed(lambda: a @ b, 20)
    return DeviceLimits(bandwidth=bw, flops=flops)


@dataclass(frozen=True)
class ModelCosts:
    weight_bytes_per_step: float  # dense: W = 2 * (non-embedding params + vocab * hidden); MoE: without experts
    kv_bytes_per_token: float
    flops_per_token: float  # 2 * non-embedding params (MoE: the active ones)
    # MoE: the bytes of one expert in every sparse layer; a step reads the
    # experts that at least one token of its batch selects
    expert_bytes: float = 0.0
    num_experts: int = 0
    top_k: int = 0

    @staticmethod
    def of(mc: ModelConfig, dtype_bytes: int = 2, fp8: bool = False, kv_fp8: bool = False) -> "ModelCosts":
        """`fp8` (quantization="fp8"): the quantized linear layers (attention
        projections, dense MLPs, the shared expert) read 1 byte a weight and
        run at twice the bf16 matrix peak (docs/benchmarks.md), counted here as half
        their FLOPs against the bf16 peak the device limits hold; MoE
        experts read 1 byte a weight too, their products at the bf16 peak
        (weight-only: their inputs stay in the engine dtype). `kv_fp8`
        (kv_cache_dtype="fp8_e4m3"): 1 byte per cached K/V element."""
        h, i = mc.hidden_size, mc.intermediate_size
        projections = h * (mc.q_size + 2 * mc.kv_size) + mc.q_size * h
        moe, sparse = mc.moe, 0 if mc.moe is None else len(mc.moe.sparse_layers)
        linear = (mc.num_layers - sparse) * (projections + 3 * h * i) + sparse * projections
        other = mc.num_layers * 2 * h + h  # norms
        expert = active = 0
        if moe is not None:
            linear += sparse * 3 * h * moe.shared_expert_intermediate_size
            other += sparse * (moe.num_experts * h + h * bool(moe.shared_expert_intermediate_size))
            expert = sparse * 3 * h * moe.intermediate_size
            active = moe.top_k * expert
        linear_bytes = 1 if fp8 else dtype_bytes
        return ModelCosts(
            weight_bytes_per_step=linear_bytes * linear + dtype_bytes * (other + mc.vocab_size * h),
            kv_bytes_per_token=2 * mc.num_layers * mc.kv_size * (1 if kv_fp8 else dtype_bytes),
            flops_per_token=2 * ((linear / 2 if fp8 else linear) + other + active),
            expert_bytes=linear_bytes * expert,
            num_experts=0 if moe is None else moe.num_experts,
            top_k=0 if moe is None else moe.top_k,
        )

    def expected_experts(self, batch: int) -> float:
        """Distinct experts a layer's batch of `batch` tokens selects, for
        uniform routing: E * (1 - (1 - k/E)^B)."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** batch)

    def step_weight_bytes(self, batch: int) -> float:
        """Weight bytes a decode step of `batch` tokens reads."""
        return self.weight_bytes_per_step + self.expected_experts(batch) * self.expert_bytes


def decode_step_floor(costs: ModelCosts, limits: DeviceLimits, batch: int, mean_context: float) -> float:
    """Seconds: every weight the step needs and every cached K/V read once."""
    return (costs.step_weight_bytes(batch) + batch * mean_context * costs.kv_bytes_per_token) / limits.bandwidth


def prefill_ceiling(costs: ModelCosts, limits: DeviceLimits) -> float:
    """Tokens/s of compute-bound prefill."""
    return limits.flops / costs.flops_per_token


def workload_roofline(costs: ModelCosts, limits: DeviceLimits, input_lens: list[int], output_lens: list[int],
                      max_batch: int, prefill_tokens: int | None = None) -> float:
    """Output tokens/s of an ideal run: prompts at the compute ceiling, then
    decode steps at the bandwidth floor with up to `max_batch` running.
    `prefill_tokens`: the prompt tokens an ideal prefix cache computes
    (default: every prompt's)."""
    computed = sum(input_lens) if prefill_tokens is None else prefill_tokens
    prefill_s = computed / prefill_ceiling(costs, limits)
    pending = sorted(zip(input_lens, output_lens), key=lambda x: -x[1])
    decode_s, tokens = 0.0, sum(output_lens)
    while pending:
        batch, pending = pending[:max_batch], pending[max_batch:]
        steps = max(o for _, o in batch)
        for t in range(steps):
            running = [i + t for i, o in batch if o > t]
            decode_s += (costs.step_weight_bytes(len(running)) + sum(running) * costs.kv_bytes_per_token
                         ) / limits.bandwidth
    return tokens / (prefill_s + decode_s)
