"""Logits parity with HF transformers (PyTorch CPU, random init, no download) and HF round trips.
Tolerance: max abs logit error <= 1e-4 in float32."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sbd_jax
from sbd_jax.models import causal_meta

TOL = 1e-4
BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            rms_norm_eps=1e-6, max_position_embeddings=256)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}

CASES = {
    "llama_gqa_untied": ("llama", dict(BASE, num_key_value_heads=2, tie_word_embeddings=False)),
    "llama_mqa_tied": ("llama", dict(BASE, num_key_value_heads=1, tie_word_embeddings=True)),
    "llama3_scaling_gqa": ("llama", dict(BASE, num_key_value_heads=2, rope_theta=500000.0,
                                         rope_scaling=LLAMA3_SCALING)),
    "llama_bias_headdim": ("llama", dict(BASE, num_key_value_heads=2, head_dim=32, attention_bias=True)),
    "qwen3_tied_gqa": ("qwen3", dict(BASE, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
    "qwen3_untied_mqa": ("qwen3", dict(BASE, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)),
}


def _tokens(B, T, V, seed=0):
    return np.random.default_rng(seed).integers(0, V, size=(B, T)).astype(np.int32)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, hf_ref):
    arch, config = CASES[case]
    model_dir = hf_ref.make(arch, config, seed=1, std=0.1)
    cfg, params = sbd_jax.from_pretrained(model_dir)
    assert cfg.model_type == arch
    tokens = _tokens(2, 40, config["vocab_size"])  # positions up to 40 > original_max 16: llama3 scaling matters
    lengths = np.array([40, 27])
    ref = hf_ref.logits(model_dir, tokens, lengths)
    ours, _ = jax.jit(sbd_jax.forward, static_argnums=1)(params, cfg, tokens, causal_meta(jnp.asarray(lengths), 40))
    ours = np.asarray(ours)
    for b, n in enumerate(lengths):
        err = np.abs(ours[b, :n] - ref[b, :n]).max()
        assert err <= TOL, f"{case}: row {b} max abs err {err}"
    assert np.abs(ref).max() > 0.1  # logits are not trivially small


def test_llama3_scaling_changes_logits(hf_ref):
    """Guard against a parity test that would pass with scaling ignored."""
    _, config = CASES["llama3_scaling_gqa"]
    d = hf_ref.make("llama", config, seed=1, std=0.1)
    cfg, params = sbd_jax.from_pretrained(d)
    assert cfg.rope_scaling is not None
    tokens = _tokens(1, 40, config["vocab_size"])
    meta = causal_meta(jnp.array([40]), 40)
    a, _ = sbd_jax.forward(params, cfg, tokens, meta)
    b, _ = sbd_jax.forward(params, cfg.__class__(**{**cfg.__dict__, "rope_scaling": None}), tokens, meta)
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-3


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen3", True)])
def test_save_pretrained_loads_in_transformers(arch, tied, hf_ref, tmp_path):
    cfg = sbd_jax.ModelConfig(model_type=arch, qk_norm=arch == "qwen3", vocab_size=101, hidden_size=48,
                              intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                              num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied, mask_token_id=100,
                              rope_theta=10000.0, rms_norm_eps=1e-6)
    params = sbd_jax.init_params(cfg, jax.random.key(3), std=0.1)
    out = sbd_jax.save_pretrained(cfg, params, tmp_path / "m")
    saved = json.loads((out / "config.json").read_text())
    assert saved["mask_token_id"] == 100
    tokens = _tokens(2, 24, cfg.vocab_size, seed=5)
    ref = hf_ref.logits(out, tokens)
    ours, _ = sbd_jax.forward(params, cfg, tokens, causal_meta(jnp.array([24, 24]), 24))
    assert np.abs(np.asarray(ours) - ref).max() <= TOL
    # round trip: save -> load -> identical logits and identical config
    cfg2, params2 = sbd_jax.from_pretrained(out)
    assert cfg2 == cfg
    again, _ = sbd_jax.forward(params2, cfg2, tokens, causal_meta(jnp.array([24, 24]), 24))
    np.testing.assert_array_equal(np.asarray(again), np.asarray(ours))


def test_sharded_checkpoint_and_bf16(hf_ref):
    """A transformers-written sharded + indexed bf16 checkpoint loads; bf16 logits stay close to f32."""
    _, config = CASES["llama_gqa_untied"]
    d = hf_ref.make("llama", config, seed=2, std=0.1, dtype="bfloat16", max_shard_size="20KB")
    assert (d / "model.safetensors.index.json").exists()
    cfg, params = sbd_jax.from_pretrained(d, param_dtype="bfloat16", dtype="bfloat16")
    assert params["embed"].dtype == jnp.bfloat16
    cfg32, params32 = sbd_jax.from_pretrained(d)
    tokens = _tokens(1, 16, config["vocab_size"])
    meta = causal_meta(jnp.array([16]), 16)
    lo, _ = sbd_jax.forward(params, cfg, tokens, meta)
    hi, _ = sbd_jax.forward(params32, cfg32, tokens, meta)
    ref = hf_ref.logits(d, tokens)  # HF upcasts the bf16 weights to f32 like cfg32 does
    assert np.abs(np.asarray(hi) - ref).max() <= TOL
    assert np.abs(np.asarray(lo) - np.asarray(hi)).max() < 0.1 * np.abs(ref).max()


def test_sharded_save_round_trip(tmp_path):
    cfg = sbd_jax.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2)
    params = sbd_jax.init_params(cfg, jax.random.key(0))
    out = sbd_jax.save_pretrained(cfg, params, tmp_path / "m", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    cfg2, params2 = sbd_jax.from_pretrained(out)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params, params2)
