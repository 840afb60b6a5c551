"""The torch backend's extend (prefill) path against a naive reference: an
explicit masked softmax per sequence, in float64. Covers no cached prefix
(the is_causal path), a cached prefix (explicit mask, also split into
chunks of queries), mixed batches, GQA groups and one-token extends; then a
tiny engine's prompt logprobs over a long chunked prompt against HF."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import rollout_engine.attention.torch_backend as torch_backend
from rollout_engine.attention.torch_backend import TorchAttentionBackend
from rollout_engine.cache.kv_pool import KVPool
from rollout_engine.cache.req_table import ReqToTokenTable
from rollout_engine.layers.attention import PagedAttention
from rollout_engine.forward_batch import ForwardBatch, TableMirror

D = 16
ATOL = 2e-6  # fp32 kernel vs the float64 reference


def naive_extend(q, k_cache, v_cache, slots, q_lens, kv_lens, num_kv_heads, scale):
    """Per sequence: scores over its whole context, query j at position
    kv_len - q_len + j seeing keys <= that position; query head h reads KV
    head h // group."""
    group = q.shape[1] // num_kv_heads
    outs, at = [], 0
    for sl, q_len, kv_len in zip(slots, q_lens, kv_lens):
        qi = q[at: at + q_len].double().transpose(0, 1)  # [heads, q_len, d]
        ki = k_cache[sl].double().transpose(0, 1).repeat_interleave(group, 0)  # [heads, kv_len, d]
        vi = v_cache[sl].double().transpose(0, 1).repeat_interleave(group, 0)
        scores = qi @ ki.transpose(1, 2) * scale
        q_pos = torch.arange(kv_len - q_len, kv_len)
        scores.masked_fill_(torch.arange(kv_len)[None, :] > q_pos[:, None], float("-inf"))
        outs.append((torch.softmax(scores, -1) @ vi).transpose(0, 1))
        at += q_len
    return torch.cat(outs)


def run_extend(q_lens, kv_lens, heads, kv_heads, seed=0, dtype=torch.float32):
    """An extend step over sequences with the given new-token and total
    lengths, their K/V at scattered slots of the pool. Returns (backend
    output, reference)."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    total_kv, total_q = sum(kv_lens), sum(q_lens)
    pool = KVPool(1, total_kv + 8, kv_heads, D, dtype, torch.device("cpu"))
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    table = ReqToTokenTable(len(kv_lens) + 2, max(kv_lens) + 1)
    free = rng.permutation(np.arange(1, pool.num_slots))  # scattered slots, none reused
    rows, slots, at = [], [], 0
    for kv_len in kv_lens:
        row = table.alloc_row()
        table.write(row, 0, free[at: at + kv_len])
        rows.append(row)
        slots.append(torch.from_numpy(free[at: at + kv_len]))
        at += kv_len
    backend = TorchAttentionBackend()
    zeros = torch.zeros(total_q, dtype=torch.int64)
    fb = ForwardBatch(input_ids=zeros, positions=zeros, out_cache_loc=zeros,
                      extend_lens=np.array(q_lens, dtype=np.int64), seq_lens=np.array(kv_lens, dtype=np.int64),
                      rows=np.array(rows, dtype=np.int64), rows_device=torch.tensor(rows, dtype=torch.int32),
                      table=_mirror(table), kv_pool=pool, attn_backend=backend, is_decode=False)
    backend.init_forward_metadata(fb)
    layer = PagedAttention(0, heads, kv_heads, D)
    q = torch.randn(total_q, heads, D, generator=g).to(dtype)
    out = layer(q, fb).view(total_q, heads, D)
    ref = naive_extend(q, pool.k[0], pool.v[0], slots, q_lens, kv_lens, kv_heads, layer.scaling)
    return out, ref


def _mirror(table: ReqToTokenTable) -> TableMirror:
    mirror = TableMirror(table.max_rows, table.max_context, torch.device("cpu"), on_device=False, on_host=True)
    mirror.host[:] = table.table
    return mirror


def assert_close(out, ref, atol=ATOL):
    assert out.shape == ref.shape
    err = (out.double() - ref).abs().max().item()
    assert err < atol, f"max abs error {err}"


# (heads, kv_heads): MHA, the SmolLM2 grouping (3 query heads per KV head), GQA 4, MQA
HEADS = [(4, 4), (9, 3), (8, 2), (4, 1)]


@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_no_prefix(heads, kv_heads):
    # 300 tokens: several of the fused kernel's blocks, so skipping the
    # blocks above the diagonal is exercised.
    for q_len in (1, 2, 37, 300):
        out, ref = run_extend([q_len], [q_len], heads, kv_heads, seed=q_len)
        assert_close(out, ref)


@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_cached_prefix(heads, kv_heads):
    # kv_len > q_len: query j sits at kv_len - q_len + j (bottom-right aligned),
    # which is exactly where a top-left is_causal mask would be wrong.
    for q_len, kv_len in [(2, 3), (20, 50), (150, 160), (64, 300)]:
        out, ref = run_extend([q_len], [kv_len], heads, kv_heads, seed=kv_len)
        assert_close(out, ref)


def test_one_query_after_a_prefix():
    out, ref = run_extend([1], [77], 9, 3)
    assert_close(out, ref)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
def test_mixed_batch(heads, kv_heads):
    # No prefix, a prefix, q_len 1 after a prefix, q_len 1 with no prefix, a long one.
    q_lens = [33, 5, 1, 1, 120, 7]
    kv_lens = [33, 70, 40, 1, 200, 7]
    out, ref = run_extend(q_lens, kv_lens, heads, kv_heads, seed=3)
    assert_close(out, ref)


def test_prefix_split_into_query_chunks(monkeypatch):
    """With a small mask budget the prefix path runs several chunks of
    queries (the last one shorter); the result must not depend on it."""
    q_lens, kv_lens = [45, 10, 1, 30], [100, 10, 60, 31]
    whole, ref = run_extend(q_lens, kv_lens, 9, 3, seed=5)
    monkeypatch.setattr(torch_backend, "_MASK_ELEMS", 7 * 100)  # chunks of 7 queries at kv_len 100
    chunked, _ = run_extend(q_lens, kv_lens, 9, 3, seed=5)
    assert_close(chunked, ref)
    assert torch.allclose(chunked, whole, atol=1e-6)
    monkeypatch.setattr(torch_backend, "_MASK_ELEMS", 1)  # one query per chunk
    single, _ = run_extend(q_lens, kv_lens, 9, 3, seed=5)
    assert_close(single, ref)


def test_float64():
    out, ref = run_extend([40, 3], [90, 3], 9, 3, seed=9, dtype=torch.float64)
    assert_close(out, ref, atol=1e-10)


def test_extend_of_one_token_matches_decode():
    """A one-token extend and a decode step over the same context agree."""
    q_lens, kv_lens = [1, 1, 1], [5, 64, 17]
    out, ref = run_extend(q_lens, kv_lens, 9, 3, seed=2)
    assert_close(out, ref)
    # the decode path on the same data (rebuilt with the same seed)
    g = torch.Generator().manual_seed(2)
    rng = np.random.default_rng(2)
    pool = KVPool(1, sum(kv_lens) + 8, 3, D, torch.float32, torch.device("cpu"))
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    table = ReqToTokenTable(5, max(kv_lens) + 1)
    free = rng.permutation(np.arange(1, pool.num_slots))
    rows, at = [], 0
    for kv_len in kv_lens:
        row = table.alloc_row()
        table.write(row, 0, free[at: at + kv_len])
        rows.append(row)
        at += kv_len
    backend = TorchAttentionBackend()
    zeros = torch.zeros(3, dtype=torch.int64)
    fb = ForwardBatch(input_ids=zeros, positions=zeros, out_cache_loc=zeros,
                      extend_lens=np.ones(3, dtype=np.int64), seq_lens=np.array(kv_lens, dtype=np.int64),
                      rows=np.array(rows, dtype=np.int64), rows_device=torch.tensor(rows, dtype=torch.int32),
                      table=_mirror(table), kv_pool=pool, attn_backend=backend, is_decode=True)
    backend.init_forward_metadata(fb)
    q = torch.randn(3, 9, D, generator=g)
    dec = PagedAttention(0, 9, 3, D)(q, fb).view(3, 9, D)
    assert torch.allclose(dec, out, atol=1e-5)


def test_long_chunked_prompt_logprobs_match_hf(llama):
    """Through a tiny engine: a 400-token prompt prefilled in chunks of 64
    (every chunk after the first attends to a cached prefix), and the same
    prompt in one chunk; prompt logprobs match HF."""
    from rollout_engine import RolloutEngine, SamplingParams

    hf, folder = llama
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 512, 400)]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    params = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=True)
    for chunk in (64, 8192):
        engine = RolloutEngine(folder, max_total_tokens=2048, max_prefill_tokens=chunk, attention_backend="torch")
        out = engine.generate(input_ids=[prompt], sampling_params=params)[0]
        assert torch.allclose(torch.tensor(out.prompt_logprobs[1:]), ref, atol=1e-4)
        assert out.output_token_ids[0] == int(logits[-1].argmax())
