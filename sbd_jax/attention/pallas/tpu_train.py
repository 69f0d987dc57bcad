"""Mosaic-TPU flash SBD attention over whole sequences: the contract of `flash_train`.

TPU structure (after jax's splash attention):
  forward  grid (B, H, nq, nk)        step j reads the j-th VISIBLE key tile of query tile i
  dq       grid (B, H, nq, nk)        same
  dk/dv    grid (B, K, nk', G, nq')   step n reads the n-th visible query tile of key tile j'
                                      for query head g of the KV head; dk/dv accumulate over
                                      (g, n) in VMEM scratch (no atomics, no per-q-head dk)
The scalar-prefetched tile lists drive the K/V (or Q) index maps, so only visible tiles are
DMA'd; steps past a tile's count repeat the last block index (no copy) and skip the compute
(`pl.when`). The accumulation axes are "arbitrary", the others "parallel" (megacore may split
them). An axis shorter than its tile is padded to a multiple of 128 and taken as one tile (both
axes land on lanes in some kernel). lse is written along lanes ([B, H, 1, T]): 4 bytes per
(head, token), not 512 as a lane-broadcast [.., T, 128] output.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..mask import TokenMeta
from .kernel_common import NEG, dot_nn, dot_nt
from .options import PallasOptions, call_kwargs
from .tiling import flat_tile_lists, pad_meta, pad_time, tile_visibility
from .tpu_common import (NUM_LANES, HeadsLayout, cols_meta, listed_tile, online_softmax_step, plan_axis, rows_meta,
                         softmax_finish, softmax_init, tile_mask_rows_k, tile_mask_rows_q)

F32 = jnp.float32


def _q_tile_call(kernel, lay, B, H, D, G, bq, bk, Tqp, Tkp, P, dtype, opts, *, grad: bool):
    """pallas_call of the grid (B, H, nq, nk) kernel: forward (q, k, v, metadata -> o, lse along
    lanes) or, with `grad`, dq (q, k, v, do, lse, delta, metadata -> dq)."""
    nq, nk = Tqp // bq, Tkp // bk
    kv_tile = lambda b, i, j, tab: listed_tile(tab, b * nq + i, j, P)
    q_s = lay.spec(bq, D, lambda b, h, i, j, tab: (b, h, i))
    kv_s = lay.spec(bk, D, lambda b, h, i, j, tab: (b, lax.div(h, G), kv_tile(b, i, j, tab)))
    stat_s = pl.BlockSpec((None, None, 1, bq), lambda b, h, i, j, tab: (b, h, 0, i))
    meta_s = [pl.BlockSpec((None, 4, bq, NUM_LANES), lambda b, h, i, j, tab: (b, 0, i, 0)),
              pl.BlockSpec((None, 4, 8, bk), lambda b, h, i, j, tab: (b, 0, 0, kv_tile(b, i, j, tab)))]
    out = jax.ShapeDtypeStruct(lay.shape(B, Tqp, H, D), dtype)
    m_l = [] if grad else [pltpu.VMEM((bq, NUM_LANES), F32)] * 2  # the forward's running max and sum
    return pl.pallas_call(
        functools.partial(kernel, scale=opts.scale, nq=nq, P=P, steps=nk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, H, nq, nk),
            in_specs=[q_s, kv_s, kv_s] + ([q_s, stat_s, stat_s] if grad else []) + meta_s,
            out_specs=q_s if grad else [q_s, stat_s],
            scratch_shapes=m_l + [pltpu.VMEM((bq, D), F32)],
        ),
        out_shape=out if grad else [out, jax.ShapeDtypeStruct((B, H, 1, Tqp), F32)],
        name="sbd_tpu_flash_dq" if grad else "sbd_tpu_flash_fwd",
        **call_kwargs(opts, ("parallel", "parallel", "parallel", "arbitrary")),
    )


# ----------------------------------------------------------------------------------------------
# forward


def _fwd_kernel(tab_ref, q_ref, k_ref, v_ref, qm_ref, km_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc,
                *, scale, nq, P, steps):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        softmax_init(m_sc, l_sc, acc_sc)

    @pl.when(j < tab_ref[(b * nq + i) * P])
    def _run():
        mask = tile_mask_rows_q(qm_ref, km_ref, k_ref.shape[0])
        online_softmax_step(q_ref[...], k_ref[...], v_ref[...], mask, scale, m_sc, l_sc, acc_sc)

    @pl.when(j == steps - 1)
    def _end():
        o, lse = softmax_finish(m_sc, l_sc, acc_sc)
        o_ref[...] = o.astype(o_ref.dtype)
        lse_ref[...] = lse.T[:1, :]  # [bq, 128] lane-broadcast -> [1, bq] along lanes


def train_forward(q, k, v, q_meta: TokenMeta, kv_meta: TokenMeta, opts: PallasOptions):
    """As `flash_train.train_forward`."""
    B, Tq, H, D = q.shape
    Tk, K = k.shape[1], k.shape[2]
    G = H // K
    Tqp, (bq,) = plan_axis(Tq, opts.blocks.block_q, align=NUM_LANES)
    Tkp, (bk,) = plan_axis(Tk, opts.blocks.block_k, align=NUM_LANES)
    q_meta, kv_meta = pad_meta(q_meta, Tqp), pad_meta(kv_meta, Tkp)  # tables: nq x nk exactly
    tab, P = flat_tile_lists(tile_visibility(q_meta, kv_meta, bq, bk))
    lay = HeadsLayout.for_head_dim(D)
    qk, kk, vk = (lay.to_kernel(pad_time(x, n)) for x, n in ((q, Tqp), (k, Tkp), (v, Tkp)))
    o, lse = _q_tile_call(_fwd_kernel, lay, B, H, D, G, bq, bk, Tqp, Tkp, P, q.dtype, opts, grad=False)(
        tab, qk, kk, vk, rows_meta(q_meta, Tqp), cols_meta(kv_meta, Tkp))
    return lay.from_kernel(o, H, D)[:, :Tq], lse[:, :, 0, :Tq]


# ----------------------------------------------------------------------------------------------
# backward


def _dq_kernel(tab_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qm_ref, km_ref, dq_ref,
               dq_sc, *, scale, nq, P, steps):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, F32)

    @pl.when(j < tab_ref[(b * nq + i) * P])
    def _run():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        lse = jnp.expand_dims(lse_ref[0], -1)  # [1, bq] along lanes -> [bq, 1]
        delta = jnp.expand_dims(delta_ref[0], -1)
        mask = tile_mask_rows_q(qm_ref, km_ref, k.shape[0])
        p = jnp.exp(jnp.where(mask, dot_nt(q, k) * scale - lse, NEG))  # exp(NEG) == 0
        ds = p * (dot_nt(do, v) - delta)
        dq_sc[...] += dot_nn(ds.astype(k.dtype), k)

    @pl.when(j == steps - 1)
    def _end():
        dq_ref[...] = (dq_sc[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(tab_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, qm_ref, km_ref,
                dk_ref, dv_ref, dk_sc, dv_sc, *, scale, nk, P, groups, steps):
    b, j, g, n = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)

    @pl.when(jnp.logical_and(g == 0, n == 0))
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, F32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, F32)

    @pl.when(n < tab_ref[(b * nk + j) * P])
    def _run():
        k, v, q, do = k_ref[...], v_ref[...], q_ref[...], do_ref[...]
        # transposed scores [bk, bq]: keys on sublanes, queries (and lse, delta) along lanes
        mask = tile_mask_rows_k(qm_ref, km_ref, q.shape[0])
        p = jnp.exp(jnp.where(mask, dot_nt(k, q) * scale - lse_ref[...], NEG))
        dv_sc[...] += dot_nn(p.astype(do.dtype), do)
        ds = p * (dot_nt(v, do) - delta_ref[...])
        dk_sc[...] += dot_nn(ds.astype(q.dtype), q)

    @pl.when(jnp.logical_and(g == groups - 1, n == steps - 1))
    def _end():
        dk_ref[...] = (dk_sc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def train_backward(q, k, v, q_meta: TokenMeta, kv_meta: TokenMeta, lse, delta, do, opts: PallasOptions):
    """As `flash_train.train_backward`."""
    B, Tq, H, D = q.shape
    Tk, K = k.shape[1], k.shape[2]
    G = H // K
    b = opts.blocks
    Tqp, (bq, bq2) = plan_axis(Tq, b.block_q, b.block_q_dkv, align=NUM_LANES)
    Tkp, (bk, bk2) = plan_axis(Tk, b.block_k, b.block_k_dkv, align=NUM_LANES)
    nq2, nk2 = Tqp // bq2, Tkp // bk2
    q_meta, kv_meta = pad_meta(q_meta, Tqp), pad_meta(kv_meta, Tkp)  # tables match the grids

    lse4 = pad_time(lse, Tqp, axis=2)[:, :, None, :]  # [B, H, 1, Tqp]
    delta4 = pad_time(delta, Tqp, axis=2)[:, :, None, :]
    lay = HeadsLayout.for_head_dim(D)
    qk, dok = (lay.to_kernel(pad_time(x, Tqp)) for x in (q, do.astype(q.dtype)))
    kk, vk = (lay.to_kernel(pad_time(x, Tkp)) for x in (k, v))

    vis = tile_visibility(q_meta, kv_meta, bq, bk)
    tab_q, P = flat_tile_lists(vis)
    vis2 = vis if (bq, bk) == (bq2, bk2) else tile_visibility(q_meta, kv_meta, bq2, bk2)
    tab_k, P2 = flat_tile_lists(jnp.swapaxes(vis2, 1, 2))  # query tiles per key tile

    dq = _q_tile_call(_dq_kernel, lay, B, H, D, G, bq, bk, Tqp, Tkp, P, q.dtype, opts, grad=True)(
        tab_q, qk, kk, vk, dok, lse4, delta4, rows_meta(q_meta, Tqp), cols_meta(kv_meta, Tkp))

    # dk/dv: grid (B, K, nk2, G, nq2) over the G query heads and the visible query tiles
    q_tile = lambda b, j, n, tab: listed_tile(tab, b * nk2 + j, n, P2)
    qh_idx = lambda b, h, j, g, n, tab: (b, h * G + g, q_tile(b, j, n, tab))
    k_idx = lambda b, h, j, g, n, tab: (b, h, j)
    stat_k = pl.BlockSpec((None, None, 1, bq2),
                          lambda b, h, j, g, n, tab: (b, h * G + g, 0, q_tile(b, j, n, tab)))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=opts.scale, nk=nk2, P=P2, groups=G, steps=nq2),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, K, nk2, G, nq2),
            in_specs=[
                lay.spec(bq2, D, qh_idx), lay.spec(bq2, D, qh_idx), stat_k, stat_k,
                lay.spec(bk2, D, k_idx), lay.spec(bk2, D, k_idx),
                pl.BlockSpec((None, 4, 8, bq2),
                             lambda b, h, j, g, n, tab: (b, 0, 0, q_tile(b, j, n, tab))),
                pl.BlockSpec((None, 4, bk2, NUM_LANES), lambda b, h, j, g, n, tab: (b, 0, j, 0)),
            ],
            out_specs=[lay.spec(bk2, D, k_idx), lay.spec(bk2, D, k_idx)],
            scratch_shapes=[pltpu.VMEM((bk2, D), F32), pltpu.VMEM((bk2, D), F32)],
        ),
        out_shape=[jax.ShapeDtypeStruct(lay.shape(B, Tkp, K, D), k.dtype),
                   jax.ShapeDtypeStruct(lay.shape(B, Tkp, K, D), v.dtype)],
        name="sbd_tpu_flash_dkv",
        **call_kwargs(opts, ("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
    )(tab_k, qk, dok, lse4, delta4, kk, vk, cols_meta(q_meta, Tqp), rows_meta(kv_meta, Tkp))
    return (lay.from_kernel(dq, H, D)[:, :Tq], lay.from_kernel(dk, K, D)[:, :Tk],
            lay.from_kernel(dv, K, D)[:, :Tk])
