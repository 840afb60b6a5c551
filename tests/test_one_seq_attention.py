"""Decode attention of one sequence in one launch (kernels/one_seq_attention.py):
against the torch reference under Triton's interpreter on the CPU (run with
TRITON_INTERPRET=1 where Triton is installed; skipped otherwise) and on the
GPU, where a CUDA graph captured once is replayed over sequences of other
lengths, rows and caches, with the new token's K/V written by the kernel
before it, as a decode step does."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from rollout_engine.kernels.attention import paged_attention_ref
from rollout_engine.kernels.one_seq_attention import BLOCK_N, SPLITS, supported

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs Triton's interpreter (TRITON_INTERPRET=1)")


def _case(hq, hk, d, lens, dtype, device, kv_dtype=None, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    slots = 4 * max(lens) + 64
    k = torch.randn(slots, hk, d, generator=g).to(device, dtype)
    v = torch.randn(slots, hk, d, generator=g).to(device, dtype)
    if kv_dtype is not None:
        k, v = k.clamp(-448, 448).to(kv_dtype), v.clamp(-448, 448).to(kv_dtype)
    table = torch.randperm(slots, generator=g)[: 3 * max(lens)].view(3, -1).to(device, torch.int32)
    q = torch.randn(len(lens), hq, d, generator=g).to(device, dtype)
    return q, k, v, table


def _check(q, k, v, table, row, length, atol):
    from rollout_engine.kernels.one_seq_attention import one_seq_attention

    dev = q.device
    counters = torch.zeros(k.shape[1], dtype=torch.int32, device=dev)
    rows = torch.tensor([row], dtype=torch.int32, device=dev)
    pos = torch.tensor([length - 1], dtype=torch.int64, device=dev)
    scale = q.shape[-1] ** -0.5
    got = one_seq_attention(q, k, v, table, rows, pos, scale, counters)
    kr, vr = (k.to(q.dtype), v.to(q.dtype)) if k.dtype != q.dtype else (k, v)
    ref = paged_attention_ref(q, kr, vr, table, [row], [length], [1], scale)
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=atol)
    assert int(counters.abs().sum()) == 0  # left zero for the next launch


def test_supported_shapes():
    q = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(10, 2, 128, dtype=torch.bfloat16)
    assert supported(q, k, k)
    assert not supported(q.float(), k, k)  # fp32 queries: the batch kernels
    assert not supported(torch.zeros(2, 8, 128, dtype=torch.bfloat16), k, k)  # two tokens
    assert not supported(torch.zeros(1, 8, 96, dtype=torch.bfloat16), k[..., :96], k[..., :96])  # not a power of two
    assert not supported(torch.zeros(1, 7, 128, dtype=torch.bfloat16), k, k)  # heads that do not group


@interpreted
@pytest.mark.parametrize("hq,hk", [(4, 1), (8, 2), (6, 2)])
@pytest.mark.parametrize("length", [1, 2, BLOCK_N - 1, BLOCK_N, BLOCK_N + 1, 5 * BLOCK_N + 3])
def test_interpreted_matches_reference(hq, hk, length):
    q, k, v, table = _case(hq, hk, 16, [length], torch.float32, "cpu")
    _check(q, k, v, table, 2, length, 1e-4)


@interpreted
def test_interpreted_loops_over_more_blocks_than_programs():
    hk = 2
    length = (SPLITS * 2 + 1) * BLOCK_N + 7  # every program two blocks or more
    q, k, v, table = _case(4, hk, 16, [length], torch.float32, "cpu", seed=1)
    _check(q, k, v, table, 1, length, 1e-4)


@interpreted
def test_interpreted_e4m3_cache():
    q, k, v, table = _case(4, 2, 16, [150], torch.float32, "cpu", kv_dtype=torch.float8_e4m3fn, seed=2)
    _check(q, k, v, table, 0, 150, 1e-4)


# ---------------------------------------------------------------- GPU
def _rotating_case(hq, hk, d, length, dtype, device, norm, kv_dtype=None, seed=0):
    """A step whose attention rotates q and stores the new K/V itself: the
    raw qkv row's views, the caches, and the rotation's tables."""
    from rollout_engine.kernels.one_seq_attention import NewEntry
    from rollout_engine.layers.rotary import RotaryEmbedding
    from rollout_engine.models.config import RopeConfig

    g = torch.Generator(device="cpu").manual_seed(seed)
    _, k, v, table = _case(hq, hk, d, [length], dtype, device, kv_dtype, seed)
    qkv = torch.randn(1, (hq + 2 * hk) * d, generator=g).to(device, dtype)
    q, kn, vn = (t.view(1, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    rotary = RotaryEmbedding(d, length + 8, RopeConfig(theta=1e4)).to(device)
    qk_norm = None
    if norm:
        qw, kw = ((torch.rand(d, generator=g) + 0.5).to(device, dtype) for _ in range(2))
        qk_norm = (qw, kw, 1e-6)
    row = 1
    loc = table[row, length - 1:length].long()
    pos = torch.tensor([length - 1], dtype=torch.int64, device=device)
    return q, k, v, table, row, pos, NewEntry(kn, vn, rotary.cos, rotary.sin, loc, qk_norm)


def _check_rotating(hq, hk, d, length, dtype, device, norm, kv_dtype=None, seed=0):
    """The launch that rotates and stores against the rotary kernel then the
    attention: the caches get the same bytes (the new K is computed on the
    rotary kernel's own tile, so its norm sums in the same order). Under
    the interpreter the output is the same bits too; on the GPU the queries'
    norm runs on a tile of the group's heads, which may sum in another
    order, so the output is held to the attention's tolerance."""
    from rollout_engine.kernels.one_seq_attention import one_seq_attention
    from rollout_engine.kernels.rope import rope_and_store

    q, k, v, table, row, pos, new = _rotating_case(hq, hk, d, length, dtype, device, norm, kv_dtype, seed)
    k2, v2 = k.clone(), v.clone()
    counters = torch.zeros(hk, dtype=torch.int32, device=device)
    rows = torch.tensor([row], dtype=torch.int32, device=device)
    scale = d ** -0.5
    got = one_seq_attention(q, k, v, table, rows, pos, scale, counters, new)
    qo = rope_and_store(pos, q, new.k, new.v, new.cos, new.sin, k2, v2, new.loc, new.qk_norm)
    want = one_seq_attention(qo, k2, v2, table, rows, pos, scale, counters)
    for mine, theirs in ((k, k2), (v, v2)):  # bytes: an e4m3 cache has no torch.equal
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
    assert int(counters.abs().sum()) == 0
    if device == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@interpreted
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("length", [1, BLOCK_N, BLOCK_N + 1, 5 * BLOCK_N + 3, (SPLITS + 3) * BLOCK_N + 5])
def test_interpreted_rotating_launch_equals_the_rotary_kernel_then_attention(norm, dtype, length):
    _check_rotating(8, 2, 16, length, dtype, "cpu", norm)


@interpreted
@pytest.mark.parametrize("hq,hk,d", [(14, 2, 64), (12, 4, 128), (4, 4, 256), (6, 1, 16)])
def test_interpreted_rotating_launch_over_head_shapes(hq, hk, d):
    # groups that are not powers of two, one KV head, head sizes 16 to 256
    _check_rotating(hq, hk, d, BLOCK_N + 7, torch.float16, "cpu", True, seed=hq)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hk,d", [(32, 4, 128), (16, 8, 128), (14, 2, 64)])
@pytest.mark.parametrize("length", [1, 64, 65, 1100, 9000])
def test_gpu_rotating_launch_equals_the_rotary_kernel_then_attention(norm, dtype, hq, hk, d, length):
    _check_rotating(hq, hk, d, length, dtype, "cuda", norm)


@pytest.mark.gpu
def test_gpu_rotating_launch_into_an_e4m3_cache():
    _check_rotating(32, 4, 128, 700, torch.bfloat16, "cuda", True, kv_dtype=torch.float8_e4m3fn)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hk,d", [(32, 8, 128), (32, 4, 128), (16, 16, 64), (14, 2, 64)])
@pytest.mark.parametrize("length", [1, 63, 64, 65, 1100, 9000])
def test_gpu_matches_reference(dtype, hq, hk, d, length):
    q, k, v, table = _case(hq, hk, d, [length], dtype, "cuda")
    _check(q, k, v, table, 1, length, 2e-2)


@pytest.mark.gpu
def test_gpu_e4m3_cache():
    q, k, v, table = _case(32, 4, 128, [700], torch.bfloat16, "cuda", kv_dtype=torch.float8_e4m3fn)
    _check(q, k, v, table, 2, 700, 2e-2)


@pytest.mark.gpu
def test_gpu_graph_replays_other_lengths_with_the_new_entry_written_just_before():
    """One graph, captured at one length, replayed over others: a copy
    kernel writes the new token's K/V (as the rotary kernel does) right
    before the attention, which starts early (dependent launch) and must
    still read the new entry, not the stale one."""
    from rollout_engine.kernels.one_seq_attention import one_seq_attention

    hq, hk, d = 32, 8, 128
    q, k, v, table = _case(hq, hk, d, [3000], torch.bfloat16, "cuda")
    rows = torch.zeros(1, dtype=torch.int32, device="cuda")
    pos = torch.zeros(1, dtype=torch.int64, device="cuda")
    slot = torch.zeros(1, dtype=torch.int64, device="cuda")
    new_k = torch.empty(1, hk, d, dtype=k.dtype, device="cuda")
    new_v = torch.empty_like(new_k)
    counters = torch.zeros(hk, dtype=torch.int32, device="cuda")
    scale = d ** -0.5

    def step():
        k.index_copy_(0, slot, new_k)  # this step's entry
        v.index_copy_(0, slot, new_v)
        return one_seq_attention(q[:1], k, v, table, rows, pos, scale, counters)

    def set_inputs(row, length, seed):
        g = torch.Generator(device="cpu").manual_seed(seed)
        rows.fill_(row)
        pos.fill_(length - 1)
        slot.copy_(table[row, length - 1:length].long())
        k[slot] = 0  # stale contents
        new_k.copy_(torch.randn(new_k.shape, generator=g).to(new_k))
        new_v.copy_(torch.randn(new_v.shape, generator=g).to(new_v))

    set_inputs(0, 5, 0)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for i, (row, length) in enumerate([(1, 1), (2, 64), (0, 65), (1, 1000), (2, 2999), (0, 129)]):
        set_inputs(row, length, i + 1)
        graph.replay()
        ref = paged_attention_ref(q[:1], k, v, table, [row], [length], [1], scale)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert int(counters.abs().sum()) == 0


@pytest.fixture(scope="module")
def one_seq_models(tmp_path_factory):
    from models import make_hf_model, save_model
    from gpu_parity import GPU_SHAPES, INIT_RANGE

    out = {}
    for kind in ("llama", "qwen3"):  # a group of 4; q/k norms in the rotary kernel
        hf = make_hf_model(kind, False, initializer_range=INIT_RANGE, max_position_embeddings=4096, **GPU_SHAPES[kind])
        out[kind] = hf.cuda().eval(), save_model(hf, tmp_path_factory.mktemp(kind))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_engine_batch_1_decode_takes_the_kernel_and_matches_hf(one_seq_models, monkeypatch, backend, page_size,
                                                              cuda_graph):
    """One request at a time, so every decode step has one sequence: the
    steps take the kernel (eagerly or in the captured batch-1 graph), and
    the greedy outputs' logprobs stay at HF's, over calls on one engine with
    a prefix-cache hit and a context past one key block per program."""
    from rollout_engine import RolloutEngine
    from rollout_engine.kernels import one_seq_attention as kernel
    from gpu_parity import gaps_vs_hf

    calls = []
    real = kernel.one_seq_attention
    monkeypatch.setattr(kernel, "one_seq_attention", lambda *a: calls.append(1) or real(*a))
    for kind, (hf, folder) in one_seq_models.items():
        engine = RolloutEngine(folder, device="cuda", attention_backend=backend, page_size=page_size,
                               cuda_graph=cuda_graph, cuda_graph_max_batch_size=8, max_total_tokens=16384)
        system = [3 + (i * 7) % 500 for i in range(2600)]  # 41+ key blocks: more than one per program
        for prompt in ([1, 2, 3, 4, 5], list(range(100, 140)), system + [5, 6], system + [9]):
            before = len(calls)
            (gap,), (out,) = gaps_vs_hf(engine, hf, [prompt])
            assert gap < 2e-2, (kind, len(prompt), gap)
            assert cuda_graph or len(calls) > before  # eager steps call it per layer
        assert out.num_cached_tokens >= 2560  # the last prompt hit the cache (whole pages)
        assert calls  # with graphs: at capture
        engine.check_integrity()
        engine.shutdown()



@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_engine_rotating_in_the_attention_launch_matches_hf(one_seq_models, monkeypatch, backend, cuda_graph):
    """Qwen3's per-head q/k norms keep the rotation out of the qkv product;
    with `attention.one_seq.ROTATE_IN_ONE_SEQ` the batch-1 attention launch
    rotates q and stores the new K/V itself. Both ways the greedy outputs'
    logprobs stay at HF's, over calls on one engine: a prefix-cache hit, a
    two-row call between (the batch kernels), and a request whose prompt
    extends a batch-1 output, so that its prefix hit reads K/V the launch
    stored."""
    from rollout_engine import RolloutEngine
    from rollout_engine.attention import one_seq
    from rollout_engine.kernels import one_seq_attention as kernel
    from gpu_parity import gaps_vs_hf

    hf, folder = one_seq_models["qwen3"]
    real = kernel.one_seq_attention
    rotating = []
    monkeypatch.setattr(kernel, "one_seq_attention",
                        lambda *a: rotating.append(len(a) > 8 and a[8] is not None) or real(*a))
    system = [3 + (i * 11) % 500 for i in range(2200)]
    for rotate in (True, False):
        monkeypatch.setattr(one_seq, "ROTATE_IN_ONE_SEQ", rotate)
        rotating.clear()
        engine = RolloutEngine(folder, device="cuda", attention_backend=backend, cuda_graph=cuda_graph,
                               cuda_graph_max_batch_size=8, max_total_tokens=16384)
        gaps, outs = gaps_vs_hf(engine, hf, [[1, 2, 3, 4, 5]])
        for prompts in ([system + [5, 6]], [system + [9]], [[7, 8, 9], system + [4]],
                        [[1, 2, 3, 4, 5] + outs[0].output_token_ids[:30]]):
            gaps += gaps_vs_hf(engine, hf, prompts)[0]
        assert max(gaps) < 2e-2, (rotate, gaps)
        assert rotating and all(r == rotate for r in rotating), rotate  # every batch-1 launch, or none, rotates
        engine.check_integrity()
        engine.shutdown()
