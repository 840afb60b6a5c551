"""rollout-engine: an LLM inference engine for reinforcement-learning rollouts.

The public names are imported on first use, so that `import rollout_engine`
(and the `rollout-engine` command starting up) does not import torch before
it needs it."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["RolloutEngine", "RolloutOutput", "SamplingParams"]
__version__ = "0.1.0"

_HOMES = {"RolloutEngine": "rollout_engine.engine", "RolloutOutput": "rollout_engine.outputs",
          "SamplingParams": "rollout_engine.sampling_params"}

if TYPE_CHECKING:
    from rollout_engine.engine import RolloutEngine
    from rollout_engine.outputs import RolloutOutput
    from rollout_engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rollout_engine' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
