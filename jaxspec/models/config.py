"""Model configuration shared by every Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # llama3-style rope scaling: (factor, low_freq_factor, high_freq_factor, original_max_position)
    rope_scaling: tuple | None = None
    tie_word_embeddings: bool = True
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    max_position: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple = ()
    # tensor-parallel layout of the fused matrices: [q_s k_s v_s] and [gate_s up_s] for each of
    # this many shards (sharding.py); 1: [q | k | v] and [gate | up]
    shard_groups: int = 1

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        arch = (cfg.get("architectures") or [""])[0]
        mt = cfg.get("model_type", "")
        known = arch.endswith(("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"))
        if mt not in ("llama", "qwen2", "qwen3", "mistral") and not known:
            raise ValueError(f"config.json: unsupported model_type {mt!r} / architecture {arch!r}; "
                             "jaxspec loads Llama, Qwen2 and Qwen3 families")
        try:
            n_heads = cfg["num_attention_heads"]
            hidden = cfg["hidden_size"]
            rs = cfg.get("rope_scaling") or (cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else None)
            scaling = None
            if rs and rs.get("rope_type", rs.get("type")) == "llama3":
                scaling = (float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"]),
                           int(rs["original_max_position_embeddings"]))
            theta = cfg.get("rope_theta") or (rs or {}).get("rope_theta") or 10000.0
            eos = cfg.get("eos_token_id")
            eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            return cls(
                vocab_size=cfg["vocab_size"], hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
                num_heads=n_heads, num_kv_heads=cfg.get("num_key_value_heads", n_heads),
                head_dim=cfg.get("head_dim") or hidden // n_heads,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
                tie_word_embeddings=cfg.get("tie_word_embeddings", mt != "llama"),
                qkv_bias=mt == "qwen2" or cfg.get("attention_bias", False), qk_norm=mt == "qwen3",
                max_position=cfg.get("max_position_embeddings", 8192),
                bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos)
        except KeyError as e:
            raise ValueError(f"config.json: missing required field {e.args[0]!r}") from None
