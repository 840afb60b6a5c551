"""The Triton paged attention kernels (kernels/attention.py) under Triton's
interpreter on the CPU (run with TRITON_INTERPRET=1 where Triton is
installed; skipped otherwise), and on the GPU: bf16 queries over an e4m3
cache, whose products run in fp16."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from rollout_engine.kernels.attention import decode_attention, paged_attention_ref

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs Triton's interpreter (TRITON_INTERPRET=1)")


def _e4m3_case(hq, hk, d, lens, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = len(lens) * max(lens) + 64  # every row its own slots
    k = (torch.randn(slots, hk, d, generator=g) * 3).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
    v = (torch.randn(slots, hk, d, generator=g) * 3).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
    table = torch.randperm(slots, generator=g)[: len(lens) * max(lens)].view(len(lens), -1).int().to(device)
    q = (torch.randn(len(lens), hq, d, generator=g) * 30).to(torch.bfloat16)
    q[0, 0, 0] = 3e5  # past fp16's largest value (65504) before the queries' scaling
    q[1, 0, :4] = 1e-4  # and values that end below fp16's normal range after it
    return q.to(device), k, v, table


def _check_e4m3_decode(hq, hk, d, lens, device):
    q, k, v, table = _e4m3_case(hq, hk, d, lens, device)
    rows = list(range(len(lens)))[::-1]
    dev = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    got = decode_attention(q, k, v, table, dev(rows), dev(lens), d ** -0.5)
    ref = paged_attention_ref(q.float(), k.float(), v.float(), table, rows, lens, [1] * len(lens), d ** -0.5)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), ref, atol=4e-2, rtol=1e-2)  # bf16 outputs of a few units


@interpreted
def test_interpreted_bf16_queries_over_an_e4m3_cache():
    _check_e4m3_decode(8, 2, 16, [1, 77, 180], "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hq,hk", [(28, 4), (32, 8), (16, 16)])
def test_gpu_bf16_queries_over_an_e4m3_cache(hq, hk):
    _check_e4m3_decode(hq, hk, 128, [1, 63, 700, 1100], "cuda")


def test_decode_tiles_keep_about_a_thousand_warps_in_flight(monkeypatch):
    """`decode_tile`: one warp a program from 1,024 programs (sequences x KV
    heads), two from 512, four below; 32 keys a warp; five stages for an
    e4m3 cache, three for bf16; a forced DECODE_TILE wins."""
    from rollout_engine.kernels import attention

    assert attention.decode_tile(4096, True) == (32, 1, 5) and attention.decode_tile(1024, False) == (32, 1, 3)
    assert attention.decode_tile(512, True) == (64, 2, 5) and attention.decode_tile(300, False) == (64, 2, 3)
    assert attention.decode_tile(255, True) == (128, 4, 5) and attention.decode_tile(1, False) == (128, 4, 3)
    monkeypatch.setattr(attention, "DECODE_TILE", (16, 1, 2))
    assert attention.decode_tile(4096, True) == (16, 1, 2)


def test_flashinfer_sends_decode_steps_to_the_triton_kernel_by_cache_heads_and_rows(monkeypatch):
    """`triton_decode_rows`: every decode step over an e4m3 cache; over a bf16
    cache those of 32 rows or more, whatever the heads a KV head
    (llama-3.1-8b's 32 / 8 and Qwen3-0.6B's 16 / 8); none for fp16 queries;
    the switches turn each off, and the group switch asks for more heads."""
    from rollout_engine.attention import flashinfer_backend as fb
    from rollout_engine.attention.base import AttentionShape

    def shape(hq, hk, dtype=torch.bfloat16, kv=None):
        return AttentionShape(hq, hk, 128, 16, dtype, torch.device("cpu"), kv)

    e4m3 = torch.float8_e4m3fn
    assert fb.triton_decode_rows(shape(32, 8)) == 32 and fb.triton_decode_rows(shape(28, 4)) == 32
    assert fb.triton_decode_rows(shape(16, 8)) == 32 and fb.triton_decode_rows(shape(9, 3)) == 32
    assert fb.triton_decode_rows(shape(16, 8, kv=e4m3)) == 1 and fb.triton_decode_rows(shape(32, 8, torch.float16)) is None
    monkeypatch.setattr(fb, "TRITON_DECODE_BF16_MIN_ROWS", 0)
    monkeypatch.setattr(fb, "TRITON_DECODE_E4M3", False)
    assert fb.triton_decode_rows(shape(32, 8)) is None and fb.triton_decode_rows(shape(32, 8, kv=e4m3)) is None
    monkeypatch.setattr(fb, "TRITON_DECODE_BF16_MIN_ROWS", 8)
    monkeypatch.setattr(fb, "TRITON_DECODE_BF16_MIN_GROUP", 4)
    assert fb.triton_decode_rows(shape(9, 3)) is None and fb.triton_decode_rows(shape(32, 8)) == 8


def _ragged_case(hq, hk, d, lens, device, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    slots = len(lens) * max(lens) + 64
    k = torch.randn(slots, hk, d, generator=g).to(dtype).to(device)
    v = torch.randn(slots, hk, d, generator=g).to(dtype).to(device)
    table = torch.randperm(slots, generator=g)[: len(lens) * max(lens)].view(len(lens), -1).int().to(device)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype).to(device)
    return q, k, v, table


def _check_longest_first(hq, hk, d, lens, device, dtype):
    """Programs started in another order compute the same sums: the output
    with `order` (longest first, and a shuffle) equals the one without, bit
    for bit, and the reference within the dtype's rounding."""
    import numpy as np

    from rollout_engine.kernels.attention import longest_first

    from rollout_engine.kernels.attention import in_order

    q, k, v, table = _ragged_case(hq, hk, d, lens, device, dtype)
    rows = list(range(len(lens)))[::-1]
    dev = lambda x: torch.tensor(np.asarray(x), dtype=torch.int32, device=device)  # noqa: E731
    plain = decode_attention(q, k, v, table, dev(rows), dev(lens), d ** -0.5)
    order = longest_first(np.array(lens))
    assert sorted(order.tolist()) == list(range(len(lens))) and lens[order[0]] == max(lens)
    shuffled = torch.randperm(len(lens), generator=torch.Generator().manual_seed(2)).int().numpy()
    for o in (order, shuffled):
        o_rows, o_lens = in_order(o, np.array(rows), np.array(lens))  # the rows and lengths come in the order too
        assert torch.equal(decode_attention(q, k, v, table, dev(o_rows), dev(o_lens), d ** -0.5, dev(o)), plain)
    ref = paged_attention_ref(q.float(), k.float(), v.float(), table, rows, lens, [1] * len(lens), d ** -0.5)
    torch.testing.assert_close(plain.float(), ref, atol=2e-2, rtol=1e-2)


@interpreted
def test_interpreted_decode_programs_in_longest_first_order():
    _check_longest_first(8, 2, 16, [3, 90, 1, 40, 90, 17], "cpu", torch.float32)  # numpy has no bf16
    # bf16 queries over an e4m3 cache (the fp16 products): the order leaves the bits alone too
    lens = [1, 77, 180, 5]
    q, k, v, table = _e4m3_case(8, 2, 16, lens, "cpu")
    rows, dev = [3, 2, 1, 0], lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    plain = decode_attention(q, k, v, table, dev(rows), dev(lens), 0.25)
    order = [2, 1, 3, 0]
    got = decode_attention(q, k, v, table, dev([rows[i] for i in order]), dev([lens[i] for i in order]), 0.25,
                           dev(order))
    assert torch.equal(got, plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hq,hk", [(16, 8), (32, 8)])
def test_gpu_decode_programs_in_longest_first_order(hq, hk):
    _check_longest_first(hq, hk, 128, [5, 1500, 1, 700, 1500, 64, 300, 2], "cuda", torch.bfloat16)


def test_longest_first_is_a_stable_int32_permutation():
    import numpy as np

    from rollout_engine.kernels.attention import longest_first

    got = longest_first(np.array([5, 9, 2, 9, 1], dtype=np.int32))
    assert got.dtype == np.int32 and got.tolist() == [1, 3, 0, 2, 4]  # ties keep row order
    assert longest_first(np.array([], dtype=np.int32)).tolist() == []


def test_triton_backend_sends_each_decode_step_its_longest_first_order(monkeypatch):
    """The Triton backend's decode metadata carries the order, with the
    lengths and request-table rows in it (eager: in the step's one copy;
    graphs: a graph of `bs` rows reads lengths at [0, bs), rows at [bs, 2 bs)
    and the order at [2 bs, 3 bs) of one buffer, all written by one copy
    before a replay, padding rows last: one token of row 0). Prefill steps,
    LONGEST_FIRST off and the batch-invariant backend carry none, their
    lengths in row order."""
    from types import SimpleNamespace

    import numpy as np

    from rollout_engine.attention import triton_backend
    from rollout_engine.attention.base import AttentionShape
    from rollout_engine.attention.invariant_backend import BatchInvariantTritonBackend
    from rollout_engine.attention.triton_backend import TritonAttentionBackend

    shape = AttentionShape(8, 2, 16, 1, torch.float32, torch.device("cpu"))
    step = lambda lens, decode=True: SimpleNamespace(  # noqa: E731
        is_decode=decode, batch_size=len(lens), seq_lens=np.array(lens, dtype=np.int64),
        rows=np.arange(10, 10 + len(lens), dtype=np.int64), rows_device=torch.arange(10, 10 + len(lens)),
        extend_lens=np.ones(len(lens), dtype=np.int64) if decode else np.array(lens, dtype=np.int64), attn_metadata=None,
        share_keys=None, share_lens=None)
    be = TritonAttentionBackend(shape)
    fb = step([4, 30, 7])
    be.init_forward_metadata(fb)
    meta = fb.attn_metadata
    assert meta.order.tolist() == [1, 2, 0] and meta.seq_lens.tolist() == [30, 7, 4] and meta.rows.tolist() == [11, 12, 10]
    assert meta.qo_indptr.tolist() == [0, 1, 2, 3] and meta.max_q_len == 1
    fb = step([4, 30, 7], decode=False)
    be.init_forward_metadata(fb)
    meta = fb.attn_metadata
    assert meta.order is None and meta.rows is None and meta.seq_lens.tolist() == [4, 30, 7]
    assert meta.qo_indptr.tolist() == [0, 4, 34, 41] and meta.max_q_len == 30

    be.init_graph_buffers(8, 64)
    fb = step([1, 1, 1, 1])
    fb.attn_metadata = be.graph_metadata(4, fb)
    assert fb.attn_metadata.order.tolist() == [0, 1, 2, 3]  # a permutation before the first replay
    assert fb.attn_metadata.rows.tolist() == [10, 11, 12, 13]
    be.prepare_replay(3, 4, np.array([5, 9, 2]), np.array([7, 3, 8]), fb)
    meta = fb.attn_metadata
    assert meta.order.tolist() == [1, 0, 2, 3] and meta.seq_lens.tolist() == [9, 5, 2, 1]
    assert meta.rows.tolist() == [3, 7, 8, 0]

    monkeypatch.setattr(triton_backend, "LONGEST_FIRST", False)
    fb = step([4, 30, 7])
    be.init_forward_metadata(fb)
    assert fb.attn_metadata.order is None and be.graph_metadata(4, fb).order is None
    assert fb.attn_metadata.seq_lens.tolist() == [4, 30, 7]
    graph = be.graph_metadata(4, fb)
    fb.attn_metadata = graph
    be.prepare_replay(3, 4, np.array([5, 9, 2]), np.array([7, 3, 8]), fb)
    assert graph.seq_lens.tolist() == [5, 9, 2, 1]
    monkeypatch.setattr(triton_backend, "LONGEST_FIRST", True)
    inv = BatchInvariantTritonBackend(shape)
    fb = step([4, 30, 7])
    inv.init_forward_metadata(fb)
    assert fb.attn_metadata.order is None and fb.attn_metadata.seq_lens.tolist() == [4, 30, 7]
