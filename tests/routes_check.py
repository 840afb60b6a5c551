"""What the routing capture tests share: the prompts, Hugging Face's routers
as the reference, and an engine that records routes (CPU, small prefill
chunks)."""
from __future__ import annotations

import numpy as np
import torch

from rollout_engine import RolloutEngine

SYSTEM = list(range(30, 70))
PROMPTS = [SYSTEM + [1, 2, 3], SYSTEM + [4, 5, 6, 7], [7] * 20, list(range(100, 150))]


def hf_routes(hf, ids: list[int], top_k: int) -> np.ndarray:
    """[len(ids), moe_layers, top_k] experts of HF's routers (fp32 top-k of
    the softmax), from hooks on each sparse layer's router."""
    logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: logits.append(o[0] if isinstance(o, tuple) else o))
             for layer in hf.model.layers if hasattr(layer.mlp, "experts")]
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([torch.topk(torch.softmax(x.float(), -1), top_k, -1).indices for x in logits], 1).numpy()


def assert_routes_match(hf, outs, top_k: int) -> None:
    for o in outs:
        ids = o.prompt_token_ids + o.output_token_ids
        got = o.routed_experts
        assert got is not None and got.shape[0] == len(ids) - 1, (o.request_id, None if got is None else got.shape)
        want = hf_routes(hf, ids[:-1], top_k)
        assert got.shape == want.shape
        assert (np.sort(got.astype(np.int64), -1) == np.sort(want, -1)).all(), o.request_id


def engine_with_routes(folder: str, **kw) -> RolloutEngine:
    return RolloutEngine(folder, device="cpu", enable_return_routed_experts=True,
                         **{"max_total_tokens": 4096, "max_prefill_tokens": 16, **kw})
