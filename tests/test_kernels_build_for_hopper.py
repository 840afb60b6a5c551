"""The engine's Triton kernels built for Hopper (sm_90) on the host, no GPU
needed (tests/host_build.py): at the launch shapes the engine picks, and
each within a block's shared memory. Triton's interpreter runs the same
kernels' arithmetic but neither compiles them nor counts their memory."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from host_build import HOPPER_SHARED, can_build, host_build, loads_before_wait, registers_and_spills

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1" or not can_build(),
    reason="needs Triton, with the driver hooks tests/host_build.py replaces (the interpreter runs kernels "
           "instead of building them)")

BF16 = torch.bfloat16


def _fits(built: list, expect: set[str]) -> None:
    names = {name for name, _ in built}
    assert expect <= names, f"not built: {expect - names}"
    for name, kernel in built:
        assert kernel.metadata.shared <= HOPPER_SHARED, (name, kernel.metadata.shared)
        ptx = kernel.asm["ptx"]  # the next kernel starts only after this one's wait (_triton.PDL_ENABLED)
        if "griddepcontrol.launch_dependents" in ptx:
            assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents"), name


def test_small_batch_products_build_plain_gated_and_fp8_at_the_picked_and_listed_shapes():
    """`pick`'s shapes are swapped and often split: the accumulators change
    shape between the loop and the split's reduction, which must compile for
    the plain product as for the gated one; WIDE's and GATED_WIDE's listed
    shapes at their rows, with the copy engine's tiles."""
    from rollout_engine.kernels import batch_gemm as bg

    shapes = [(8, 4096, 14336), (16, 2048, 1024), (32, 6144, 4096), (2, 1024, 2048)]
    assert any(bg.pick(m, n, k, True).split > 1 for m, n, k in shapes)
    with host_build() as built, bg.use_counters(bg.new_counters(torch.device("cpu"))):
        for m, n, k in shapes:
            x = torch.randn(m, k, dtype=BF16)
            bg.batch_gemm(x, torch.randn(n, k, dtype=BF16))
            bg.gated_batch_gemm(x, torch.randn(2 * n, k, dtype=BF16))
        for (n, k), listed in bg.WIDE.items():
            bg.batch_gemm(torch.randn(bg.WIDE_ROWS[1], k, dtype=BF16), torch.randn(n, k, dtype=BF16), None,
                          bg.GemmConfig(*listed))
        for (n, k), listed in bg.GATED_WIDE.items():
            bg.gated_batch_gemm(torch.randn(bg.WIDE_ROWS[1], k, dtype=BF16), torch.randn(n, k, dtype=BF16),
                                bg.GemmConfig(*listed))
        e4m3 = torch.float8_e4m3fn
        m, n, k = 8, 3584, 18944
        assert bg.pick(m, n, k, True, fp8=True).split > 1
        bg.fp8_batch_gemm(torch.randn(m, k).to(e4m3), torch.ones(m, 1), torch.randn(n, k).to(e4m3),
                          torch.ones(n, 1))
    assert len(built) == 2 * len(shapes) + len(bg.WIDE) + len(bg.GATED_WIDE) + 1
    _fits(built, {"batch_gemm_kernel"})
    # as on an H100: dependent launch in every build, the listed shapes' tiles through the copy engine
    assert all("griddepcontrol" in kernel.asm["ptx"] for _, kernel in built)
    listed = built[2 * len(shapes):2 * len(shapes) + len(bg.WIDE) + len(bg.GATED_WIDE)]
    assert listed and all("cp.async.bulk.tensor" in kernel.asm["ptx"] for _, kernel in listed)


def test_the_gated_launch_at_the_plain_products_listed_shapes_is_over_the_shared_memory():
    """Why GATED_WIDE is a table of its own: two weight tiles a program at
    the 8B's listed launch shapes (four stages, copy engine) need more
    shared memory than a block has; three stages fit."""
    from rollout_engine.kernels import batch_gemm as bg

    listed = bg.GemmConfig(*bg.WIDE[(6144, 4096)])
    with host_build() as built:
        x, w = torch.randn(128, 4096, dtype=BF16), torch.randn(2 * 3072, 4096, dtype=BF16)
        bg.batch_gemm(x, w, None, listed)
        bg.gated_batch_gemm(x, w, listed)
        bg.gated_batch_gemm(x, w, listed._replace(stages=3))
    plain, gated, fewer = (kernel.metadata.shared for _, kernel in built)
    assert plain <= HOPPER_SHARED < gated and fewer <= HOPPER_SHARED


def test_one_row_products_and_the_moe_layer_build_at_decode_and_prompt_token_counts():
    from rollout_engine.kernels import gemv, moe

    E, H, I, K = 16, 2048, 768, 4
    w13, w2 = torch.randn(E, 2 * I, H, dtype=BF16), torch.randn(E, H, I, dtype=BF16)
    with host_build() as built:
        x = torch.randn(1, H, dtype=BF16)
        gemv.gemv(x, torch.randn(3 * H, H, dtype=BF16))
        gemv.norm_gemv(x, torch.randn(1, H, dtype=BF16), torch.randn(H, dtype=BF16), 1e-6,
                       torch.randn(2 * 6144, H, dtype=BF16), gated=True)
        for tokens in (1, 8, 300):
            x, weights, ids = torch.randn(tokens, H, dtype=BF16), torch.rand(tokens, K), torch.randint(0, E, (tokens, K))
            if tokens == 1:
                moe._fused_moe_one(x, w13, w2, weights, ids, moe.DECODE)
            else:
                moe._fused_moe_triton(x, w13, w2, weights, ids, moe.pick(tokens, K, E))
    _fits(built, {"gemv_kernel", "moe_up_kernel", "moe_down_kernel", "moe_align_kernel"})


def test_fp8_experts_build_at_every_picked_shape_without_spilling():
    """e4m3 experts (quantization="fp8") at qwen3-30b-a3b's shapes: the
    gate/up and down launches at every launch shape `pick` gives, one token
    and the three-launch sparse MLP, read their weight tiles through the
    copy engine, fit a block's shared memory and spill nothing."""
    from rollout_engine.kernels import moe, moe_row
    from rollout_engine.kernels.fp8 import FP8

    E, H, I, K = 128, 2048, 768, 8
    w13, w2 = torch.randn(E, 2 * I, H).to(FP8), torch.randn(E, H, I).to(FP8)
    scales = (torch.ones(E, 2 * I, 1), torch.ones(E, H, 1))
    counts = (8, 200, 700, 2048)
    with host_build() as built:
        for tokens in counts:
            x, weights, ids = torch.randn(tokens, H, dtype=BF16), torch.rand(tokens, K), torch.randint(0, E, (tokens, K))
            moe._fused_moe_triton(x, w13, w2, weights, ids, moe.pick(tokens, K, E), scales)
        x = torch.randn(1, H, dtype=BF16)
        moe._fused_moe_one(x, w13, w2, torch.rand(1, K), torch.randperm(E)[None, :K], moe.DECODE, scales)
        moe_row.moe_row(x, torch.randn(1, H, dtype=BF16), torch.ones(H, dtype=BF16), 1e-6,
                        torch.randn(E, H, dtype=BF16), w13, w2, K, True, scales=scales)
    products = [(name, kernel) for name, kernel in built if name in ("moe_up_kernel", "moe_down_kernel",
                                                                      "moe_row_up_kernel")]
    assert len(products) == 2 * len(counts) + 4  # one token: up, down; three launches: up, down (and the router)
    for name, kernel in products:
        assert registers_and_spills(kernel)[1] == 0, name
        assert "cp.async.bulk.tensor" in kernel.asm["ptx"], name
    _fits(built, {"moe_up_kernel", "moe_down_kernel", "moe_row_up_kernel"})


def test_one_row_products_read_four_weight_blocks_before_the_wait_without_spilling(monkeypatch):
    """`gemv.PRELOAD_BLOCKS`: at the engine's batch-1 launch shapes (a
    qwen3-30b-a3b o product, its qkv with the norm inside, an 8B qkv) each
    program's early weight blocks are loads before griddepcontrol.wait,
    and the registers they take do not spill."""
    from rollout_engine.kernels import gemv

    def build():
        with host_build() as built:
            gemv.gemv(torch.randn(1, 4096, dtype=BF16), torch.randn(2048, 4096, dtype=BF16))
            gemv.norm_gemv(torch.randn(1, 2048, dtype=BF16), torch.randn(1, 2048, dtype=BF16),
                           torch.randn(2048, dtype=BF16), 1e-6, torch.randn(5120, 2048, dtype=BF16))
            gemv.gemv(torch.randn(1, 4096, dtype=BF16), torch.randn(6144, 4096, dtype=BF16))
        return [kernel for _, kernel in built]

    monkeypatch.setattr(gemv, "PRELOAD_BLOCKS", 1)
    one = build()
    monkeypatch.setattr(gemv, "PRELOAD_BLOCKS", 4)
    four = build()
    for a, b in zip(one, four):
        assert loads_before_wait(b) == 4 * loads_before_wait(a) > 0
        assert registers_and_spills(b)[1] == 0


def test_the_one_token_down_launch_reads_its_first_weight_tile_before_the_wait(monkeypatch):
    """`moe.EARLY_DOWN`, at qwen3-30b-a3b's expert shapes: the down launch
    of the three-launch sparse MLP (experts from the router's logits) and of
    the one-token path (from the routing's ids) issues its first copy-engine
    weight read before griddepcontrol.wait; without it, none."""
    from rollout_engine.kernels import moe, moe_row

    E, H, I, K = 128, 2048, 768, 8
    w13, w2 = torch.randn(E, 2 * I, H, dtype=BF16), torch.randn(E, H, I, dtype=BF16)

    def downs():
        with host_build() as built:
            moe_row.moe_row(torch.randn(1, H, dtype=BF16), torch.randn(1, H, dtype=BF16), torch.randn(H, dtype=BF16),
                            1e-6, torch.randn(E, H, dtype=BF16), w13, w2, K, True)
            moe._fused_moe_one(torch.randn(1, H, dtype=BF16), w13, w2, torch.rand(1, K),
                               torch.randint(0, E, (1, K)), moe.DECODE)
        return [kernel for name, kernel in built if name == "moe_down_kernel"]

    def tiles_before_wait(kernel):
        ptx = kernel.asm["ptx"]
        return ptx[:ptx.index("griddepcontrol.wait")].count("cp.async.bulk.tensor")

    monkeypatch.setattr(moe, "EARLY_DOWN", False)
    assert [tiles_before_wait(k) for k in downs()] == [0, 0]
    monkeypatch.setattr(moe, "EARLY_DOWN", True)
    early = downs()
    assert len(early) == 2 and all(tiles_before_wait(k) > 0 for k in early)
    _fits([("moe_down_kernel", k) for k in early], {"moe_down_kernel"})


def test_the_fp8_one_row_product_and_the_decode_attentions_build():
    from rollout_engine.kernels import attention, fp8_row, one_seq_attention

    e4m3 = torch.float8_e4m3fn
    hq, hk, d, slots = 32, 8, 128, 4096
    caches = torch.randn(slots, hk, d, dtype=BF16), torch.randn(slots, hk, d, dtype=BF16)
    with host_build() as built:
        fp8_row.fp8_row(torch.randn(1, 2048, dtype=BF16), torch.randn(2 * 6144, 2048).to(e4m3),
                        torch.ones(2 * 6144, 1), norm=(torch.ones(2048, dtype=BF16), 1e-6),
                        residual=torch.randn(1, 2048, dtype=BF16), gated=True)
        one_seq_attention.one_seq_attention(torch.randn(1, hq, d, dtype=BF16), *caches,
                                            torch.zeros(4, slots, dtype=torch.int32),
                                            torch.zeros(1, dtype=torch.int32), torch.tensor([100]), d ** -0.5,
                                            torch.zeros(hk, dtype=torch.int32))
        for batch in (16, 128):
            attention.decode_attention(torch.randn(batch, hq, d, dtype=BF16), *caches,
                                       torch.zeros(batch, slots, dtype=torch.int32),
                                       torch.arange(batch, dtype=torch.int32),
                                       torch.full((batch,), 100, dtype=torch.int32), d ** -0.5)
    _fits(built, {"fp8_row_kernel", "one_seq_kernel", "decode_kernel"})
