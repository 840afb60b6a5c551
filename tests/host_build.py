"""Triton kernels built for Hopper on a machine without a GPU.

`host_build()` puts a stand-in for Triton's CUDA driver in place: every
kernel the engine's launch wrappers start inside the block is compiled for
sm_90 (as on an H100 / H200) and not run, so CPU tensors of the launch's
shapes are enough. The block yields the kernels built, whose metadata say
how much shared memory each takes. This catches what Triton's interpreter
cannot: code that does not compile (a variable given another shape in one
branch) and launch shapes over the shared memory of a block."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

HOPPER_SHARED = 232448  # bytes of shared memory one block may take on an H100 / H200


class _HostHopper:
    """What JITFunction.run asks of the driver, for an sm_90 target."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@contextlib.contextmanager
def host_build() -> Iterator[list]:
    """Kernels launched inside are compiled for sm_90, not run; yields a
    list of (kernel name, compiled kernel) that fills as they are built."""
    from triton.runtime import driver, jit

    built: list = []
    touched: set = set()
    real_run = jit.JITFunction.run

    def build_only(self, *args, grid, warmup, **kwargs):
        touched.add(self)
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        built.append((self.fn.__name__, kernel))
        return kernel

    prior = driver._active
    driver.set_active(_HostHopper())
    jit.JITFunction.run = build_only
    try:
        yield built
    finally:
        jit.JITFunction.run = real_run
        driver._active = prior
        for fn in touched:  # their binders and kernels are the stand-in's: a real launch later builds its own
            fn.device_caches.clear()
