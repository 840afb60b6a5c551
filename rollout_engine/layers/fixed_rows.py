"""Batch-invariant matrix products through cuBLAS called at one row count
(deterministic mode on the GPU).

cuBLAS chooses its kernel (tiles, a split of the reduction) from the
product's shape, so a row can round differently in a batch of 1 and of 300.
Called always with the same shape it runs the same kernel, and in the
kernels it picks an output element is reduced the same way whichever row of
the call it is in and whatever the other rows hold. So every product here
is ceil(M / ROWS) calls of exactly ROWS rows, the last one padded with zero
rows, each writing its own rows of the output: a row's bits depend on its
own values and the weight's shape, not on its batch.

That the kernel cuBLAS picks for a weight shape really behaves so is checked
when the engine starts (`verify`, from `layers.invariant.prepare_products`):
rows permuted, moved to another call, beside zero padding, computed twice,
eagerly and replayed in a CUDA graph must give the same bits. A shape that
fails keeps the Triton kernels (kernels/invariant_matmul.py), as does a
shape never checked.

cuBLAS's choice also follows torch's matmul settings (reduced-precision
reductions, TF32, the preferred BLAS library): the mode assumes they stay
as they were when the engine started; changed afterwards, the kernels
captured in the CUDA graphs and those of the eager steps could differ.

The price is the padding: a decode step of few rows computes ROWS of them.
ROWS is the default largest decode batch (`cuda_graph_max_batch_size`),
where rollouts spend their steps; measured in BENCHMARKS.md ("Deterministic
mode: cuBLAS at a fixed row count")."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from rollout_engine.memory.saver import plain_graph_capture

log = logging.getLogger("rollout_engine")

ROWS = 256
ENABLED = True  # False: every product takes the Triton kernels (A/B runs: benchmarks/ab_switch.py)
ALIGN = 256  # bytes: an input starting elsewhere is copied first (cuBLAS may pick kernels by alignment)

# (N, K, dtype, bias, device) -> whether the check passed
_CHECKED: dict[tuple, bool] = {}


def _key(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    return (*weight.shape, weight.dtype, bias is not None, str(weight.device))


def takes(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether products with this weight's shape run here (checked, and
    passed, on this device)."""
    return ENABLED and _CHECKED.get(_key(weight, bias), False)


def _call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """One product of exactly ROWS rows into `out` (the only cuBLAS call
    this module makes, so every row takes the same kernel)."""
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] W^T (+ b) as calls of ROWS rows."""
    shape = x.shape
    k, n = shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    calls = -(-m // ROWS)
    if m != calls * ROWS:
        x2 = F.pad(x2, (0, 0, 0, calls * ROWS - m))  # a new, aligned tensor
    elif not x2.is_contiguous() or x2.data_ptr() % ALIGN:
        x2 = x2.clone(memory_format=torch.contiguous_format)  # a new, aligned tensor
    y = torch.empty((calls * ROWS, n), dtype=x.dtype, device=x.device)
    for c in range(calls):
        rows = slice(c * ROWS, (c + 1) * ROWS)
        _call(x2[rows], weight, bias, y[rows])
    return y[:m].reshape(*shape[:-1], n)


def _graph_replay(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear(x)` captured in a CUDA graph and replayed."""
    static = x.clone()
    stream = torch.cuda.Stream(device=x.device)
    stream.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(stream):
        linear(static, weight, bias)  # warm-up outside the capture
    torch.cuda.current_stream(x.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with plain_graph_capture(graph, None):  # thread-local, as the engine's own captures
        out = linear(static, weight, bias)
    graph.replay()
    torch.cuda.current_stream(x.device).synchronize()
    return out


@torch.inference_mode()
def verify(weight: torch.Tensor, bias: torch.Tensor | None, graphs: bool = True, seed: int = 0) -> bool:
    """Check, with random rows, that `linear` gives each row the same bits
    wherever it stands and whatever stands beside it, for this weight's
    shape; remember the answer (`takes`). `graphs`: also replayed in a CUDA
    graph (the decode steps are); a check without it is not remembered. A
    shape checked before keeps its first answer (engines of one process
    agree), and a check that fails with an error (out of memory) answers
    False: the Triton kernels take the shape."""
    key = _key(weight, bias)
    if key in _CHECKED:
        return _CHECKED[key]
    try:
        same = _same_bits(weight, bias, graphs, seed)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
        log.warning("deterministic mode: checking cuBLAS at %d rows for a %s weight failed (%s); its products take "
                    "the Triton kernels", ROWS, tuple(weight.shape), str(e).splitlines()[0] if str(e) else type(e))
        same = False
    if graphs or not weight.is_cuda:
        _CHECKED[key] = same
    return same


def _same_bits(weight: torch.Tensor, bias: torch.Tensor | None, graphs: bool, seed: int) -> bool:
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    k = weight.shape[1]
    x = torch.randn(2 * ROWS, k, generator=gen, device=weight.device, dtype=weight.dtype)
    full = linear(x, weight, bias)
    perm = torch.randperm(2 * ROWS, generator=gen, device=weight.device)
    same = (torch.equal(linear(x, weight, bias), full)  # twice
            and torch.equal(linear(x[perm], weight, bias), full[perm])  # moved, to the other call too
            and torch.equal(linear(x[3:8], weight, bias), full[3:8])  # beside zero padding
            and torch.equal(linear(x[ROWS + 1: ROWS + 2], weight, bias), full[ROWS + 1: ROWS + 2]))
    if same and graphs and weight.is_cuda:
        same = torch.equal(_graph_replay(x[perm[:ROWS - 9]], weight, bias), full[perm[:ROWS - 9]])
    return same
