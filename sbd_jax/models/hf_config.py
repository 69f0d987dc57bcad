"""HF `config.json` <-> ModelConfig for Llama-3.x and Qwen3 (Llama plus per-head RMSNorm on q and k,
`qk_norm`). The math of both lives in transformer.py."""
from __future__ import annotations

from ..config import ConfigError
from .config import ModelConfig, RopeScaling

# keys of a HF config.json (transformers 4.x and 5.x) that we read or that cannot change the math
_LLAMA_KEYS = frozenset("""
    architectures attention_bias attention_dropout bos_token_id eos_token_id pad_token_id head_dim hidden_act hidden_size
    initializer_range intermediate_size max_position_embeddings mlp_bias model_type num_attention_heads num_hidden_layers
    num_key_value_heads pretraining_tp rms_norm_eps rope_scaling rope_theta rope_parameters tie_word_embeddings torch_dtype
    dtype transformers_version use_cache vocab_size mask_token_id _name_or_path output_attentions output_hidden_states
    return_dict chunk_size_feed_forward is_encoder_decoder tokenizer_class id2label label2id problem_type
    add_cross_attention tie_encoder_decoder torchscript task_specific_params""".split())
KNOWN_KEYS = {"llama": _LLAMA_KEYS,
              "qwen3": _LLAMA_KEYS | {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _rope(d: dict) -> tuple[float, RopeScaling | None]:
    """Read RoPE settings from 4.x (`rope_theta` + `rope_scaling`) or 5.x (`rope_parameters`) keys."""
    params = d.get("rope_parameters")
    where = "rope_parameters" if params is not None else "rope_scaling"
    scaling = (d.get("rope_scaling") if params is None else params) or {}
    if not isinstance(scaling, dict):
        raise ConfigError(f"{where} must be a mapping, got {scaling!r}")
    theta = (params or {}).get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return _number("rope_theta", theta), None
    if rope_type != "llama3":
        raise ConfigError(f"rope type {rope_type!r} is not supported (supported: 'default', 'llama3')")

    def number(key: str, kind: type):
        v = scaling.get(key)
        if v is None:
            raise ConfigError(f"{where}.{key} is missing (required by rope type 'llama3')")
        if isinstance(v, bool) or not isinstance(v, int if kind is int else (int, float)):
            raise ConfigError(f"{where}.{key} must be {'an integer' if kind is int else 'a number'}, got {v!r}")
        return kind(v)

    return _number("rope_theta", theta), RopeScaling(
        factor=number("factor", float), low_freq_factor=number("low_freq_factor", float),
        high_freq_factor=number("high_freq_factor", float),
        original_max_position_embeddings=number("original_max_position_embeddings", int))


def _number(key: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{key} must be a number, got {v!r}")
    return float(v)


def config_from_hf(d: dict, *, allow_unknown_keys: bool = False, **overrides) -> ModelConfig:
    """A HF config.json of model_type "llama" or "qwen3" (see KNOWN_KEYS) -> ModelConfig (+ `overrides`)."""
    mt = d["model_type"]
    unknown = sorted(set(d) - KNOWN_KEYS[mt])
    if unknown and not allow_unknown_keys:
        raise ConfigError(
            f"config.json has key(s) sbd_jax does not know: {unknown}. They might change the model's "
            "math; if you are sure they do not, pass allow_unknown_keys=True.")
    if mt == "qwen3" and d.get("use_sliding_window"):
        raise ConfigError("Qwen3 with use_sliding_window=true is not supported")
    layer_types = d.get("layer_types")
    if mt == "qwen3" and layer_types and any(t != "full_attention" for t in layer_types):
        raise ConfigError(f"Qwen3 layer_types other than full_attention are not supported: {set(layer_types)}")
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
    if d.get("mlp_bias"):
        raise ConfigError("mlp_bias=true is not supported")
    if d.get("pretraining_tp", 1) != 1:
        raise ConfigError("pretraining_tp != 1 is not supported")
    theta, scaling = _rope(d)
    for req in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if req not in d:
            raise ConfigError(f"config.json lacks the required key {req!r}")
    head_dim = d.get("head_dim") or (128 if mt == "qwen3" else None)  # 128: the Qwen3Config default
    return ModelConfig(**{**dict(
        model_type=mt, qk_norm=mt == "qwen3",
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
        head_dim=head_dim, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_scaling=scaling, max_position_embeddings=d.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", False)), mask_token_id=d.get("mask_token_id"),
        bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
        pad_token_id=d.get("pad_token_id")), **overrides})


def config_to_hf(cfg: ModelConfig) -> dict:
    """HF config.json (4.x-style rope keys, which both transformers 4.x and 5.x read)."""
    d = {
        "architectures": [_ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0, "mlp_bias": False, "torch_dtype": cfg.param_dtype,
        "bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
        "eos_token_id": cfg.eos_token_id,  # a tuple of ids is written as a JSON list
        "mask_token_id": cfg.mask_token_id, "use_cache": True,
        "rope_scaling": None if cfg.rope_scaling is None else {**vars(cfg.rope_scaling), "rope_type": "llama3"},
    }
    if cfg.model_type == "qwen3":
        d.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_hidden_layers)
    return d
