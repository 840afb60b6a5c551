"""RolloutPool: many engines behind one API, each in a Ray actor.

One module per concern: `pool` (the public API; RL controls fanned out to
every replica), `placement` (the actors and their placement groups),
`batching` (a call's prompts, checked and cut into units), `routing` (which
replica runs which unit), `generate` and `streams` (a call's units run and
their outputs collected), `calls` (waiting on replicas, with deadlines),
`recovery` (bringing a restarted replica back) and `replica` (the engine
inside an actor).

Ray itself is imported on first use, not by importing this package: inside
these modules `import ray` is the Ray library (imports are absolute).
"""
from __future__ import annotations

from rollout_engine.integrations.ray.calls import PoolCall
from rollout_engine.integrations.ray.pool import RolloutPool

__all__ = ["PoolCall", "RolloutPool"]
