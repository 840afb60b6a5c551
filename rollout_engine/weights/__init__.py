from rollout_engine.weights.loader import WeightLoader, iter_safetensors

__all__ = ["WeightLoader", "iter_safetensors"]
