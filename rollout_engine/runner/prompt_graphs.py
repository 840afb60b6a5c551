"""CUDA graphs for the steps that run outside the decode graphs (prompt
chunks and mixed steps), cut at attention.

Such a step's token count changes from step to step and its attention plan
with it, so no single graph can hold it. What lies between two attentions
does not depend on the plan: the o product, the norm and the MLP of one
layer, then the norm, the qkv product and the rotation and K/V store of the
next. Each of those stretches is a graph, captured per bucket of token
counts (`prompt_buckets`), L + 1 graphs a bucket for L layers; the step's
attention runs eagerly between them. On the GPU measured, an eager step of a
small model waited on the host's launches (about 25 ms of host time for
about 18 ms of device work, BENCHMARKS.md); a replay is one launch.

The graphs read and write fixed buffers, sized for the largest bucket:
input ids, positions and KV slots; q (the rotation's output), o (the
attention's output) and the residual stream; the final hidden states. A
step of n tokens runs in the smallest bucket t >= n: its rows n..t are
padding, with input id 0 at position 0 and their K/V stored in the reserved
page 0, as the decode graphs' padding rows. Attention sees the n real rows
only; the padding rows of o are zeros. Rows are independent everywhere
else, so the real rows come out as they would eagerly.

Dense models at tp_size 1 without fp8 weights, outside deterministic mode
(`supports`); everything else stays eager. The buffers come from the graph
memory pool (allocated inside a capture), so a release of `cuda_graph` treats
them as it treats the graphs: paused and resumed with them (preload hook),
kept, or destroyed and allocated again at the next capture.
"""
from __future__ import annotations

import bisect
from typing import Callable

import numpy as np
import torch

from rollout_engine.forward_batch import PAD_TOKENS, ForwardBatch

ENABLED = True  # off: those steps run eagerly (for A/B runs)

# Buckets: every PAD_TOKENS (64) to 512 tokens, every 128 to 2,048, every 256 beyond (3% of a step
# of 8,192 tokens at most): 45 buckets up to 8,448.
STEPS = ((512, PAD_TOKENS), (2048, 128), (1 << 62, 256))


# The largest bucket at most: a step of more tokens runs eagerly. Past it each bucket would add L + 1
# graphs to the engine's start for the few steps that large (a max_prefill_tokens of 16,384 gets 77
# buckets).
MAX_TOKENS = 16384 + 256


def prompt_buckets(max_tokens: int) -> list[int]:
    """Token counts with graphs, up to the first one >= max_tokens (at most
    MAX_TOKENS)."""
    max_tokens = min(max_tokens, MAX_TOKENS)
    out, t = [], PAD_TOKENS
    while True:
        out.append(t)
        if t >= max_tokens:
            return out
        t += next(step for limit, step in STEPS if t < limit)


def supports(model: torch.nn.Module, batch_invariant: bool) -> bool:
    """Whether the model's eager steps can run through prompt graphs: a
    dense model at tp_size 1 without fp8 weights, not in deterministic mode."""
    m = model.model
    if batch_invariant or model.config.moe is not None or m.comm.tp_size != 1:
        return False
    return all(layer.self_attn.qkv_proj.weight_scale is None for layer in m.layers)


class PromptGraphs:
    """A model's graphs cut at attention, for steps of up to `max_tokens`
    tokens: `capture`, then `run` per step, `destroy` to drop them."""

    def __init__(self, model: torch.nn.Module, max_tokens: int, device: torch.device):
        self.model, self.device = model, device
        self.buckets = prompt_buckets(max_tokens)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._buffer_graph: torch.cuda.CUDAGraph | None = None  # kept: the pool lives while a graph of it does
        # Per bucket, what runs between attentions: the graphs' replays (on the CPU, for tests, the
        # pieces themselves).
        self.steps: dict[int, list[Callable[[], None]]] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self.mempool = None

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def bucket(self, tokens: int) -> int | None:
        """The bucket a step of `tokens` tokens runs in; None above the largest."""
        i = bisect.bisect_left(self.buckets, tokens)
        return self.buckets[i] if i < len(self.buckets) else None

    def _allocate(self, capture_context) -> None:
        """The fixed buffers, zeroed (input ids, positions and slots 0: the
        reserved page). On the GPU they are allocated inside a capture, so
        that they come from the graph pool."""
        cfg, m = self.model.config, self.model.model
        qkv = m.layers[0].self_attn.qkv_proj
        t, dtype, dev = self.max_tokens, m.norm.weight.dtype, self.device
        width = qkv.num_heads * qkv.head_dim

        def allocate() -> dict[str, torch.Tensor]:
            return {"ids": torch.zeros(t, dtype=torch.int64, device=dev),
                    "positions": torch.zeros(t, dtype=torch.int64, device=dev),
                    "loc": torch.zeros(t, dtype=torch.int64, device=dev),
                    "q": torch.zeros(t, width, dtype=dtype, device=dev),
                    "o": torch.zeros(t, width, dtype=dtype, device=dev),
                    "residual": torch.zeros(t, cfg.hidden_size, dtype=dtype, device=dev),
                    "hidden": torch.zeros(t, cfg.hidden_size, dtype=dtype, device=dev),
                    "rows": torch.zeros(1, dtype=torch.int32, device=dev)}  # a placeholder the pieces never read

        if capture_context is None:
            self.buffers = allocate()
            return
        graph = torch.cuda.CUDAGraph()
        with capture_context(graph, self.mempool):
            self.buffers = allocate()
        graph.replay()  # the zeros (a capture only records them)
        self._buffer_graph = graph

    def _pieces(self, t: int, fb: ForwardBatch) -> list[Callable[[], None]]:
        """The L + 1 stretches between attentions of a bucket of t tokens,
        each reading and writing the fixed buffers."""
        m, b = self.model.model, self.buffers
        ids, pos, q, o, res = b["ids"][:t], b["positions"][:t], b["q"][:t], b["o"][:t], b["residual"][:t]
        layers = m.layers

        def keep(q_new: torch.Tensor, r: torch.Tensor) -> None:
            q.copy_(q_new.reshape(t, -1))
            res.copy_(r)

        def first() -> None:
            keep(*layers[0].pre_attention(pos, m.embed_tokens(ids), None, fb))

        def between(i: int) -> Callable[[], None]:
            def run() -> None:
                x, r = layers[i - 1].post_attention(o, res, fb)
                keep(*layers[i].pre_attention(pos, x, r, fb))
            return run

        def last() -> None:
            x, r = layers[-1].post_attention(o, res, fb)
            b["hidden"][:t].copy_(m.norm(x, r)[0])

        return [first, *(between(i) for i in range(1, len(layers))), last]

    def _static_batch(self, t: int, kv_pool, backend, table) -> ForwardBatch:
        """What the pieces read of a step: its KV pool and the slots buffer."""
        one = np.ones(1, dtype=np.int64)
        b = self.buffers
        return ForwardBatch(input_ids=b["ids"][:t], positions=b["positions"][:t], out_cache_loc=b["loc"][:t],
                            extend_lens=one, seq_lens=one, rows=one, rows_device=b["rows"], table=table,
                            kv_pool=kv_pool, attn_backend=backend, is_decode=False)

    @torch.inference_mode()
    def capture(self, capture_context, kv_pool, backend, table) -> None:
        """Every bucket's pieces, largest bucket first (smaller ones reuse its
        memory), each run once first (lazy initialisation, kernel choice).
        On the CPU (tests) nothing is captured: the pieces run as they are."""
        on_gpu = self.device.type == "cuda"
        self.mempool = torch.cuda.graph_pool_handle() if on_gpu else None
        self._allocate(capture_context if on_gpu else None)
        for t in reversed(self.buckets):
            pieces = self._pieces(t, self._static_batch(t, kv_pool, backend, table))
            if not on_gpu:
                self.steps[t] = pieces
                continue
            for piece in pieces:
                piece()
            torch.cuda.synchronize(self.device)
            graphs = []
            for piece in pieces:
                graph = torch.cuda.CUDAGraph()
                with capture_context(graph, self.mempool):
                    piece()
                graphs.append(graph)
            self.graphs[t], self.steps[t] = graphs, [g.replay for g in graphs]
        if on_gpu:
            torch.cuda.synchronize(self.device)

    @property
    def captured(self) -> bool:
        return bool(self.steps)

    def run(self, fb: ForwardBatch, t: int) -> torch.Tensor:
        """The hidden states [t, hidden] of a step built with `t - n` padding
        rows (`fb.pad`) for its n tokens (`bucket(n)` is t)."""
        b, n = self.buffers, t - fb.pad
        b["ids"][:t].copy_(fb.input_ids)
        b["positions"][:t].copy_(fb.positions)
        b["loc"][:t].copy_(fb.out_cache_loc)
        o = b["o"][:t]
        o[n:].zero_()  # the padding rows, which attention leaves alone
        layers = self.model.model.layers
        qkv = layers[0].self_attn.qkv_proj
        q = b["q"][:t].view(t, qkv.num_heads, qkv.head_dim)
        for i, step in enumerate(self.steps[t]):
            step()
            if i < len(layers):
                layers[i].self_attn.attn(q, fb, out=o)
        return b["hidden"][:t]

    def destroy(self) -> None:
        for graphs in self.graphs.values():
            for graph in graphs:
                graph.reset()
        if self._buffer_graph is not None:
            self._buffer_graph.reset()
            self._buffer_graph = None
        self.graphs.clear()
        self.steps.clear()
        self.buffers = {}
        self.mempool = None
