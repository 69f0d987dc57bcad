"""Qwen3: Llama plus per-head RMSNorm on q and k (`qk_norm`). HF config.json <-> ModelConfig."""
from __future__ import annotations

from ..config import ConfigError, ModelConfig
from . import llama

KNOWN_KEYS = llama.KNOWN_KEYS | {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}


def config_from_hf(d: dict, *, allow_unknown_keys: bool = False, **overrides) -> ModelConfig:
    llama.check_keys(d, KNOWN_KEYS, allow_unknown_keys=allow_unknown_keys)
    if d.get("use_sliding_window"):
        raise ConfigError("Qwen3 with use_sliding_window=true is not supported")
    layer_types = d.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ConfigError(f"Qwen3 layer_types other than full_attention are not supported: {set(layer_types)}")
    fields = llama.common_fields(d)
    if fields["head_dim"] is None:
        fields["head_dim"] = 128  # Qwen3Config default
    return ModelConfig(model_type="qwen3", qk_norm=True, **{**fields, **overrides})


def config_to_hf(cfg: ModelConfig) -> dict:
    d = llama.config_to_hf(cfg)
    d.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_hidden_layers)
    return d
