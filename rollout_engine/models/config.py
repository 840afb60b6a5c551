"""Architecture description read from a Hugging Face config: everything the
model code and KV cache need, nothing else."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# HF architecture name -> the options our one decoder implementation needs.
# qk_norm: "head" (RMSNorm of each head of q and k) or "whole" (of the whole
# q and k projections, OLMoE); moe: sparse MLP layers (MoeConfig).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": None, "moe": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": None, "moe": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": None, "moe": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": "head", "moe": False},
    "Qwen2MoeForCausalLM": {"qkv_bias": True, "qk_norm": None, "moe": True},
    "Qwen3MoeForCausalLM": {"qkv_bias": False, "qk_norm": "head", "moe": True},
    "MixtralForCausalLM": {"qkv_bias": False, "qk_norm": None, "moe": True},
    "OlmoeForCausalLM": {"qkv_bias": False, "qk_norm": "whole", "moe": True},
}
# Architectures whose names are close to a supported one but whose attention
# or routing differs (refused by name rather than served wrongly).
REFUSED = {
    "DeepseekV2ForCausalLM": "multi-head latent attention and grouped routing",
    "DeepseekV3ForCausalLM": "multi-head latent attention and grouped routing",
    "Qwen3NextForCausalLM": "linear attention layers",
}


@dataclass(frozen=True)
class MoeConfig:
    """The sparse MLP of an MoE model: softmax over `num_experts` router
    logits, the `top_k` largest kept (divided by their sum when
    `renormalize`), each selected expert a SiLU-gated MLP of width
    `intermediate_size`. Qwen2-MoE adds a shared expert on every token,
    scaled by sigmoid(its gate)."""
    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[int, ...]  # the layers with a sparse MLP; the others are dense
    shared_expert_intermediate_size: int = 0  # 0: none

    def is_sparse(self, layer_id: int) -> bool:
        return layer_id in self.sparse_layers


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
    qk_norm: bool  # per head (Qwen3)
    eos_token_ids: tuple[int, ...] = ()
    qk_norm_whole: bool = False  # over the whole q and k projections (OLMoE)
    moe: MoeConfig | None = None
    # A sliding-window model's context is cut to the window, where sliding
    # and full attention are the same (every backend serves it exactly).
    sliding_window: int | None = None

    @property
    def context_is_window(self) -> bool:
        """The context was cut to the sliding window."""
        return self.sliding_window is not None and self.sliding_window <= self.max_position

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
            why = next((f"; {a} has {REFUSED[a]}, which this engine does not implement" for a in archs
                        if a in REFUSED), "")
            raise ValueError(
                f"model architecture {archs!r} is not supported{why}; supported: {sorted(ARCHITECTURES)}"
            )
        options = ARCHITECTURES[arch]
        _check_served_exactly(hf_config, arch)
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        eos = eos_token_ids or _as_tuple(getattr(hf_config, "eos_token_id", None))
        window = _sliding_window(hf_config)
        max_position = hf_config.max_position_embeddings
        return ModelConfig(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            # Mixtral's experts are `intermediate_size` wide; no dense MLP
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position=max_position if window is None else min(max_position, window),
            rope=_rope_config(hf_config),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=options["qkv_bias"],
            qk_norm=options["qk_norm"] == "head",
            qk_norm_whole=options["qk_norm"] == "whole",
            moe=_moe_config(hf_config, arch) if options["moe"] else None,
            sliding_window=window,
            eos_token_ids=eos,
        )


def _check_served_exactly(hf_config: Any, arch: str) -> None:
    """Refuse, naming the field, a config option the decoder does not implement."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{arch}: hidden_act {act!r} is not supported (silu)")
    if getattr(hf_config, "clip_qkv", None) is not None:
        raise ValueError(f"{arch}: clip_qkv={hf_config.clip_qkv} is not supported (None)")
    if getattr(hf_config, "attention_bias", False) and arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        raise ValueError(f"{arch}: attention_bias=True is not supported")


def _sliding_window(hf_config: Any) -> int | None:
    window = getattr(hf_config, "sliding_window", None)
    if not window or not getattr(hf_config, "use_sliding_window", True):
        return None  # Qwen2/Qwen3 keep a `sliding_window` they do not use
    return int(window)


def _moe_config(hf_config: Any, arch: str) -> MoeConfig:
    def field(*names: str, default: Any = None) -> Any:
        for name in names:
            value = getattr(hf_config, name, None)
            if value is not None:
                return value
        if default is None:
            raise ValueError(f"{arch}: the config has no {names[0]}")
        return default

    experts = int(field("num_experts", "num_local_experts"))
    top_k = int(field("num_experts_per_tok"))
    if experts < 1:
        raise ValueError(f"{arch}: num_experts={experts} must be at least 1")
    if not 1 <= top_k <= experts:
        raise ValueError(f"{arch}: num_experts_per_tok={top_k} must be between 1 and num_experts ({experts})")
    layers = hf_config.num_hidden_layers
    if arch == "MixtralForCausalLM":  # every layer sparse, top-k always renormalized, experts `intermediate_size` wide
        width, renormalize, sparse = hf_config.intermediate_size, True, tuple(range(layers))
    else:
        width = int(field("moe_intermediate_size", "intermediate_size"))
        renormalize = bool(getattr(hf_config, "norm_topk_prob", False))
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=int(width), renormalize=renormalize,
                     sparse_layers=sparse, shared_expert_intermediate_size=shared)


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
