"""Triton is optional: kernels are built on first use, on CUDA only."""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

# Programmatic dependent launch (Hopper on): a kernel launched with it may
# start while the kernel before it still runs, and waits (`gdc_wait`) for it
# to finish before reading what it wrote. Kernels that take part read before
# their wait only what no kernel of a forward pass writes (weights, norm
# weights), what earlier steps wrote (the cache entries of earlier tokens) or
# what a kernel two launches back wrote (the MoE down launch's experts:
# `kernels.moe.EARLY_DOWN`), write nothing before it, and let the next kernel
# start (`gdc_launch_dependents`) only after it, so every kernel before the
# one before has finished by then (tests/test_kernels_build_for_hopper.py
# checks the order in every kernel it builds). Tests and A/B runs turn it off
# to compare.
PDL_ENABLED = True


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


def use_kernel(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_available()


@functools.cache
def _pdl_device(index: int) -> bool:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9  # NVIDIA Hopper on


def use_pdl(x: torch.Tensor) -> bool:
    """Launch x's kernels with programmatic dependent launch (see PDL_ENABLED)."""
    return PDL_ENABLED and x.is_cuda and _pdl_device(x.device.index if x.device.index is not None
                                                     else torch.cuda.current_device())


def pdl_args(x: torch.Tensor) -> dict:
    """A kernel's `PDL` constexpr and launch option for a launch on x's device
    (the option is left out where it is off: older Triton does not know it)."""
    on = use_pdl(x)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@functools.cache
def _copy_engine_device(index: int) -> bool:
    return (importlib.util.find_spec("triton.tools.tensor_descriptor") is not None and torch.version.hip is None
            and torch.cuda.get_device_capability(index)[0] >= 9)


def copy_engine_layout(t: torch.Tensor) -> bool:
    """Whether t's layout suits tensor descriptors: unit last stride, a
    16-byte aligned start and strides."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all((st * size) % 16 == 0 for st in t.stride()[:-1])


def copy_engine_reads(t: torch.Tensor) -> bool:
    """Whether a kernel can read t through Triton tensor descriptors (the
    copy engine, TMA): `copy_engine_layout`, on an NVIDIA GPU of compute
    capability 9 or more, or under Triton's interpreter (which runs them on
    the CPU)."""
    if not copy_engine_layout(t):
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return importlib.util.find_spec("triton") is not None
    return t.is_cuda and _copy_engine_device(t.device.index if t.device.index is not None
                                             else torch.cuda.current_device())


def tile_reader(t: torch.Tensor, block: list[int], wanted: bool = True):
    """What a kernel reads t through: (a Triton tensor descriptor of
    `block`-shaped tiles over t, True) where `wanted` and the copy engine
    can read t (`copy_engine_reads`), else (t, False): the kernel keeps its
    pointer loads."""
    if not (wanted and copy_engine_reads(t)):
        return t, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block), True


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def half_rows_on_gpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x W^T can take one of the engine's product kernels: x 2-D,
    contiguous, bf16 or fp16 on a GPU with Triton; W of x's dtype with unit
    column stride."""
    return (x.dim() == 2 and x.is_contiguous() and weight.stride(1) == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and use_kernel(x))


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
