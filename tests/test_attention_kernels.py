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
    cache those of 32 rows or more where 4+ query heads share a KV head
    (llama-3.1-8b's 32 / 8, not Qwen3-0.6B's 16 / 8); none for fp16 queries;
    the switches turn each off."""
    from rollout_engine.attention import flashinfer_backend as fb
    from rollout_engine.attention.base import AttentionShape

    def shape(hq, hk, dtype=torch.bfloat16, kv=None):
        return AttentionShape(hq, hk, 128, 16, dtype, torch.device("cpu"), kv)

    e4m3 = torch.float8_e4m3fn
    assert fb.triton_decode_rows(shape(32, 8)) == 32 and fb.triton_decode_rows(shape(28, 4)) == 32
    assert fb.triton_decode_rows(shape(16, 8)) is None and fb.triton_decode_rows(shape(9, 3)) is None
    assert fb.triton_decode_rows(shape(16, 8, kv=e4m3)) == 1 and fb.triton_decode_rows(shape(32, 8, torch.float16)) is None
    monkeypatch.setattr(fb, "TRITON_DECODE_BF16_MIN_ROWS", 0)
    monkeypatch.setattr(fb, "TRITON_DECODE_E4M3", False)
    assert fb.triton_decode_rows(shape(32, 8)) is None and fb.triton_decode_rows(shape(32, 8, kv=e4m3)) is None
    monkeypatch.setattr(fb, "TRITON_DECODE_BF16_MIN_ROWS", 8)
    monkeypatch.setattr(fb, "TRITON_DECODE_BF16_MIN_GROUP", 1)
    assert fb.triton_decode_rows(shape(9, 3)) == 8
