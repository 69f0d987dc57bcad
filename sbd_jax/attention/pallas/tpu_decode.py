"""Mosaic-TPU flash-decoding SBD attention: the contract and structure of `decode`, with TPU specifics:

  * grid (B, K, ns, nr, steps): step t of split s reads entry lo_s + t of the scalar-prefetched
    tile list; steps past the split's share repeat the block index (no DMA) and skip the compute;
  * the cache is read in place for head_dim % 128 == 0 (`HeadsLayout`). S need not be a multiple
    of the tile: the last block overhangs the array (unspecified values), its columns are masked
    by the padded metadata and its V rows zeroed;
  * a part shorter than one tile (the window's keys) is padded to 128 keys and read as one tile.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..mask import TokenMeta
from .decode import forward_parts_with, query_rows
from .kernel_common import split_range
from .options import PallasOptions, call_kwargs
from .tiling import flat_tile_lists, pad_meta, pad_time, round_up, tile_visibility
from .tpu_common import (NUM_LANES, HeadsLayout, cols_meta, listed_tile, online_softmax_step, plan_axis, rows_meta,
                         softmax_finish, softmax_init, tile_mask_rows_q)

F32 = jnp.float32


def _decode_kernel(tab_ref, q_ref, k_ref, v_ref, qm_ref, km_ref, o_ref, lse_ref,
                   m_sc, l_sc, acc_sc, *, scale, P, num_splits, steps, kv_len):
    b, s, t = pl.program_id(0), pl.program_id(2), pl.program_id(4)
    lo, hi = split_range(tab_ref[b * P], s, num_splits)

    @pl.when(t == 0)
    def _init():
        softmax_init(m_sc, l_sc, acc_sc)

    @pl.when(lo + t < hi)
    def _run():
        k, v = k_ref[...], v_ref[...]
        bk = k.shape[0]
        if kv_len % bk:  # the last block overhangs the cache: zero its unspecified V rows
            first = tab_ref[b * P + 1 + lo + t] * bk
            inside = first + lax.broadcasted_iota(jnp.int32, v.shape, 0) < kv_len
            v = jnp.where(inside, v, jnp.zeros_like(v))
        mask = tile_mask_rows_q(qm_ref, km_ref, bk)
        online_softmax_step(q_ref[...], k, v, mask, scale, m_sc, l_sc, acc_sc)

    @pl.when(t == steps - 1)
    def _end():
        o, lse = softmax_finish(m_sc, l_sc, acc_sc)
        o_ref[...] = o
        lse_ref[...] = lse


def auto_num_splits(batch: int, kv_heads: int, n_tiles: int) -> int:
    """TPU: splits only add parallelism across the (up to 2) TensorCores of a chip, and the
    (batch, KV head) axes already give that unless there is a single one."""
    return 2 if batch * kv_heads < 2 and n_tiles >= 2 else 1


def _query_rows(q, q_meta: TokenMeta, K: int, opts: PallasOptions):
    """Rows of `decode.query_rows`, their rows-layout metadata [B, 4, R, 128] and the row tile br
    (R a multiple)."""
    R, (br,) = plan_axis(q.shape[1] * (q.shape[2] // K), opts.blocks.decode_block_rows)
    q_rows, row_meta = query_rows(q, q_meta, K, R)
    return q_rows, rows_meta(row_meta, R), br


def _partials(q_rows, qm, br, q_meta: TokenMeta, k, v, kv_meta: TokenMeta, opts: PallasOptions):
    """One kernel launch over one K/V part -> (o_part [B, K, ns, R, D] normalised per split,
    lse_part [B, K, ns, R])."""
    B, K, R, D = q_rows.shape
    Sp, (bk,) = plan_axis(k.shape[1], opts.blocks.decode_block_k, align=NUM_LANES)
    if Sp == bk and Sp > k.shape[1]:  # a short part (the window's keys): one tile, padded to
        # 128 lanes (a small copy); a long part (the cache) is read in place, its last tile
        # overhanging the array
        k, v = pad_time(k, Sp), pad_time(v, Sp)
        kv_meta = pad_meta(kv_meta, Sp)
    S = k.shape[1]
    nk = -(-S // bk)
    ns = max(1, min(opts.blocks.num_splits or auto_num_splits(B, K, nk), nk))
    steps = -(-nk // ns)
    # the whole window is one query tile: lists of visible key tiles per batch row
    vis = tile_visibility(q_meta, kv_meta, q_meta.segment.shape[1], bk)  # [B, 1, nk]
    tab, P = flat_tile_lists(vis)
    lay = HeadsLayout.for_head_dim(D)
    kk, vk = lay.to_kernel(k), lay.to_kernel(v)  # fused: a free reshape, the cache stays put
    km = cols_meta(kv_meta, round_up(S, bk))  # metadata padded: overhanging columns invisible

    kv_tile = lambda b, s, t, tab: listed_tile(tab, b, t, P, s, ns)
    kv_idx = lambda b, h, s, r, t, tab: (b, h, kv_tile(b, s, t, tab))
    out_idx = lambda b, h, s, r, t, tab: (b, h, s, r, 0)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(B, K, ns, R // br, steps),
        in_specs=[
            pl.BlockSpec((None, None, br, D), lambda b, h, s, r, t, tab: (b, h, r, 0)),
            lay.spec(bk, D, kv_idx),
            lay.spec(bk, D, kv_idx),
            pl.BlockSpec((None, 4, br, NUM_LANES), lambda b, h, s, r, t, tab: (b, 0, r, 0)),
            pl.BlockSpec((None, 4, 8, bk),
                         lambda b, h, s, r, t, tab: (b, 0, 0, kv_tile(b, s, t, tab))),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, br, D), out_idx),
            pl.BlockSpec((None, None, None, br, NUM_LANES), out_idx),
        ],
        scratch_shapes=[pltpu.VMEM((br, NUM_LANES), F32), pltpu.VMEM((br, NUM_LANES), F32),
                        pltpu.VMEM((br, D), F32)],
    )
    o_part, lse_part = pl.pallas_call(
        functools.partial(_decode_kernel, scale=opts.scale, P=P, num_splits=ns, steps=steps,
                          kv_len=S),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((B, K, ns, R, D), F32),
                   jax.ShapeDtypeStruct((B, K, ns, R, NUM_LANES), F32)],
        name="sbd_tpu_flash_decode",
        **call_kwargs(opts, ("parallel", "parallel", "parallel", "parallel", "arbitrary")),
    )(tab, q_rows, kk, vk, qm, km)
    return o_part, lse_part[..., 0]


decode_forward_parts = functools.partial(forward_parts_with, _query_rows, _partials)
