"""Flash-style SBD attention over whole sequences (training: the doubled `[x ; x_hat]` input),
forward and backward, computing only the tile pairs the SBD mask can reach.

GQA/MQA (H = K * G): query head h reads KV head h // G through the BlockSpec index map (K/V
are never repeated in memory). Metadata is packed to int32 [B, 4, T].

Kernels (grid, loop):
  forward  grid (B, H, nq)  loop over the visible key tiles of its query tile  -> o, lse
  dq       grid (B, H, nq)  same loop                                          -> dq
  dk/dv    grid (B, K, nk)  loop over the visible query tiles of its key tile, and over the G
                            query heads sharing the KV head (dk/dv summed in registers: no
                            atomics, no [B, T, H, D] dk buffer)                -> dk, dv
Memory is O(T) plus the O((T/block)^2) int32 tile lists; no score matrix is materialised.
Sequences are padded to a multiple of the tile (padding = segment 0: never visible).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..mask import TokenMeta
from .kernel_common import (dot_nn, dot_nt, dot_tn, meta_all, meta_tile, online_softmax_step, probs, softmax_finish,
                            softmax_init, tile_mask)
from .options import PallasOptions, call_kwargs, next_pow2
from .tiling import compact_tiles, pack_meta, pad_meta, pad_time, round_up, tile_visibility


def fit_block(block: int, length: int) -> int:
    """Shrink a tile to the (power-of-two) sequence length when the sequence is short."""
    return min(block, max(16, next_pow2(length)))


def _q_tile_call(kernel, B, H, D, G, bq, bk, Tqp, Tkp, P, dtype, opts, *, grad: bool):
    """pallas_call of the grid (B, H, nq) kernel: forward (tile lists, q, k, v, metadata -> o, lse)
    or, with `grad`, dq (tile lists, q, k, v, do, lse, delta, metadata -> dq)."""
    tab_s = pl.BlockSpec((None, None, P), lambda b, h, i: (b, i, 0))
    q_s = pl.BlockSpec((None, bq, None, D), lambda b, h, i: (b, i, h, 0))
    kv_s = pl.BlockSpec((None, Tkp, None, D), lambda b, h, i: (b, 0, lax.div(h, G), 0))
    stat_s = pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))
    meta_s = [pl.BlockSpec((None, 4, bq), lambda b, h, i: (b, 0, i)),
              pl.BlockSpec((None, 4, Tkp), lambda b, h, i: (b, 0, 0))]
    out = jax.ShapeDtypeStruct((B, Tqp, H, D), dtype)
    return pl.pallas_call(
        functools.partial(kernel, scale=opts.scale, block_k=bk),
        grid=(B, H, Tqp // bq),
        in_specs=[tab_s, q_s, kv_s, kv_s] + ([q_s, stat_s, stat_s] if grad else []) + meta_s,
        out_specs=q_s if grad else [q_s, stat_s],
        out_shape=out if grad else [out, jax.ShapeDtypeStruct((B, H, Tqp), jnp.float32)],
        name="sbd_flash_dq" if grad else "sbd_flash_fwd",
        **call_kwargs(opts),
    )


# ----------------------------------------------------------------------------------------------
# forward


def _fwd_kernel(tab_ref, q_ref, k_ref, v_ref, qm_ref, km_ref, o_ref, lse_ref, *, scale, block_k):
    q = q_ref[...]  # [bq, D]
    qf = meta_all(qm_ref)  # 4 x [bq]

    def body(n, carry):
        start = pl.multiple_of(tab_ref[n + 1] * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        mask = tile_mask(qf, meta_tile(km_ref, start, block_k))
        return online_softmax_step(q, k, v, mask, scale, carry)

    acc, m, l = lax.fori_loop(0, tab_ref[0], body, softmax_init(q.shape[0], q.shape[1]))
    o, lse = softmax_finish(acc, m, l)
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse


def train_forward(q, k, v, q_meta: TokenMeta, kv_meta: TokenMeta, opts: PallasOptions):
    """-> (o [B, Tq, H, D] in q's dtype, lse [B, H, Tq] float32)."""
    B, Tq, H, D = q.shape
    Tk, K = k.shape[1], k.shape[2]
    G = H // K
    bq, bk = fit_block(opts.blocks.block_q, Tq), fit_block(opts.blocks.block_k, Tk)
    nq, nk = -(-Tq // bq), -(-Tk // bk)
    Tqp, Tkp = nq * bq, nk * bk
    tab = compact_tiles(tile_visibility(q_meta, kv_meta, bq, bk))  # [B, nq, P]
    qm, km = pack_meta(pad_meta(q_meta, Tqp)), pack_meta(pad_meta(kv_meta, Tkp))
    o, lse = _q_tile_call(_fwd_kernel, B, H, D, G, bq, bk, Tqp, Tkp, tab.shape[-1], q.dtype, opts, grad=False)(
        tab, pad_time(q, Tqp), pad_time(k, Tkp), pad_time(v, Tkp), qm, km)
    return o[:, :Tq], lse[:, :, :Tq]


# ----------------------------------------------------------------------------------------------
# backward


def _dq_kernel(tab_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qm_ref, km_ref, dq_ref,
               *, scale, block_k):
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    qf = meta_all(qm_ref)

    def body(n, dq):
        start = pl.multiple_of(tab_ref[n + 1] * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        mask = tile_mask(qf, meta_tile(km_ref, start, block_k))
        p = probs(q, k, lse, mask, scale)
        ds = p * (dot_nt(do, v) - delta[:, None])
        return dq + dot_nn(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, tab_ref[0], body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(tab_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, qm_ref, km_ref,
                dk_ref, dv_ref, *, scale, block_q, groups):
    k, v = k_ref[...], v_ref[...]  # [bk, D]
    kf = meta_all(km_ref)

    def tile(n, carry):
        start = pl.multiple_of(tab_ref[n + 1] * block_q, block_q)
        mask = tile_mask(meta_tile(qm_ref, start, block_q), kf)  # shared by the G heads

        def head(g, carry):
            dk, dv = carry
            q = q_ref[pl.ds(start, block_q), g, :]
            do = do_ref[pl.ds(start, block_q), g, :]
            lse = lse_ref[g, pl.ds(start, block_q)]
            delta = delta_ref[g, pl.ds(start, block_q)]
            p = probs(q, k, lse, mask, scale)
            dv = dv + dot_tn(p.astype(do.dtype), do)
            ds = p * (dot_nt(do, v) - delta[:, None])
            dk = dk + dot_tn(ds.astype(q.dtype), q)
            return dk, dv

        return lax.fori_loop(0, groups, head, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, tab_ref[0], tile, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def train_backward(q, k, v, q_meta: TokenMeta, kv_meta: TokenMeta, lse, delta, do,
                   opts: PallasOptions):
    """Gradients (dq, dk, dv) given lse, delta = rowsum(o * do) [B, H, Tq] and do = dL/do."""
    B, Tq, H, D = q.shape
    Tk, K = k.shape[1], k.shape[2]
    G = H // K
    blk = opts.blocks
    bq, bk = fit_block(blk.block_q, Tq), fit_block(blk.block_k, Tk)
    bq2, bk2 = fit_block(blk.block_q_dkv, Tq), fit_block(blk.block_k_dkv, Tk)
    Tqp, Tkp = round_up(Tq, max(bq, bq2)), round_up(Tk, max(bk, bk2))  # powers of two: multiples of both
    nk2 = Tkp // bk2

    qp, dop = pad_time(q, Tqp), pad_time(do.astype(q.dtype), Tqp)
    kp, vp = pad_time(k, Tkp), pad_time(v, Tkp)
    lsep, deltap = pad_time(lse, Tqp, axis=2), pad_time(delta, Tqp, axis=2)
    qmp, kmp = pad_meta(q_meta, Tqp), pad_meta(kv_meta, Tkp)
    qm, km = pack_meta(qmp), pack_meta(kmp)

    vis = tile_visibility(qmp, kmp, bq, bk)
    vis2 = vis if (bq, bk) == (bq2, bk2) else tile_visibility(qmp, kmp, bq2, bk2)
    tab_q = compact_tiles(vis)  # [B, nq, P]: key tiles per query tile
    tab_k = compact_tiles(jnp.swapaxes(vis2, 1, 2))  # [B, nk2, P2]: query tiles per key tile
    dq = _q_tile_call(_dq_kernel, B, H, D, G, bq, bk, Tqp, Tkp, tab_q.shape[-1], q.dtype, opts, grad=True)(
        tab_q, qp, kp, vp, dop, lsep, deltap, qm, km)

    # grid (B, K, nk2): the G query heads of the KV head and all query tiles in one block
    heads = pl.BlockSpec((None, Tqp, None, G, D), lambda b, h, j: (b, 0, h, 0, 0))
    stats = pl.BlockSpec((None, None, G, Tqp), lambda b, h, j: (b, h, 0, 0))
    kv_tile = pl.BlockSpec((None, bk2, None, D), lambda b, h, j: (b, j, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=opts.scale, block_q=bq2, groups=G),
        grid=(B, K, nk2),
        in_specs=[pl.BlockSpec((None, None, tab_k.shape[-1]), lambda b, h, j: (b, j, 0)),
                  heads, heads, stats, stats, kv_tile, kv_tile,
                  pl.BlockSpec((None, 4, Tqp), lambda b, h, j: (b, 0, 0)),
                  pl.BlockSpec((None, 4, bk2), lambda b, h, j: (b, 0, j))],
        out_specs=[kv_tile, kv_tile],
        out_shape=[jax.ShapeDtypeStruct((B, Tkp, K, D), k.dtype),
                   jax.ShapeDtypeStruct((B, Tkp, K, D), v.dtype)],
        name="sbd_flash_dkv", **call_kwargs(opts),
    )(tab_k, qp.reshape(B, Tqp, K, G, D), dop.reshape(B, Tqp, K, G, D), lsep.reshape(B, K, G, Tqp),
      deltap.reshape(B, K, G, Tqp), kp, vp, qm, km)
    return dq[:, :Tq], dk[:, :Tk], dv[:, :Tk]
