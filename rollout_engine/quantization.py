"""Which weights an fp8 engine (quantization="fp8") holds in e4m3, and the
values it holds for them.

Every tensor-parallel linear layer of the decoder is quantized: the
attention projections and the dense MLPs (Qwen2-MoE's shared expert
included), with one scale per output row taken over the whole row, so a
tensor-parallel rank's slice holds what the same rows hold at tp_size 1;
and the MoE experts, one scale per row of each expert's gate, up and down
weights (layers/moe.py), under either naming (per-expert tensors, or
transformers 5's fused `experts.gate_up_proj` [E, 2I, H] and
`experts.down_proj` [E, H, I], whose rows are those of the last dimension).
The embeddings, norms, routers and the LM head stay in the engine dtype. A
Hugging Face name is quantized when it matches `QUANTIZED`: the trainer's
side of a checksum (fidelity.weights_checksum) uses the same rule and the
same arithmetic (kernels/fp8.py: quantize_channels), so equal digests still
mean the engine holds exactly the trainer's weights, as quantized."""
from __future__ import annotations

import contextlib
import re
from typing import Iterator

import torch

from rollout_engine.kernels.fp8 import dequantize_channels, quantize_channels
from rollout_engine.layers.linear import FP8_LINEARS

QUANTIZED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$"
                       r"|\.experts\.\d+\.w[123]\.weight$"  # Mixtral's per-expert names
                       r"|\.experts\.(gate_up_proj|down_proj)$")  # the fused experts


def is_quantized(hf_name: str, quantization: str | None) -> bool:
    return quantization == "fp8" and bool(QUANTIZED.search(hf_name))


@contextlib.contextmanager
def fp8_linears() -> Iterator[None]:
    """Models built inside hold every parallel linear layer and the MoE
    experts in fp8 storage (layers/linear.py: FP8_LINEARS)."""
    token = FP8_LINEARS.set(True)
    try:
        yield
    finally:
        FP8_LINEARS.reset(token)


def as_held(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What an fp8 engine holds for a weight given as `tensor`, in `dtype`
    (its values, read back through the scales): one scale a row of the
    last dimension."""
    q, scale_inv = quantize_channels(tensor.reshape(-1, tensor.shape[-1]))
    return dequantize_channels(q, scale_inv).to(dtype).reshape(tensor.shape)
