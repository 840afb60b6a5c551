"""Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k
RMSNorm) and its MoE variants (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE with
q/k RMSNorm over the whole projections: a sparse MLP in the layers the
config names) built from TP-aware layers. No distributed code here: layers take a
TPComm and do their own collectives."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from rollout_engine.attention.one_seq import one_seq, rotates_in_one_seq
from rollout_engine.distributed.comm import TPComm
from rollout_engine.kernels._triton import use_kernel
from rollout_engine.kernels.activation import silu_and_mul
from rollout_engine.kernels.gemv import NORM_MAX_K, RopeStore
from rollout_engine.kernels.one_seq_attention import NewEntry, takes_new_entry
from rollout_engine.kernels.rope import QKNorm
from rollout_engine.layers.attention import PagedAttention
from rollout_engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from rollout_engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from rollout_engine.layers.moe import SparseMoeBlock
from rollout_engine.layers.norm import RMSNorm, ShardedRMSNorm
from rollout_engine.layers.rotary import RotaryEmbedding
from rollout_engine.models.config import ModelConfig

if TYPE_CHECKING:
    from rollout_engine.forward_batch import ForwardBatch

# HF checkpoint sub-name -> (our fused parameter sub-name, shard id).
STACKED_PARAMS: tuple[tuple[str, str, object], ...] = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)


class DecoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, comm: TPComm):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_kv_heads, cfg.qkv_bias, comm)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, False, comm)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        p = self.qkv_proj
        self.norms_whole = cfg.qk_norm_whole
        if cfg.qk_norm_whole:  # over the whole q and k projections (this rank's slices of them)
            rank = comm.tp_rank
            self.q_norm = ShardedRMSNorm(p.q_size, rank, cfg.rms_norm_eps, comm)
            self.k_norm = ShardedRMSNorm(p.kv_size, rank // p.kv_replicas, cfg.rms_norm_eps, comm,
                                         p.kv_replicas)
        self.attn = PagedAttention(layer_id, p.num_heads, p.num_kv_heads, cfg.head_dim)
        # At one row the qkv product also rotates q and k and stores K/V (`one_row_q`); not after q/k norms,
        # which need whole heads.
        self.rope_in_product = not cfg.qk_norm and not cfg.qk_norm_whole and p.rows_pair(cfg.head_dim)

    def attend(self, q: torch.Tensor, fb: "ForwardBatch", reduce: bool = True) -> torch.Tensor:
        """Attention of rotated q over the cache (this step's K/V stored), then
        o_proj (`reduce=False`: its partial sum, `RowParallelLinear`)."""
        p = self.qkv_proj
        return self.o_proj(self.attn(q.view(-1, p.num_heads, p.head_dim), fb), reduce)

    def _rotate_and_store(self, positions: torch.Tensor, qkv: torch.Tensor, fb: "ForwardBatch") -> torch.Tensor:
        p = self.qkv_proj
        q, k, v = qkv.split([p.q_size, p.kv_size, p.kv_size], dim=-1)
        if self.norms_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(-1, p.num_heads, p.head_dim)
        k = k.view(-1, p.num_kv_heads, p.head_dim)
        v = v.view(-1, p.num_kv_heads, p.head_dim)
        qk_norm = self._head_norms()
        if qk_norm is not None and not use_kernel(q):  # on the GPU normalised inside the rotary kernel
            q, k, qk_norm = self.q_norm(q), self.k_norm(k), None
        return self.rotary.rotate_and_store(positions, q, k, v, fb.kv_pool.k[self.attn.layer_id],
                                            fb.kv_pool.v[self.attn.layer_id], fb.out_cache_loc, qk_norm)

    def _head_norms(self) -> QKNorm | None:
        """Per-head q/k RMSNorm as the rotary kernels take it, or None (no
        q/k norms, or OLMoE's over the whole projections)."""
        if self.q_norm is None or self.norms_whole:
            return None
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps

    def one_row_q(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm | None,
                  fb: "ForwardBatch") -> tuple[torch.Tensor, torch.Tensor]:
        """One row (`DecoderLayer.norms_in_products`): RMSNorm(x + residual)
        inside the qkv product, and without q/k norms the rotary embedding
        and the K/V store too (one launch). Returns (rotated q, residual).
        `norm` None: x is normalised already (and `residual` None)."""
        p, i = self.qkv_proj, self.attn.layer_id
        if self.rope_in_product:
            rope = self.rope_store(positions, fb.kv_pool.k[i], fb.kv_pool.v[i], fb.out_cache_loc)
            return p.norm_product(x, residual, norm, p.bias, rope=rope)
        qkv, residual = p.norm_product(x, residual, norm, p.bias)
        return self._rotate_and_store(positions, qkv, fb), residual

    def one_row_attention(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                          norm: RMSNorm | None, fb: "ForwardBatch",
                          reduce: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One row: `one_row_q`, the attention and the o product (`reduce`:
        as `attend`). Returns (o's output, residual). With per-head q/k
        norms (or none) and the rotation not in the product, a step that
        takes the one-sequence kernel has that kernel rotate q and store the
        new K/V too (`attention.one_seq.rotates_in_one_seq`)."""
        p = self.qkv_proj
        if self.rope_in_product or self.norms_whole or not rotates_in_one_seq(fb):
            q, residual = self.one_row_q(positions, x, residual, norm, fb)
            return self.attend(q, fb, reduce), residual
        qkv, residual = p.norm_product(x, residual, norm, p.bias)
        q, k, v = (t.view(1, -1, p.head_dim) for t in qkv.split([p.q_size, p.kv_size, p.kv_size], dim=-1))
        new = NewEntry(k, v, self.rotary.cos, self.rotary.sin, fb.out_cache_loc, self._head_norms())
        layer = self.attn.layer_id
        if not takes_new_entry(q, new, fb.kv_pool.k[layer], fb.kv_pool.v[layer]):
            return self.attend(self._rotate_and_store(positions, qkv, fb), fb, reduce), residual
        return self.o_proj(one_seq(q, self.attn, fb, new).view(1, -1), reduce), residual

    def rope_store(self, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   loc: torch.Tensor) -> RopeStore:
        p = self.qkv_proj
        return RopeStore(positions, self.rotary.cos, self.rotary.sin, k_cache, v_cache, loc, p.num_heads,
                         p.num_kv_heads)


class DecoderMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: TPComm):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, False, comm)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, comm)
        # at one row SiLU * mul inside the gate_up product (`one_row_act`)
        self.gated_in_product = self.gate_up_proj.rows_pair(self.gate_up_proj.weight.shape[0])

    def forward(self, x: torch.Tensor, fb: "ForwardBatch | None" = None, reduce: bool = True) -> torch.Tensor:
        """`fb` unused (the sparse MLP's record of routing needs it);
        `reduce=False`: the down product's partial sum."""
        return self.down_proj(self.gate_up_proj.gated(x), reduce)

    def one_row_act(self, x: torch.Tensor, residual: torch.Tensor | None,
                    norm: RMSNorm | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One row (`DecoderLayer.norms_in_products`): RMSNorm(x + residual)
        inside the gate_up product, and SiLU(gate) * up too when its rows pair
        up. Returns (the down product's input, residual)."""
        p = self.gate_up_proj
        if self.gated_in_product:
            return p.norm_product(x, residual, norm, gated=True)
        gate_up, residual = p.norm_product(x, residual, norm)
        return silu_and_mul(gate_up), residual


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, comm: TPComm):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, layer_id, rotary, comm)
        sparse = cfg.moe is not None and cfg.moe.is_sparse(layer_id)
        self.mlp = (SparseMoeBlock(cfg.hidden_size, cfg.moe, comm, cfg.moe.sparse_layers.index(layer_id))
                    if sparse else DecoderMLP(cfg, comm))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.comm = comm

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                fb: "ForwardBatch", fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual-stream form: the add before each norm is fused into it.
        Returns (this layer's MLP output, the residual stream before it).
        `fused` (`DecoderModel.fuses_norms`): the o_proj and down products
        leave their sums unreduced and each norm after them takes the
        all-reduce (`TPComm.all_reduce_norm`); x is then a partial sum too,
        but for the first layer's (residual None)."""
        if self.norms_in_products(x, residual):
            return self._forward_one_row(positions, x, residual, fb, fused)
        q, residual = self.pre_attention(positions, x, residual, fb, fused)
        return self.post_attention(self.self_attn.attn(q, fb), residual, fb, fused)

    # A layer in two parts around its attention (`runner/prompt_graphs.py` captures each part in a graph).

    def pre_attention(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                      fb: "ForwardBatch", fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm (with its residual add), the qkv product, the q/k norms,
        the rotation and the K/V store. Returns (rotated q [T, heads, d], the
        residual stream)."""
        attn = self.self_attn
        h, residual = self._norm(self.input_layernorm, x, residual, fused)
        q = attn._rotate_and_store(positions, attn.qkv_proj(h), fb)
        return q.view(-1, attn.qkv_proj.num_heads, attn.qkv_proj.head_dim), residual

    def post_attention(self, o: torch.Tensor, residual: torch.Tensor, fb: "ForwardBatch",
                       fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The o product of the attention's output [T, heads * d], the norm
        (with its residual add) and the MLP. Returns (the MLP's output, the
        residual stream before it)."""
        h = self.self_attn.o_proj(o, not fused)
        h, residual = self._norm(self.post_attention_layernorm, h, residual, fused)
        return self.mlp(h, fb, reduce=not fused), residual

    def _norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
              fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the embedding's rows, reduced
            return norm(x), x
        return self.comm.all_reduce_norm(x, residual, norm) if fused else norm(x, residual)

    def norms_in_products(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """One row on the GPU: each RMSNorm (with its residual add) is computed
        inside the product after it (`_Linear.norm_product`: `kernels.gemv`,
        fp8 weights `kernels.fp8_row`, which quantizes its input inside too),
        without q/k norms the rotary embedding and K/V store inside the qkv
        product, and SiLU * mul inside the gate_up product: four launches
        fewer per layer (fp8: eight). Not in batch-invariant mode (its own
        kernels)."""
        qkv, norm = self.self_attn.qkv_proj, self.input_layernorm
        return (qkv.fuses_one_row(x) and x.shape[1] <= NORM_MAX_K and not qkv.batch_invariant
                and not norm.batch_invariant and (residual is None or residual.is_contiguous()))

    @torch.inference_mode()
    def compile_one_row(self) -> None:
        """Run this layer's fused one-row products once on dummy inputs (each
        variant `_forward_one_row` takes), so none compiles mid-run."""
        attn, mlp = self.self_attn, self.mlp
        p, norm = attn.qkv_proj, self.input_layernorm
        w = p.weight
        x = torch.zeros(1, w.shape[1], dtype=norm.weight.dtype, device=w.device)  # fp8 weights: bf16 rows
        if not self.norms_in_products(x, None):
            return
        rope = None
        if attn.rope_in_product:
            cache = torch.zeros(1, p.num_kv_heads, p.head_dim, dtype=x.dtype, device=w.device)
            slot = torch.zeros(1, dtype=torch.int64, device=w.device)
            rope = attn.rope_store(slot, cache, cache.clone(), slot)
        for residual in (None, x):  # the first layer's qkv has no residual to add
            p.norm_product(x, residual, norm, p.bias, rope=rope)
        if isinstance(mlp, DecoderMLP):
            mlp.one_row_act(x, x, self.post_attention_layernorm)
            if self.comm.fused is not None:  # after a norm that took the all-reduce (`fused`)
                p.norm_product(x, None, None, p.bias, rope=rope)
                mlp.one_row_act(x, None, None)
        elif mlp.fuses_one_row(x, self.post_attention_layernorm):  # no collective here
            mlp.one_row_local(x, x, self.post_attention_layernorm)

    def _forward_one_row(self, positions, x, residual, fb, fused):
        attn, mlp = self.self_attn, self.mlp
        if fused and residual is not None:  # the norm took the all-reduce: the product has none to do
            h, residual = self.comm.all_reduce_norm(x, residual, self.input_layernorm)
            h = attn.one_row_attention(positions, h, None, None, fb, reduce=False)[0]
        else:
            h, residual = attn.one_row_attention(positions, x, residual, self.input_layernorm, fb, reduce=not fused)
        h = h.contiguous()
        if not isinstance(mlp, DecoderMLP):  # the sparse MLP: its router and experts take the normed rows
            if mlp.fuses_one_row(h, self.post_attention_layernorm):  # the norm inside its launches
                return mlp.one_row(h, residual, self.post_attention_layernorm, fb)
            h, residual = self.post_attention_layernorm(h, residual)
            return mlp(h, fb), residual
        if fused:
            h, residual = self.comm.all_reduce_norm(h, residual, self.post_attention_layernorm)
            return mlp.down_proj(mlp.one_row_act(h, None, None)[0], reduce=False), residual
        act, residual = mlp.one_row_act(h, residual, self.post_attention_layernorm)
        return mlp.down_proj(act), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: TPComm):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, comm)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, comm) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.comm = comm
        # Dense layers only: the sparse MLP reduces its own sums (and at one row fuses the norm before it).
        self.fused_norms = comm.fused is not None and cfg.moe is None

    def fuses_norms(self, rows: int) -> bool:
        """Whether a forward of `rows` tokens lets each norm take the
        all-reduce before it (`TPComm.fuses_norms`); never in batch-invariant
        mode, whose norm rounds as the unfused one."""
        return self.fused_norms and not self.norm.batch_invariant and self.comm.fuses_norms(rows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: "ForwardBatch") -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        fused = self.fuses_norms(input_ids.shape[0])
        for layer in self.layers:
            x, residual = layer(positions, x, residual, fb, fused)
        if fused:
            return self.comm.all_reduce_norm(x, residual, self.norm)[0]
        return self.norm(x, residual)[0]


class DecoderForCausalLM(nn.Module):
    stacked_params = STACKED_PARAMS

    def __init__(self, cfg: ModelConfig, comm: TPComm):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, comm)
        self.lm_head = ParallelLMHead(self.model.embed_tokens, cfg.tie_word_embeddings, comm)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: "ForwardBatch") -> torch.Tensor:
        """Hidden states [T, hidden] of every new token; logits are computed
        by `compute_logits` only for the rows that need them."""
        return self.model(input_ids, positions, fb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # fp32
