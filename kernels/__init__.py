"""The engine's GPU kernels, installed as `rollout_engine.kernels`.

Run from the source tree's root (`python -m pytest`, `python -m ...`), this
folder also sits on `sys.path` under the top-level name `kernels`, which is
the Hugging Face kernels package's (a dependency of recent transformers,
which imports it by that name when it loads a model). Imported under that
name, this module hands the import on to that package, found on the rest of
`sys.path`, so the two never shadow each other."""
if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _rest = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _rest)
    if _spec is None:
        raise ImportError("No module named 'kernels' (outside the rollout-engine source tree, whose kernels/ "
                          "folder is rollout_engine.kernels)", name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # the import returns what sys.modules holds after this body
    _spec.loader.exec_module(_module)
