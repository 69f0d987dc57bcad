"""Model shapes the benchmarks share: the HF config.json values of real checkpoints (`SHAPES`), and one
command-line recipe for a random-weight model (a named shape, or hidden/layers/heads/vocab flags)."""
from __future__ import annotations

import argparse
import dataclasses

from sbd_jax.models.config import ModelConfig, RopeScaling

_LLAMA31 = dict(model_type="llama", vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
                rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), num_key_value_heads=8, mask_token_id=128002)
SHAPES = {  # the HF config.json values of each checkpoint
    "llama3-8b": ModelConfig(**_LLAMA31, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32),
    "qwen3-8b": ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                            rope_theta=1000000.0, max_position_embeddings=40960, qk_norm=True, rms_norm_eps=1e-6,
                            mask_token_id=151662),
    "llama3-70b": ModelConfig(**_LLAMA31, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                              num_attention_heads=64),
    "llama3.2-1b": ModelConfig(**_LLAMA31, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, tie_word_embeddings=True),
    # no free id for <m>: a run grows the vocabulary by one row (model.add_mask_token, training/model_source.py)
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                                max_position_embeddings=8192, tie_word_embeddings=True),
}


def add_model_args(ap: argparse.ArgumentParser, *, hidden=512, layers=4, heads=8, kv_heads=4, vocab=8192,
                   dtype="float32", attention="xla") -> None:
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="a real checkpoint's shape (overrides hidden/layers/heads/vocab/intermediate)")
    ap.add_argument("--hidden", type=int, default=hidden)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--heads", type=int, default=heads)
    ap.add_argument("--kv-heads", type=int, default=kv_heads)
    ap.add_argument("--vocab", type=int, default=vocab)
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default hidden * 8/3, rounded)")
    ap.add_argument("--dtype", default=dtype, help="parameter and compute dtype")
    ap.add_argument("--attention", default=attention, choices=["xla", "pallas", "auto"], help="attention_impl")
    ap.add_argument("--unroll", type=int, default=1, help="layers per scan iteration (ModelConfig.scan_unroll)")


def model_config(a, max_len: int) -> ModelConfig:
    """The ModelConfig the flags describe, with room for `max_len` positions."""
    common = dict(param_dtype=a.dtype, dtype=a.dtype, attention_impl=a.attention, scan_unroll=a.unroll)
    if a.shape:
        cfg = SHAPES[a.shape]
        return dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, max_len), **common)
    inter = a.intermediate or int(a.hidden * 8 / 3) // 8 * 8
    return ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=inter, num_hidden_layers=a.layers,
                       num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                       max_position_embeddings=max(2048, max_len), mask_token_id=a.vocab - 1, rope_theta=10000.0,
                       **common)


def describe(cfg: ModelConfig, n_params: int) -> str:
    return (f"{n_params / 1e6:.1f}M params (hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, heads "
            f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}, vocab {cfg.vocab_size}, {cfg.param_dtype}, "
            f"attention {cfg.attention_impl}, scan_unroll {cfg.scan_unroll})")
