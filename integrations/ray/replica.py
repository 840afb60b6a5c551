"""One engine inside a Ray actor: the body of a RolloutPool replica.

A plain class; the pool wraps it with `ray.remote` (Ray is imported by the
pool only). The actor is threaded, so controls and observations reach the
engine while a `generate` runs. Every method returns plain data."""
from __future__ import annotations

import os
import uuid
from typing import Any, Iterator


class EngineReplica:
    def __init__(self, model: str, engine_kwargs: dict[str, Any]):
        from rollout_engine import RolloutEngine

        self.engine = RolloutEngine(model, **engine_kwargs)
        self.incarnation = uuid.uuid4().hex  # new after every restart by Ray

    def info(self) -> dict[str, Any]:
        return {"incarnation": self.incarnation, "pid": os.getpid(), "weight_version": self.engine.weight_version,
                "unfinished": self.engine.num_unfinished_requests()}

    def model_config(self):
        return self.engine.model_config

    def generate(self, prompts, input_ids, sampling_params, request_ids):
        return self.engine.generate(prompts=prompts, input_ids=input_ids, sampling_params=sampling_params,
                                    request_ids=request_ids)

    def stream(self, prompts, input_ids, sampling_params, request_ids) -> Iterator:
        yield from self.engine.stream(prompts=prompts, input_ids=input_ids, sampling_params=sampling_params,
                                      request_ids=request_ids)

    def call(self, method: str, *args, **kwargs):
        """An engine method by name (RL controls and observations)."""
        return getattr(self.engine, method)(*args, **kwargs)

    def update_weights(self, named_tensors, version: int) -> int:
        # The pool puts the tensors into the object store once; Ray hands
        # every replica the same object.
        return self.engine.update_weights(named_tensors, version=version)

    def export_weights(self) -> list:
        """Every weight by its Hugging Face name: how a restarted replica
        catches up with weights that came over a broadcast."""
        return [(name, self.engine.get_weight(name)) for name in self.engine.weight_names()]

    def shutdown(self) -> None:
        self.engine.shutdown()
