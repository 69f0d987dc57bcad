"""In-kernel helpers shared by the kernels. They stick to what the Triton lowering supports: 2-D
dots without batch dims (`lax.dot_general` with f32 accumulation), elementwise ops, row
reductions, and ref reads with static or `pl.ds` slices.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from ..mask import sbd_mask

# Finite "minus infinity" for running maxima / log-sum-exp of rows that see nothing
# (keeps exp(m_old - m_new) and the split merge free of inf - inf).
NEG = -0.7 * float(np.finfo(np.float32).max)


def meta_tile(meta_ref, start, size):
    """(segment, position, stream, block) int32 [size] from a packed [4, T] metadata ref."""
    return tuple(meta_ref[f, pl.ds(start, size)] for f in range(4))


def meta_all(meta_ref):
    """(segment, position, stream, block) from a packed [4, T] metadata block."""
    return tuple(meta_ref[f, :] for f in range(4))


def tile_mask(q_fields, k_fields):
    """bool [bq, bk] from query fields [bq] and key fields [bk]: THE mask, `sbd_mask`."""
    return sbd_mask(*(f[:, None] for f in q_fields), *(f[None, :] for f in k_fields))


# Full-precision dots: with the default precision the Triton lowering multiplies float32 tiles in
# TF32 (10-bit mantissa), which misses the tests' float32 tolerance; HIGHEST selects IEEE float32
# for float32 tiles and changes nothing for bfloat16 ones. On TPU the default float32 dot is
# reduced precision too.
_PREC = lax.Precision.HIGHEST


def dot_nt(a, b):
    """a [m, d] . b[n, d]^T -> f32 [m, n]."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_PREC, preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """a [m, n] . b [n, d] -> f32 [m, d]."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_PREC, preferred_element_type=jnp.float32)


def dot_tn(a, b):
    """a[n, m]^T . b [n, d] -> f32 [m, d]."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_PREC, preferred_element_type=jnp.float32)


def softmax_init(rows: int, head_dim: int):
    return (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def online_softmax_step(q, k, v, mask, scale, carry):
    """One flash-attention update of (acc [R, D], running max m [R], running sum l [R])."""
    acc, m, l = carry
    s = jnp.where(mask, dot_nt(q, k) * scale, NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    l = alpha * l + jnp.sum(p, axis=1)
    acc = alpha[:, None] * acc + dot_nn(p.astype(v.dtype), v)
    return acc, m_new, l


def softmax_finish(acc, m, l):
    """Normalised output (0 for rows that saw nothing) and log-sum-exp (NEG for those rows)."""
    seen = l > 0.0
    l_safe = jnp.where(seen, l, 1.0)
    return acc / l_safe[:, None], jnp.where(seen, m + jnp.log(l_safe), NEG)


def split_range(count, split, num_splits):
    """[lo, hi) of a list of `count` tiles handled by `split` (flash-decoding: even shares)."""
    per = lax.div(count + (num_splits - 1), num_splits)
    lo = jnp.minimum(split * per, count)
    return lo, jnp.minimum(lo + per, count)


def probs(q, k, lse, mask, scale):
    """Recomputed attention probabilities p [bq, bk] (f32) for the backward pass."""
    s = dot_nt(q, k) * scale
    return jnp.exp(jnp.where(mask, s - lse[:, None], NEG))  # exp(NEG) == 0 exactly
