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


HOST_DEVICE = -1  # the stand-in's device: a key of Triton's per-device kernel caches no real device has


def can_build() -> bool:
    """Whether this Triton has what the stand-in takes the place of."""
    try:
        from triton.runtime import driver, jit
    except ImportError:
        return False
    return hasattr(driver, "_active") and hasattr(jit.JITFunction, "run")


class _HostHopper:
    """What JITFunction.run asks of the driver, for an sm_90 target."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return HOST_DEVICE

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@contextlib.contextmanager
def host_build() -> Iterator[list]:
    """Kernels launched inside are compiled for sm_90, not run, with the
    launch options an H100 gets (tiles through the copy engine where the
    layout allows, programmatic dependent launch); yields a list of (kernel
    name, compiled kernel) that fills as they are built."""
    from triton.runtime import driver, jit

    from rollout_engine.kernels import _triton

    built: list = []
    touched: set = set()
    real_run = jit.JITFunction.run

    def build_only(self, *args, grid, warmup, **kwargs):
        touched.add(self)
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        built.append((self.fn.__name__, kernel))
        return kernel

    prior = driver._active, _triton.copy_engine_reads, _triton.use_pdl
    driver.set_active(_HostHopper())
    jit.JITFunction.run = build_only
    _triton.copy_engine_reads = _triton.copy_engine_layout  # as on an H100: the layout decides
    _triton.use_pdl = lambda x: _triton.PDL_ENABLED
    try:
        yield built
    finally:
        jit.JITFunction.run = real_run
        driver._active, _triton.copy_engine_reads, _triton.use_pdl = prior
        for fn in touched:  # the stand-in's binders and kernels, under its own device key
            fn.device_caches.pop(HOST_DEVICE, None)


def registers_and_spills(kernel) -> tuple[int, int]:
    """(registers a thread, bytes spilled to local memory) of a kernel built
    here, as the PTX assembler that Triton ships reports them for sm_90a."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    ptxas = _ptxas(triton)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                                text=True, timeout=120, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spilled = sum(int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    return registers, spilled


def loads_before_wait(kernel) -> int:
    """Global loads a kernel built here issues before its dependent-launch
    wait (griddepcontrol.wait) in its PTX."""
    ptx = kernel.asm["ptx"]
    return ptx[:ptx.index("griddepcontrol.wait")].count("ld.global")


def _ptxas(triton) -> str:
    """The PTX assembler Triton itself builds sm_90 with (newer Triton picks
    among the ones it ships by architecture: its PTX needs the newer one)."""
    import inspect
    import os

    from triton.backends.nvidia import compiler

    get = getattr(compiler, "get_ptxas", None)
    if get is not None:
        tool = get(90) if inspect.signature(get).parameters else get()
        return getattr(tool, "path", tool)
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
