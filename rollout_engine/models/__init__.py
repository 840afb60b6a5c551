from rollout_engine.models.config import ARCHITECTURES, ModelConfig
from rollout_engine.models.decoder import DecoderForCausalLM

__all__ = ["ARCHITECTURES", "ModelConfig", "DecoderForCausalLM"]
