"""Layouts and in-kernel helpers shared by the Mosaic-TPU kernels (`tpu_train`, `tpu_decode`).

TPU rules these follow (as jax's splash attention does): the last two dims of every VMEM block are
multiples of (8, 128) or the array's dims; metadata on the sublane side of a score tile is
broadcast along 128 lanes ("rows" layout, [B, 4, T, 128]), on the lane side it is [B, 4, 8, T]
read as `ref[f, :1, :]` ("cols" layout); per-row statistics live in [rows, 128] f32 VMEM scratch.

Activations [B, T, N, D] reach the kernels as a `HeadsLayout`: for D % 128 == 0 the free reshape
[B, T, N * D], read in place (a strided DMA per tile; Llama/Qwen's D = 128); otherwise a
transposed copy [B, N, T, D].
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..mask import TokenMeta, sbd_mask
from .kernel_common import NEG, dot_nn, dot_nt, split_range
from .tiling import pack_meta, pad_meta, round_up

NUM_LANES = 128
NUM_SUBLANES = 8
SUBLANE_ALIGN = 16  # bf16 packs 16 rows per (8, 128) tile: pad short sequences to this


def plan_axis(length: int, *blocks: int, align: int = SUBLANE_ALIGN):
    """Padded length and the tiles actually used along an axis of `length` for the requested
    (power-of-two) `blocks`: a block shorter than the axis is used as is; a longer one becomes
    the whole padded axis (the full array dim: always TPU-legal), padded to `align` (128 for
    axes that land on lanes, so no tile is an unaligned lane width). The padded length is a
    multiple of every tile. -> (padded_length, (tile, ...))."""
    real = [b for b in blocks if length > b]
    padded = round_up(length, max(real)) if real else round_up(max(length, 1), align)
    return padded, tuple(min(b, padded) for b in blocks)


def listed_tile(tab, row, step, P, split=0, num_splits=1):
    """Tile read by grid step `step` of `split` (its share of list `row` of `flat_tile_lists`); steps
    past the share repeat its last tile, so the block index stays the same: no new DMA."""
    lo, hi = split_range(tab[row * P], split, num_splits)
    return tab[row * P + 1 + jnp.maximum(jnp.minimum(lo + step, hi - 1), 0)]


# ----------------------------------------------------------------------------------------------
# metadata layouts


def rows_meta(meta: TokenMeta, length: int):
    """[B, T] fields -> int32 [B, 4, length, 128] (padded with segment 0, broadcast along lanes):
    for the tokens that sit on the SUBLANE side of a score tile."""
    f = pack_meta(pad_meta(meta, length))  # [B, 4, L]
    return jnp.broadcast_to(f[..., None], f.shape + (NUM_LANES,))


def cols_meta(meta: TokenMeta, length: int):
    """[B, T] fields -> int32 [B, 4, 8, length] (padded with segment 0, broadcast along
    sublanes): for the tokens on the LANE side of a score tile."""
    f = pack_meta(pad_meta(meta, length))  # [B, 4, L]
    B, _, L = f.shape
    return jnp.broadcast_to(f[:, :, None, :], (B, 4, NUM_SUBLANES, L))


def lane_tile(x, n: int):
    """[r, 128] (lane-broadcast values) -> [r, n]."""
    if n <= NUM_LANES:
        return x[:, :n]
    reps = -(-n // NUM_LANES)
    y = jnp.tile(x, (1, reps))
    return y if reps * NUM_LANES == n else y[:, :n]


def row_fields(ref, n: int):
    """4 x int32 [r, n] from a rows-layout metadata block [4, r, 128]."""
    return tuple(lane_tile(ref[f], n) for f in range(4))


def col_fields(ref):
    """4 x int32 [1, n] from a cols-layout metadata block [4, 8, n]."""
    return tuple(ref[f, :1, :] for f in range(4))


def tile_mask_rows_q(qm_ref, km_ref, n: int):
    """bool [bq, n]: queries on sublanes (rows layout), keys on lanes (cols layout)."""
    return sbd_mask(*row_fields(qm_ref, n), *col_fields(km_ref))


def tile_mask_rows_k(qm_ref, km_ref, n: int):
    """bool [bk, n]: keys on sublanes (rows layout), queries on lanes (cols layout)."""
    return sbd_mask(*col_fields(qm_ref), *row_fields(km_ref, n))


# ----------------------------------------------------------------------------------------------
# flash-attention state in VMEM scratch: m, l [rows, 128] (lane-broadcast), acc [rows, D] f32


def softmax_init(m_sc, l_sc, acc_sc):
    m_sc[...] = jnp.full(m_sc.shape, NEG, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)


def online_softmax_step(q, k, v, mask, scale, m_sc, l_sc, acc_sc):
    """One flash update with a [rows, bk] tile (masked entries contribute exactly 0)."""
    bk, D = k.shape[0], acc_sc.shape[-1]
    s = jnp.where(mask, dot_nt(q, k) * scale, NEG)
    m_prev = m_sc[...]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [rows, 128]
    p = jnp.where(mask, jnp.exp(s - lane_tile(m_next, bk)), 0.0)
    alpha = jnp.exp(m_prev - m_next)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    m_sc[...] = m_next
    acc_sc[...] = lane_tile(alpha, D) * acc_sc[...] + dot_nn(p.astype(v.dtype), v)


def softmax_finish(m_sc, l_sc, acc_sc):
    """(normalised output [rows, D] f32 (0 for rows that saw nothing), log-sum-exp [rows, 128]
    (NEG for those rows))."""
    l = l_sc[...]
    seen = l > 0.0
    l_safe = jnp.where(seen, l, 1.0)
    o = acc_sc[...] / lane_tile(l_safe, acc_sc.shape[-1])
    return o, jnp.where(seen, m_sc[...] + jnp.log(l_safe), NEG)


# ----------------------------------------------------------------------------------------------
# activations


@dataclasses.dataclass(frozen=True)
class HeadsLayout:
    """How a [B, T, N, D] activation is handed to a kernel (see the module docstring)."""

    fused: bool

    @staticmethod
    def for_head_dim(D: int) -> "HeadsLayout":
        return HeadsLayout(fused=D % NUM_LANES == 0)

    def to_kernel(self, x):
        B, T, N, D = x.shape
        return x.reshape(B, T, N * D) if self.fused else jnp.transpose(x, (0, 2, 1, 3))

    def from_kernel(self, y, N: int, D: int):
        return y.reshape(*y.shape[:2], N, D) if self.fused else jnp.transpose(y, (0, 2, 1, 3))

    def shape(self, B: int, T: int, N: int, D: int):
        return (B, T, N * D) if self.fused else (B, N, T, D)

    def spec(self, bt: int, D: int, index):
        """BlockSpec of a (bt, D) tile; `index(*grid_ids, *prefetch_refs) -> (b, n, t)`
        (batch, head, time tile)."""
        if self.fused:
            def fused(*a):
                b, n, t = index(*a)
                return b, t, n
            return pl.BlockSpec((None, bt, D), fused)
        return pl.BlockSpec((None, None, bt, D), lambda *a: (*index(*a), 0))
