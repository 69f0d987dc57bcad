"""THE definition of the SBD attention mask. Every caller (training, decoding, the reference
attention, the Pallas kernels) builds its mask with `sbd_mask` from per-token metadata.

Per-token metadata (`TokenMeta`, all int32 arrays of the same leading shape):
  segment   0 = padding (never attends, never attended); >0 = document id (no cross-document attention)
  position  position id inside its document (also the RoPE position)
  stream    0 = clean (ordinary causal NTP stream), 1 = copy (the masked `x_hat` / MATP stream)
  block     block start: the position at which this token's SBD block begins. Only read for copy
            tokens (queries and keys). Carrying block *starts* instead of deriving `pos // k` lets
            inference open blocks right after a prompt (docs/sbd.md, Inference step 8) and lets SFT
            align blocks to the response start.

Rule for query q and key j (same segment, neither padding):
  clean q -> clean j with pos_j <= pos_q                         (ordinary causal; never the copy)
  copy  q -> clean j with pos_j <  block_q                        (strictly earlier blocks)
          or copy j with block_j == block_q                       (bidirectional inside the block)
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

CLEAN = 0
COPY = 1


class TokenMeta(NamedTuple):
    segment: jnp.ndarray
    position: jnp.ndarray
    stream: jnp.ndarray
    block: jnp.ndarray

    def take(self, idx) -> "TokenMeta":
        """Index every field at once, e.g. `meta.take((slice(None), slice(a, b)))`."""
        return TokenMeta(*(f[idx] for f in self))


def sbd_mask(q_segment, q_position, q_stream, q_block, k_segment, k_position, k_stream, k_block):
    """Elementwise, broadcasting SBD mask. Pass query fields shaped [..., Tq, 1] and key fields
    shaped [..., 1, Tk] (or any broadcast-compatible shapes, e.g. tiles inside a kernel);
    returns bool with the broadcast shape, True = may attend."""
    same_doc = (q_segment == k_segment) & (q_segment > 0) & (k_segment > 0)
    q_copy = q_stream == COPY
    k_copy = k_stream == COPY
    clean_rule = (~q_copy) & (~k_copy) & (k_position <= q_position)
    copy_rule = q_copy & (((~k_copy) & (k_position < q_block)) | (k_copy & (k_block == q_block)))
    return same_doc & (clean_rule | copy_rule)


def dense_mask(q: TokenMeta, k: TokenMeta):
    """[B, Tq] x [B, Tk] metadata -> bool [B, Tq, Tk]."""
    return sbd_mask(*(f[..., :, None] for f in q), *(f[..., None, :] for f in k))


# ----------------------------------------------------------------------------------------------
# metadata builders (the only places that lay out streams, positions and blocks)


def clean_meta(segment, position) -> TokenMeta:
    """Ordinary causal tokens."""
    segment = jnp.asarray(segment, jnp.int32)
    position = jnp.asarray(position, jnp.int32)
    return TokenMeta(segment, position, jnp.zeros_like(segment), position)


def copy_meta(segment, position, block) -> TokenMeta:
    segment = jnp.asarray(segment, jnp.int32)
    return TokenMeta(segment, jnp.asarray(position, jnp.int32), jnp.ones_like(segment),
                     jnp.asarray(block, jnp.int32))


def concat_meta(*metas: TokenMeta, axis: int = -1) -> TokenMeta:
    return TokenMeta(*(jnp.concatenate(fs, axis=axis) for fs in zip(*metas)))


def block_starts(position, block_size, offset=0):
    """Block start of each position when blocks of `block_size` begin at `offset` (training: 0,
    or the response start for SFT alignment). Positions before `offset` get block `offset`
    (they are never copy tokens in that layout)."""
    position = jnp.asarray(position, jnp.int32)
    offset = jnp.asarray(offset, jnp.int32)
    rel = jnp.maximum(position - offset, 0)
    return offset + (rel // block_size) * block_size
