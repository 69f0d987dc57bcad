"""Which (query tile, key tile) pairs the SBD mask can reach, as tile lists for the kernels, and the
padding of sequences to whole tiles.

The tile table is EXACT: tile pair (i, j) is visible iff `sbd_mask` holds for some (query in tile
i, key in tile j). It is computed in XLA from the metadata, in chunks of query tiles (no O(T^2)
buffer), at about 1 / (4 * head_dim * heads) of the attention FLOPs. The kernels read compact
lists (`compact_tiles`): padded to a power of two for Triton-style kernels (Triton block shapes
must be), unpadded and flattened to 1-D for the TPU kernels' SMEM (`flat_tile_lists`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..mask import TokenMeta, sbd_mask
from .options import next_pow2


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pad_time(x, length: int, axis: int = 1):
    """Right-pad `axis` of x with zeros to `length`."""
    T = x.shape[axis]
    if T == length:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, length - T)
    return jnp.pad(x, pad)


def pad_meta(meta: TokenMeta, length: int) -> TokenMeta:
    """Right-pad every field of [B, T] metadata to `length` with padding tokens (segment 0)."""
    return TokenMeta(*(pad_time(jnp.asarray(f, jnp.int32), length, axis=-1) for f in meta))


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

    chunk = max(1, min(nq, budget // max(B * block_q * nk * block_k, 1)))
    n_chunks = -(-nq // chunk)
    qm = pad_meta(q_meta, n_chunks * chunk * block_q)
    q_fields = [f.reshape(B, n_chunks, chunk, block_q, 1, 1) for f in qm]

    def one_chunk(c):
        qf = [jax.lax.dynamic_index_in_dim(f, c, axis=1, keepdims=False) for f in q_fields]
        return jnp.any(sbd_mask(*qf, *k_fields), axis=(2, 4))  # [B, chunk, nk]

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
    return pad_time(jnp.concatenate([cnt, order], axis=-1), P, axis=-1)


def flat_tile_lists(vis):
    """bool [B, n, C] -> (int32 [B * n * (C + 1)], C + 1): the compact lists of `compact_tiles`
    (unpadded) flattened for SMEM; list (b, i) starts at (b * n + i) * (C + 1)."""
    lists = compact_tiles(vis, pow2=False)
    return lists.reshape(-1), lists.shape[-1]
