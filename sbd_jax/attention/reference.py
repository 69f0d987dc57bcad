"""Reference (XLA) attention with the SBD mask: the oracle every kernel is tested against."""
from __future__ import annotations

import jax.numpy as jnp

from .mask import TokenMeta, concat_meta, dense_mask


def reference_attention(q_BTHD, k_BSKD, v_BSKD, q_meta: TokenMeta, kv_meta: TokenMeta, *, scale=None):
    """Grouped-query attention under the SBD mask.

    q_BTHD: [B, T, H, D]; k/v_BSKD: [B, S, K, D] with H a multiple of K (GQA; K/V are not repeated).
    q_meta fields [B, T], kv_meta fields [B, S]. Softmax in float32. Rows with no visible key
    (padding queries) return zeros. Returns [B, T, H, D] in q's dtype.
    """
    B, T, H, D = q_BTHD.shape
    K = k_BSKD.shape[2]
    if H % K:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {K}")
    G = H // K
    scale = D ** -0.5 if scale is None else scale
    # a KV head's G query heads as one query axis Q = G*T (q = g*T + t): 4-D contractions, about twice as fast on
    # CPU as the 5-D grouped layout for a few query tokens (docs/verify_step_cost.md)
    q_BKQD = q_BTHD.reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, D)
    s_BKQS = jnp.einsum("bkqd,bskd->bkqs", q_BKQD, k_BSKD, preferred_element_type=jnp.float32) * scale
    mask_B1QS = jnp.tile(dense_mask(q_meta, kv_meta), (1, G, 1))[:, None]
    s_BKQS = jnp.where(mask_B1QS, s_BKQS, -jnp.inf)
    m = jnp.max(s_BKQS, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s_BKQS - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    o_BKQD = jnp.einsum("bkqs,bskd->bkqd", p.astype(v_BSKD.dtype), v_BSKD, preferred_element_type=jnp.float32)
    o_BTHD = o_BKQD.reshape(B, K, G, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)
    return o_BTHD.astype(q_BTHD.dtype)


def concat_parts(kv_parts):
    """(k, v, kv_meta) of K/V given in parts [(k, v, meta), ...] of one sequence, concatenated
    along time."""
    if len(kv_parts) == 1:
        return tuple(kv_parts[0])
    k = jnp.concatenate([p[0] for p in kv_parts], axis=1)
    v = jnp.concatenate([p[1] for p in kv_parts], axis=1)
    return k, v, concat_meta(*(p[2] for p in kv_parts), axis=1)
