"""From the source tree's root, `kernels/` sits on sys.path as the top-level
`kernels`, the name of the Hugging Face kernels package that recent
transformers imports when it loads a model: the folder must hand that import
on, never answer it itself (an HF model load from the root failed with
"cannot import name 'CUDAProperties' from 'kernels'")."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_top_level_kernels_is_never_the_engines_folder():
    res = _run("import os, kernels; print(os.path.abspath(kernels.__file__))")
    hub = any(importlib.util.find_spec("kernels", [p]) for p in sys.path if p and os.path.abspath(p) != ROOT)
    if hub:  # the Hugging Face package, from site-packages
        assert res.returncode == 0, res.stderr
        assert not res.stdout.strip().startswith(os.path.join(ROOT, "kernels")), res.stdout
    else:  # nothing else by that name: the import fails as it would without the folder
        assert res.returncode != 0 and "No module named 'kernels'" in res.stderr, res.stderr


def test_the_engines_kernels_import_under_their_own_name_from_the_root():
    res = _run("import rollout_engine.kernels.attention as a, kernels; print(a.__name__)")
    assert "rollout_engine.kernels.attention" in res.stdout or "No module named 'kernels'" in res.stderr, res.stderr
