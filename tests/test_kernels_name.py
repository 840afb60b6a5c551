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
    res = _run("import kernels; print(getattr(kernels, '__file__', None))")
    assert res.returncode == 0, res.stderr
    assert not res.stdout.strip().startswith(os.path.join(ROOT, "kernels")), res.stdout
    hub = any(importlib.util.find_spec("kernels", [p]) for p in sys.path if p and os.path.abspath(p) != ROOT)
    if not hub:  # nothing else by that name: the empty stand-in (below)
        assert res.stdout.strip() == "None", res.stdout


def test_the_engines_kernels_import_under_their_own_name_from_the_root():
    res = _run("import rollout_engine.kernels.attention as a, kernels; print(a.__name__)")
    assert res.returncode == 0 and "rollout_engine.kernels.attention" in res.stdout, res.stderr


# Without the Hugging Face package, transformers' availability check finds the
# folder with `find_spec`, then imports the name unguarded: the import must
# succeed and look absent (no file, no version), as an empty namespace would.
# HIDE_HUB makes the package and its metadata unfindable in the subprocess.
HIDE_HUB = """
import importlib.machinery, importlib.metadata, os
_find = importlib.machinery.PathFinder.find_spec.__func__
def _hidden(cls, name, path=None, target=None):
    if name == "kernels":
        path = [p for p in (path or __import__("sys").path) if os.path.abspath(p or os.getcwd()) == os.getcwd()]
    return _find(cls, name, path, target)
importlib.machinery.PathFinder.find_spec = classmethod(_hidden)
_version = importlib.metadata.version
def _no_hub(name):
    if name == "kernels":
        raise importlib.metadata.PackageNotFoundError(name)
    return _version(name)
importlib.metadata.version = _no_hub
"""


def test_without_the_hub_package_kernels_imports_as_an_empty_stand_in():
    res = _run(HIDE_HUB + "import importlib.util; m = importlib.import_module('kernels'); "
               "print(getattr(m, '__file__', None), getattr(m, '__version__', 'N/A'), "
               "[n for n in vars(m) if not n.startswith('__')], importlib.util.find_spec('kernels') is not None)")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["None", "N/A", "[]", "True"], res.stdout


def test_without_the_hub_package_transformers_reads_kernels_as_absent():
    res = _run(HIDE_HUB + "from transformers.utils import import_utils as u; "
               "print(u.is_kernels_available()); import transformers; transformers.LlamaConfig(); print('ok')")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "ok"], res.stdout
