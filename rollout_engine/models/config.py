"""Architecture description read from a Hugging Face config: everything the
model code and KV cache need, nothing else."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# HF architecture name -> the options our one decoder implementation needs.
ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
}


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    scaling_type: str = "default"  # "default" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @staticmethod
    def from_hf(hf_config: Any, eos_token_ids: tuple[int, ...] = ()) -> "ModelConfig":
        archs = getattr(hf_config, "architectures", None) or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"model architecture {archs!r} is not supported; supported: {sorted(ARCHITECTURES)}"
            )
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        eos = eos_token_ids or _as_tuple(getattr(hf_config, "eos_token_id", None))
        return ModelConfig(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position=hf_config.max_position_embeddings,
            rope=_rope_config(hf_config),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            **ARCHITECTURES[arch],
            eos_token_ids=eos,
        )


def _as_tuple(x: Any) -> tuple[int, ...]:
    if x is None:
        return ()
    if isinstance(x, int):
        return (x,)
    return tuple(int(v) for v in x)


def _rope_config(hf_config: Any) -> RopeConfig:
    # transformers 5 keeps everything in `rope_parameters`; 4.x has
    # `rope_theta` plus an optional `rope_scaling` dict.
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "llama3"):
        raise ValueError(f"rope scaling type {kind!r} is not supported (default, llama3)")
    if kind == "default":
        return RopeConfig(theta=float(theta))
    return RopeConfig(
        theta=float(theta),
        scaling_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )
