"""The small-batch product's launch shapes (kernels/batch_gemm.py), chosen on
the host: measured choices kept, splits only with counters, and the products
that take it at all."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from rollout_engine.kernels.batch_gemm import MAX_ROWS, SMS, new_counters, pick, small_batch, use_counters


def test_narrow_products_split_the_reduction_and_wide_ones_do_not():
    # qwen3-0.6b at 16 rows (benchmarks/batch_gemm_configs.py, H200): o and down
    # split in 4, qkv and gate_up (64-96 tiles, K = 1024) not at all
    assert pick(16, 1024, 2048, True).split == 4
    assert pick(16, 1024, 3072, True).split == 4
    assert pick(16, 4096, 1024, True).split == 1
    assert pick(16, 6144, 1024, True).split == 1
    # llama-3.1-8b: a long K splits in two even with 64 tiles
    assert pick(8, 4096, 14336, True).split == 2
    assert pick(8, 6144, 4096, True).split == 1  # 96 tiles: twice that would pass the SM count


def test_fp8_products_take_the_measured_shapes():
    # qwen2.5-7b at 1 to 64 rows (benchmarks/fp8_gemm_configs.py, H200): blocks of 256 columns; qkv and
    # gate_up unsplit, down (K = 18944) in four, o (56 tiles) split; the grid's best within 0.3-1.2 us
    assert pick(1, 4608, 3584, True, fp8=True) == (16, 64, 256, 1, 4, 4, True, False)
    assert pick(1, 37888, 3584, True, fp8=True).split == 1
    assert pick(1, 3584, 18944, True, fp8=True).split == 4
    assert pick(64, 3584, 18944, True, fp8=True).block_m == 64
    assert pick(16, 3584, 3584, True, fp8=True).split > 1
    assert pick(1, 3584, 18944, False, fp8=True).split == 1


def test_programs_stay_about_one_per_sm_and_slices_long():
    for m in (2, 7, 16, 32):
        for n in (128, 1000, 1024, 4096, 6144, 28672, 151936):
            for k in (64, 1000, 2048, 4096, 14336):
                c = pick(m, n, k, True)
                tiles = -(-n // c.block_n) * -(-m // c.block_m)
                assert c.block_m >= m and c.swap
                assert c.split == 1 or (tiles * c.split <= SMS and k // c.split >= 256)
                assert pick(m, n, k, False).split == 1


def test_counters_are_scoped_to_the_block():
    from rollout_engine.kernels import batch_gemm as bg

    a, b = new_counters(torch.device("cpu")), new_counters(torch.device("cpu"))
    assert getattr(bg._local, "counters", None) is None
    with use_counters(a):
        with use_counters(b):
            assert bg._local.counters is b
        assert bg._local.counters is a
    assert bg._local.counters is None


def test_only_small_gpu_batches_take_it():
    w = torch.zeros(64, 32, dtype=torch.bfloat16)
    assert not small_batch(torch.zeros(4, 32, dtype=torch.bfloat16), w)  # on the CPU: F.linear
    assert MAX_ROWS == 32


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
                    reason="needs Triton's interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_interpreted_copy_engine_tiles_equal_pointer_loads(dtype):
    """x and W tiles through tensor descriptors (GemmConfig.tma): the same
    bits as the pointer loads, with rows, columns and K past the tiles,
    split or not, swapped or not; a tensor the copy engine cannot read (a
    row of 36 bytes) keeps the pointer loads."""
    from rollout_engine.kernels._triton import copy_engine_reads
    from rollout_engine.kernels.batch_gemm import GemmConfig, batch_gemm

    torch.manual_seed(0)
    configs = (GemmConfig(16, 16, 32, 1, 4, 2), GemmConfig(16, 32, 32, 2, 4, 2),
               GemmConfig(16, 16, 16, 4, 4, 2, swap=True))
    with use_counters(new_counters(torch.device("cpu"))):
        for m, n, k in ((5, 40, 72), (70, 48, 136), (3, 24, 18)):
            x, w, b = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
            assert copy_engine_reads(x) == ((k * x.element_size()) % 16 == 0)
            ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
            for cfg in configs:
                out = batch_gemm(x, w, b, cfg._replace(tma=True))
                assert torch.equal(out, batch_gemm(x, w, b, cfg))
                assert (out.double() - ref).abs().max() < (2e-2 if dtype == torch.float16 else 1e-4)


def test_wide_products_take_only_the_listed_shapes_at_the_listed_rows(monkeypatch):
    from rollout_engine.kernels import batch_gemm as bg

    # by default: the 8B's qkv and down at 128 rows, the shapes an H100 sweep and the engine's A/B kept
    assert bg.wide_pick(128, 6144, 4096, False) == bg.GemmConfig(128, 64, 128, 1, 4, 4, False, True)
    assert bg.wide_pick(128, 4096, 14336, True).split == 2 and bg.wide_pick(128, 4096, 14336, False) is None
    assert bg.wide_pick(256, 6144, 4096, True) is None and bg.wide_pick(64, 6144, 4096, True) is None
    assert bg.wide_pick(128, 1024, 2048, True) is None
    monkeypatch.setattr(bg, "WIDE", {(1024, 2048): (64, 32, 64, 2, 4, 4, False, True),
                                     (1024, 3072): (64, 64, 128, 1, 4, 3, False, True)})
    monkeypatch.setattr(bg, "WIDE_ROWS", (128, 256))
    assert bg.wide_pick(128, 1024, 2048, True) == bg.GemmConfig(64, 32, 64, 2, 4, 4, False, True)
    assert bg.wide_pick(256, 1024, 3072, False).split == 1
    assert bg.wide_pick(200, 1024, 2048, False) is None  # a split of K only with counters
    assert bg.wide_pick(127, 1024, 2048, True) is None and bg.wide_pick(257, 1024, 2048, True) is None
    assert bg.wide_pick(128, 2048, 1024, True) is None  # not listed
    # on the CPU no product takes a kernel
    assert bg.wide_batch(torch.zeros(128, 2048), torch.zeros(1024, 2048)) is None


def test_a_sweep_lists_the_shape_of_least_total_time_where_it_beats_cublas_at_every_row():
    from test_benchmark_scripts import _benchmark

    module = _benchmark("batch_gemm_configs")

    def row(n, k, m, linear, configs):
        return {"n": n, "k": k, "m": m, "linear_us": linear,
                "configs": {c: ({"us": us} if us is not None else "out of shared memory") for c, us in configs.items()}}

    a, b, c = "64,32,64,2,4,4,False,True", "64,64,128,1,4,3,False,False", "128,64,64,1,8,3,False,True"
    rows = [row(1024, 2048, 16, 1.0, {a: 9.0}),  # at most MAX_ROWS: not this table's
            row(1024, 2048, 128, 6.0, {a: 5.0, b: 4.0, c: None}),
            row(1024, 2048, 256, 7.0, {a: 5.0, b: 6.5, c: 1.0}),  # c fails at 128 rows: not a candidate
            row(1024, 3072, 128, 6.0, {a: 5.0, b: 4.0}),
            row(1024, 3072, 256, 6.0, {a: 5.8, b: 6.2})]  # b least in total, a and b too slow at 256
    assert module.wide_table(rows) == {(1024, 2048): (64, 32, 64, 2, 4, 4, False, True)}
    assert module.wide_table(rows, margin=0.5) == {}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
                    reason="needs Triton's interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_interpreted_gated_product_has_the_bits_of_the_product_then_the_activation(dtype):
    """SiLU(gate) * up inside the product's launch (`gated_batch_gemm`): the
    bits of the product followed by kernels.activation's launch, with the
    output's columns, rows and K past the tiles, split or not, swapped or
    not, through pointer loads and the copy engine."""
    from rollout_engine.kernels.activation import silu_and_mul, silu_and_mul_ref
    from rollout_engine.kernels.batch_gemm import GemmConfig, batch_gemm, gated_batch_gemm

    torch.manual_seed(0)
    configs = (GemmConfig(16, 16, 32, 1, 4, 2), GemmConfig(16, 32, 32, 2, 4, 2),
               GemmConfig(16, 16, 16, 4, 4, 2, swap=True), GemmConfig(16, 16, 16, 3, 4, 2, swap=True, tma=True))
    with use_counters(new_counters(torch.device("cpu"))):
        for m, i, k in ((5, 40, 72), (17, 24, 136), (3, 20, 48)):
            x, w = torch.randn(m, k).to(dtype), (torch.randn(2 * i, k) * k ** -0.5).to(dtype)
            ref = silu_and_mul_ref(torch.nn.functional.linear(x.double(), w.double()))
            for cfg in configs:
                out = gated_batch_gemm(x, w, cfg)
                assert out.shape == (m, i) and out.dtype == dtype
                assert torch.equal(out, silu_and_mul(batch_gemm(x, w, None, cfg))), cfg
                assert (out.double() - ref).abs().max() < (2e-2 if dtype == torch.float16 else 1e-4)
    with pytest.raises(ValueError, match="even row count"):
        gated_batch_gemm(x, w[1:], configs[0])
    for bad in (w[:, 1:], w[0]):  # K that is not x's, a weight of one dimension
        with pytest.raises(ValueError, match=r"x \[M, K\] and weight \[N, K\]"):
            gated_batch_gemm(x, bad, configs[0])


@pytest.mark.parametrize("given", [None, ["64,32,64,2,4,4", "128,64,128,1,4,3"]])
def test_a_sweep_times_each_row_count_on_its_own_launch_shapes(monkeypatch, given):
    """Every row count gets the grid of its own rows (or the --configs
    given), plus the engine's pick at up to 32 rows: not the list the first
    row count timed. Run on the CPU with the timing and the kernel stubbed."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from test_benchmark_scripts import _benchmark

    module = _benchmark("batch_gemm_configs")
    monkeypatch.setattr(module, "SPILL_BYTES", 1)
    monkeypatch.setattr(module, "measure_device", lambda: SimpleNamespace(flops=1e15, bandwidth=3e12))
    monkeypatch.setattr(module, "time_us", lambda fn, copies: (fn(), 1.0)[1])
    monkeypatch.setattr(module, "batch_gemm", lambda x, w, b, cfg: F.linear(x, w, b))
    only = [module.launch_shape(c) for c in given] if given else None
    out = module.run("qwen3-0.6b", [16, 128, 256], ["o"], configs=only, dev="cpu")
    for row in out["rows"]:
        expect = {",".join(map(str, c)) for c in module.grid(row["m"], "off", only)}
        if row["m"] <= MAX_ROWS:
            expect.add(",".join(map(str, pick(row["m"], row["n"], row["k"], True))))
        assert set(row["configs"]) == expect, row["m"]
    assert [r["m"] for r in out["rows"]] == [16, 128, 256]
