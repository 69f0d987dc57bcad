"""Which (query tile, key tile) pairs the SBD mask can reach, and tile lists for the kernels.

The tile table is EXACT and uses THE mask definition: tile pair (i, j) is visible iff
`sbd_mask` is true for at least one (query in tile i, key in tile j). It is computed in XLA from
the int32 metadata only (never from activations), in chunks of query tiles so its working memory
is bounded by `budget` mask elements (no O(T^2) buffer for long sequences). Its cost is
O(Tq * Tk) integer compares, about 1 / (4 * head_dim * heads) of the attention FLOPs, and it is
shared by the forward and backward kernels of all heads.

The kernels never index the table directly; they read compact lists:
`table[..., 0]` = number of visible tiles, `table[..., 1 : 1 + count]` = their indices
(ascending). The last dim is padded to a power of two (Triton block shapes must be); the TPU
kernels take the lists unpadded and flattened to 1-D (`flat_tile_lists`), scalar-prefetched into
SMEM.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..mask import TokenMeta, sbd_mask
from .options import next_pow2


def pad_meta(meta: TokenMeta, length: int) -> TokenMeta:
    """Right-pad every field of [B, T] metadata to `length` with padding tokens (segment 0)."""
    T = meta.segment.shape[-1]
    if length == T:
        return meta
    pad = [(0, 0)] * (meta.segment.ndim - 1) + [(0, length - T)]
    return TokenMeta(*(jnp.pad(jnp.asarray(f, jnp.int32), pad) for f in meta))


def pack_meta(meta: TokenMeta):
    """[B, T] fields -> one int32 [B, 4, T] array (segment, position, stream, block)."""
    return jnp.stack([jnp.asarray(f, jnp.int32) for f in meta], axis=1)


def tile_visibility(q_meta: TokenMeta, kv_meta: TokenMeta, block_q: int, block_k: int,
                    *, budget: int = 1 << 24):
    """bool [B, nq, nk]: may any query of q tile i see any key of kv tile j?

    q_meta [B, Tq], kv_meta [B, Tk]; tiles are [i*block_q, (i+1)*block_q) (the tails are padding,
    segment 0, never visible). Processes `chunk` query tiles at a time so that at most about
    `budget` mask elements exist at once.
    """
    B, Tq = q_meta.segment.shape
    Tk = kv_meta.segment.shape[-1]
    nq, nk = -(-Tq // block_q), -(-Tk // block_k)
    kvm = pad_meta(kv_meta, nk * block_k)
    k_fields = [f.reshape(B, 1, 1, nk, block_k) for f in kvm]  # [B, c, bq, nk, bk] broadcast

    per_tile = B * block_q * nk * block_k
    chunk = max(1, min(nq, budget // max(per_tile, 1)))
    n_chunks = -(-nq // chunk)
    qm = pad_meta(q_meta, n_chunks * chunk * block_q)
    q_fields = [f.reshape(B, n_chunks, chunk, block_q, 1, 1) for f in qm]

    def one_chunk(c):
        qf = [jax.lax.dynamic_index_in_dim(f, c, axis=1, keepdims=False) for f in q_fields]
        m = sbd_mask(*qf, *k_fields)  # [B, chunk, bq, nk, bk]
        return jnp.any(m, axis=(2, 4))  # [B, chunk, nk]

    if n_chunks == 1:
        vis = one_chunk(0)
    else:
        vis = jax.lax.map(one_chunk, jnp.arange(n_chunks))  # [n_chunks, B, chunk, nk]
        vis = jnp.moveaxis(vis, 0, 1).reshape(B, n_chunks * chunk, nk)
    return vis[:, :nq]


def compact_tiles(vis, *, pow2: bool = True):
    """bool [..., C] -> int32 [..., P] with P = next_pow2(C + 1) (or C + 1 if not `pow2`):
    entry 0 = count of visible tiles, entries 1..count = their indices ascending, the rest 0."""
    C = vis.shape[-1]
    order = jnp.argsort(jnp.logical_not(vis), axis=-1, stable=True).astype(jnp.int32)
    cnt = jnp.sum(vis, axis=-1, dtype=jnp.int32)[..., None]
    P = next_pow2(C + 1) if pow2 else C + 1
    pad = [(0, 0)] * (vis.ndim - 1) + [(0, P - C - 1)]
    return jnp.pad(jnp.concatenate([cnt, order], axis=-1), pad)


def tile_lists(q_meta: TokenMeta, kv_meta: TokenMeta, block_q: int, block_k: int, *,
               by_q: bool = True, by_k: bool = False, budget: int = 1 << 24):
    """Compact lists from the exact table: `by_q` -> [B, nq, P] key tiles per query tile
    (forward, dq); `by_k` -> [B, nk, P'] query tiles per key tile (dk/dv)."""
    vis = tile_visibility(q_meta, kv_meta, block_q, block_k, budget=budget)
    out = []
    if by_q:
        out.append(compact_tiles(vis))
    if by_k:
        out.append(compact_tiles(jnp.swapaxes(vis, 1, 2)))
    return out[0] if len(out) == 1 else tuple(out)


def flat_tile_lists(vis):
    """bool [B, n, C] -> (int32 [B * n * (C + 1)], C + 1): the compact lists of `compact_tiles`
    (unpadded) flattened for SMEM; list (b, i) starts at (b * n + i) * (C + 1)."""
    lists = compact_tiles(vis, pow2=False)
    return lists.reshape(-1), lists.shape[-1]


def visible_fraction(vis) -> float:
    """Fraction of tile pairs computed (for benchmarks / reports)."""
    return float(jnp.mean(vis.astype(jnp.float32)))


__all__ = ["compact_tiles", "flat_tile_lists", "pack_meta", "pad_meta", "tile_lists", "tile_visibility",
           "visible_fraction"]
