"""Deterministic mode's products through cuBLAS at one row count
(layers/fixed_rows.py), on the CPU: the calls it makes, its check, and
which products take it. Whether cuBLAS itself passes the check is the GPU
tests' (test_gpu_deterministic.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout_engine.layers import fixed_rows, invariant


def _recording(monkeypatch) -> list[tuple[int, ...]]:
    """Record the shape of each call's rows (the calls still compute)."""
    calls, real = [], fixed_rows._call

    def call(x, weight, bias, out):
        calls.append((tuple(x.shape), x.data_ptr(), out.shape[0]))
        real(x, weight, bias, out)

    monkeypatch.setattr(fixed_rows, "_call", call)
    return calls


def test_every_call_has_rows_rows_and_the_output_is_the_product(monkeypatch):
    monkeypatch.setattr(fixed_rows, "ROWS", 8)
    calls = _recording(monkeypatch)
    torch.manual_seed(0)
    w, b = torch.randn(12, 5), torch.randn(12)
    for m in (0, 1, 7, 8, 9, 17, 24):
        calls.clear()
        x = torch.randn(m, 5)
        for bias in (None, b):
            y = fixed_rows.linear(x, w, bias)
            assert y.shape == (m, 12)
            torch.testing.assert_close(y, F.linear(x, w, bias))
        assert len(calls) == 2 * -(-m // 8)
        assert all(shape == (8, 5) and rows == 8 for shape, _, rows in calls)
    x3 = torch.randn(2, 5, 5)  # leading dimensions kept
    torch.testing.assert_close(fixed_rows.linear(x3, w, b), F.linear(x3, w, b))


def test_an_unaligned_or_strided_input_is_copied_before_the_calls(monkeypatch):
    monkeypatch.setattr(fixed_rows, "ROWS", 4)
    calls = _recording(monkeypatch)
    w = torch.randn(6, 16)
    base = torch.randn(9, 16)
    unaligned = base.view(-1)[1: 1 + 8 * 16].view(8, 16)  # 4 bytes past an aligned start
    assert unaligned.data_ptr() % fixed_rows.ALIGN
    torch.testing.assert_close(fixed_rows.linear(unaligned, w), F.linear(unaligned, w))
    strided = torch.randn(8, 32)[:, ::2]
    torch.testing.assert_close(fixed_rows.linear(strided, w), F.linear(strided, w))
    sources = (base, strided)
    assert len(calls) == 4 and not any(s.data_ptr() <= ptr < s.data_ptr() + s.untyped_storage().nbytes()
                                       for _, ptr, _ in calls for s in sources)  # copies, not views
    spare = torch.randn(8 * 16 + fixed_rows.ALIGN)  # the CPU allocator aligns to 64 bytes only
    skip = (-spare.data_ptr() % fixed_rows.ALIGN) // spare.element_size()
    aligned = spare[skip: skip + 8 * 16].view(8, 16)
    assert aligned.data_ptr() % fixed_rows.ALIGN == 0
    calls.clear()
    torch.testing.assert_close(fixed_rows.linear(aligned, w), F.linear(aligned, w))
    assert calls[0][1] == aligned.data_ptr()  # an aligned, contiguous input is read in place


def test_the_check_passes_an_invariant_product_and_fails_one_that_depends_on_the_row(monkeypatch):
    monkeypatch.setattr(fixed_rows, "ROWS", 8)
    monkeypatch.setattr(fixed_rows, "_CHECKED", {})
    w = torch.randn(6, 16)

    def each_row_alone(x, weight, bias, out):  # invariant by construction
        out.copy_(torch.cat([F.linear(x[i: i + 1], weight, bias) for i in range(x.shape[0])]))

    def rounds_by_position(x, weight, bias, out):  # row i's result depends on where it stands
        out.copy_(F.linear(x, weight, bias) + 1e-3 * torch.arange(x.shape[0], dtype=x.dtype)[:, None])

    monkeypatch.setattr(fixed_rows, "_call", each_row_alone)
    assert fixed_rows.verify(w, None)
    assert fixed_rows.takes(w, None) and not fixed_rows.takes(w, torch.zeros(6))  # the bias is part of the shape
    monkeypatch.setattr(fixed_rows, "ENABLED", False)
    assert not fixed_rows.takes(w, None)
    monkeypatch.setattr(fixed_rows, "ENABLED", True)
    monkeypatch.setattr(fixed_rows, "_call", rounds_by_position)
    assert fixed_rows.verify(w, None)  # a shape keeps its first answer (engines of one process agree)
    monkeypatch.setattr(fixed_rows, "_CHECKED", {})
    assert not fixed_rows.verify(w, None)
    assert not fixed_rows.takes(w, None)


def test_a_check_that_fails_with_an_error_answers_false(monkeypatch):
    """Out of memory (or any runtime error) while checking: the shape takes
    the Triton kernels, the engine still starts."""
    monkeypatch.setattr(fixed_rows, "_CHECKED", {})

    def out_of_memory(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(fixed_rows, "_call", out_of_memory)
    w = torch.randn(6, 16)
    assert not fixed_rows.verify(w, None)
    assert not fixed_rows.takes(w, None)


def test_prepare_routes_checked_shapes_to_cublas_and_compiles_triton_for_the_rest(monkeypatch):
    """prepare_products checks each distinct shape once; the shapes that
    pass skip the Triton compile, invariant_linear sends them to cuBLAS."""
    monkeypatch.setattr(fixed_rows, "_CHECKED", {})
    passing = {(12, 5)}

    def verify(weight, bias, **_):
        fixed_rows._CHECKED[fixed_rows._key(weight, bias)] = tuple(weight.shape) in passing
        return tuple(weight.shape) in passing

    compiled = []
    monkeypatch.setattr(fixed_rows, "verify", verify)
    monkeypatch.setattr(invariant, "use_kernel", lambda t: True)
    monkeypatch.setattr(invariant, "invariant_matmul", lambda x, w, b=None, **kw: compiled.append(tuple(w.shape)))
    monkeypatch.setattr(invariant, "launches_to_compile", lambda n, k, device: [(1, True), (300, False)])

    class Linear(torch.nn.Linear):
        batch_invariant = True

    model = torch.nn.Sequential(Linear(5, 12), Linear(5, 12), Linear(12, 5, bias=False)).requires_grad_(False)
    assert invariant.prepare_products(model) == (1, 1)
    assert compiled == [(5, 12), (5, 12)]  # the failing shape's two launches, and nothing for the passing one
    x = torch.randn(3, 5)
    torch.testing.assert_close(invariant.invariant_linear(x, model[0].weight, model[0].bias),
                               F.linear(x, model[0].weight, model[0].bias))
    compiled.clear()
    invariant.invariant_linear(torch.randn(3, 12), model[2].weight)
    assert compiled == [(5, 12)]  # the failing shape: the Triton kernels
