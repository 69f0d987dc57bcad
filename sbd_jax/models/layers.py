"""Shared layers of Llama-3.x and Qwen3 as pure functions: the three ops that read weights (`project`, `embed_rows`,
`head_logits`: a plain array, qwix's QArray or a `Weight` that reads itself), RMSNorm, RoPE (with llama3 scaling),
SwiGLU."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .params import Weight
from .quant import QArray, quantized_product


def project(spec: str, x, w):
    """`jnp.einsum(spec, x, w)` (spec: activations first, weight second); a `Weight` multiplies itself (int4 groups,
    LoRA, GPTQ's watched weight) and an int8 / fp8 QArray goes through qwix in its quantized form (quant.py)."""
    if isinstance(w, Weight):
        return w.product(spec, x)
    if isinstance(w, QArray):
        return quantized_product(spec, x, w)
    return jnp.einsum(spec, x, w)


def embed_rows(w, tokens_BT):
    """Embedding lookup [B, T, D]; a `Weight` (the mask token's patched row: lora.py) reads its own."""
    return w.embed(tokens_BT) if isinstance(w, Weight) else w[tokens_BT]


def head_logits(spec: str, h_BTD, w, dtype):
    """Logits [B, T, V] in `dtype` (spec "btd,vd->btv" for a tied head, "btd,dv->btv" for lm_head)."""
    if isinstance(w, Weight):
        return w.logits(spec, h_BTD, dtype)
    return jnp.einsum(spec, h_BTD, w, preferred_element_type=dtype)


def rms_norm(x, weight, eps):
    """HF RMSNorm: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * x32.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] (float64 numpy: computed once, exactly as HF does)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply_rope(x_BTHD, positions_BT, inv_freq):
    """Rotate-half RoPE (HF convention). Angles in float32."""
    angles = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x_BTHD.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTHD.dtype)


def swiglu(x_BTD, w_gate_DF, w_up_DF, w_down_FD):
    """The MLP; each weight may carry a LoRA adapter (`project`)."""
    gate, up = (project("btd,df->btf", x_BTD, w) for w in (w_gate_DF, w_up_DF))
    return project("btf,fd->btd", jax.nn.silu(gate) * up, w_down_FD)
