"""The engine's GPU kernels, installed as `rollout_engine.kernels`.

Run from the source tree's root (`python -m pytest`, `python -m ...`), this
folder also sits on `sys.path` under the top-level name `kernels`, which is
the Hugging Face kernels package's (a dependency of recent transformers,
which imports it by that name when it loads a model). Imported under that
name, this module hands the import on to that package, found on the rest of
`sys.path`, so the two never shadow each other; where there is none, it
stands in as an empty module that availability checks read as absent."""
if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _rest = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _rest)
    if _spec is None:
        # No such package: answer as an empty namespace package would (no
        # __file__, no __version__, nothing in it), which availability checks
        # read as absent. Raising instead breaks transformers, which imports
        # the name unguarded once `find_spec` has found this folder.
        import types

        _empty = types.ModuleType("kernels", "no Hugging Face kernels package is installed")
        _empty.__spec__ = importlib.machinery.ModuleSpec("kernels", None, is_package=True)
        _empty.__path__ = []
        sys.modules["kernels"] = _empty
    else:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # the import returns what sys.modules holds after this body
        _spec.loader.exec_module(_module)
