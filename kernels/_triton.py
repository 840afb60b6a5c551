"""Triton is optional: kernels are built on first use, on CUDA only."""
from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


def use_kernel(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_available()


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
