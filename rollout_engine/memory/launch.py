"""`rollout-engine run -- python train.py ...`: start a program with
torch-memory-saver's preload hook, the mode that can also release CUDA-graph
memory. The hook must be loaded when the process starts, hence a launcher."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch


def _site_dir() -> Path:
    spec = importlib.util.find_spec("torch_memory_saver")
    if spec is None or spec.origin is None:
        raise RuntimeError("torch-memory-saver is not installed (pip install 'rollout-engine[gpu]')")
    return Path(spec.origin).parent.parent


def preload_library(site_dir: Path | None = None, cuda_major: int | None = None) -> Path:
    site_dir = site_dir or _site_dir()
    if cuda_major is None:
        if torch.version.cuda is None:
            raise RuntimeError("the preload hook needs a CUDA build of torch")
        cuda_major = int(torch.version.cuda.split(".")[0])
    lib = site_dir / f"torch_memory_saver_hook_mode_preload_cu{cuda_major}.abi3.so"
    if not lib.exists():
        raise RuntimeError(f"no preload hook for CUDA {cuda_major} in {site_dir} ({lib.name} is missing)")
    return lib


def preload_env(env: dict[str, str], lib: Path, site_dir: Path, cuda_major: int) -> dict[str, str]:
    """`env` with the hook preloaded and, where pip installed it, the CUDA
    runtime's folder on the library path (the hook links against it)."""
    out = dict(env)
    out["LD_PRELOAD"] = ":".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    runtime = _runtime_dir(site_dir, cuda_major)
    if runtime is not None:
        out["LD_LIBRARY_PATH"] = ":".join(p for p in (str(runtime), env.get("LD_LIBRARY_PATH", "")) if p)
    return out


def _runtime_dir(site_dir: Path, cuda_major: int) -> Path | None:
    """nvidia/cu<major>/lib next to torch-memory-saver, else wherever the
    `nvidia` namespace package lives (torch's CUDA wheels)."""
    candidates = [site_dir / "nvidia"]
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) for p in spec.submodule_search_locations]
    for base in candidates:
        lib = base / f"cu{cuda_major}" / "lib"
        if lib.is_dir():
            return lib
    return None


def run(argv: list[str]) -> int:
    if not argv:
        raise ValueError("usage: rollout-engine run -- PROGRAM [ARGS...]")
    site_dir = _site_dir()
    lib = preload_library(site_dir)
    major = int(lib.name.split("_cu")[1].split(".")[0])
    os.execvpe(argv[0], argv, preload_env(dict(os.environ), lib, site_dir, major))
    return 0  # not reached
