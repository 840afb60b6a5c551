"""rollout-engine: an LLM inference engine for reinforcement-learning rollouts."""
from rollout_engine.engine import RolloutEngine
from rollout_engine.outputs import RolloutOutput
from rollout_engine.sampling_params import SamplingParams

__all__ = ["RolloutEngine", "RolloutOutput", "SamplingParams"]
__version__ = "0.1.0"
