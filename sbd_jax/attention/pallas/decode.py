"""Flash-decoding SBD attention: a decode window of queries (k or 2k tokens) against a static
KV cache with per-row valid lengths plus the window's in-block SBD mask.

K/V come in parts [B, S_i, K, D] (the cache slots; the window's keys). Cache slots past a row's
length carry segment 0, so the exact tile table drops those tiles and they are never read.

One program = (row b, KV head, split s, row tile r), grid (B, K, num_splits, nr):
  * GQA/MQA: its query rows are (token, query head of the KV head), R = Tq * G padded to tiles
    of `decode_block_rows`, so a K/V tile is read once for all G heads (per row tile);
  * flash-decoding: a row's visible key tiles are divided evenly between the splits (batch 1
    still fills the device); each split's normalised partial output and log-sum-exp are merged.
K/V are read in place (no padding copy of the cache) unless S < block: the last tile starts at
S - block and only its columns >= j * block count ("fresh" columns), so no load is out of bounds.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..mask import TokenMeta
from .kernel_common import (meta_all, meta_tile, online_softmax_step, softmax_finish, softmax_init, split_range,
                            tile_mask)
from .options import PallasOptions, call_kwargs, next_pow2
from .tiling import compact_tiles, pack_meta, pad_meta, pad_time, round_up, tile_visibility


def _decode_kernel(tab_ref, q_ref, k_ref, v_ref, qm_ref, km_ref, o_ref, lse_ref, *, scale,
                   block_k, num_splits, kv_len):
    q = q_ref[...]  # [br, D]
    qf = meta_all(qm_ref)  # 4 x [br]
    lo, hi = split_range(tab_ref[0], pl.program_id(2), num_splits)
    cols = jnp.arange(block_k, dtype=jnp.int32)

    def body(n, carry):
        first = tab_ref[n + 1] * block_k
        start = jnp.minimum(first, kv_len - block_k)  # last tile shifted back in bounds
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        fresh = (start + cols) >= first  # columns already counted by the previous tile: off
        mask = tile_mask(qf, meta_tile(km_ref, start, block_k)) & fresh[None, :]
        return online_softmax_step(q, k, v, mask, scale, carry)

    acc, m, l = lax.fori_loop(lo, hi, body, softmax_init(q.shape[0], q.shape[1]))
    o, lse = softmax_finish(acc, m, l)
    o_ref[...] = o
    lse_ref[...] = lse


def auto_num_splits(batch: int, kv_heads: int, n_tiles: int) -> int:
    """Enough programs to fill the device (about 2 per streaming multiprocessor) but at least
    4 key tiles per split."""
    sms = int(getattr(jax.devices()[0], "core_count", 0) or 0) or 132  # H100 SXM: 132
    want = -(-2 * sms // max(batch * kv_heads, 1))
    return max(1, min(want, n_tiles // 4 if n_tiles >= 4 else 1))


def merge_splits(o_part, lse_part):
    """o_part [..., S, R, D] normalised per split, lse_part [..., S, R] -> (o [..., R, D], lse)."""
    m = jnp.max(lse_part, axis=-2, keepdims=True)
    w = jnp.exp(lse_part - m)  # splits that saw nothing have lse NEG -> weight 0 (or all 1 and o 0)
    tot = jnp.sum(w, axis=-2)
    o = jnp.sum(w[..., None] * o_part, axis=-3) / tot[..., None]
    return o, jnp.squeeze(m, -2) + jnp.log(tot)


def query_rows(q, q_meta: TokenMeta, K: int, R: int):
    """[B, Tq, H, D] -> rows [B, K, R, D] (row = (token, query head of the KV head); R >= Tq * G,
    the rest zeros) and their metadata [B, R] (padding rows: segment 0)."""
    B, Tq, H, D = q.shape
    G = H // K
    q_rows = q.reshape(B, Tq, K, G, D).transpose(0, 2, 1, 3, 4).reshape(B, K, Tq * G, D)
    row_meta = TokenMeta(*(jnp.repeat(jnp.asarray(f, jnp.int32), G, axis=1) for f in q_meta))
    return pad_time(q_rows, R, axis=2), pad_meta(row_meta, R)


def _query_rows(q, q_meta: TokenMeta, K: int, opts: PallasOptions):
    """Rows of `query_rows`, their packed metadata [B, 4, R] and the row tile br (R a multiple)."""
    n = q.shape[1] * (q.shape[2] // K)
    br = min(opts.blocks.decode_block_rows, max(16, next_pow2(n)))
    q_rows, row_meta = query_rows(q, q_meta, K, round_up(n, br))
    return q_rows, pack_meta(row_meta), br


def _partials(q_rows, qm, br, q_meta: TokenMeta, k, v, kv_meta: TokenMeta, opts: PallasOptions):
    """One kernel launch over one K/V part -> per-split (o_part [B, K, ns, R, D] normalised,
    lse_part [B, K, ns, R])."""
    B, K, R, D = q_rows.shape
    S = k.shape[1]
    bk = opts.blocks.decode_block_k
    if S < bk:  # tiny part (e.g. the window's keys): pad (cheap); big ones are read in place
        k, v, kv_meta, S = pad_time(k, bk), pad_time(v, bk), pad_meta(kv_meta, bk), bk
    nk = -(-S // bk)
    ns = max(1, min(opts.blocks.num_splits or auto_num_splits(B, K, nk), nk))
    # the whole window is one query tile: [B, 1, nk] -> compact list [B, P]
    tab = compact_tiles(tile_visibility(q_meta, kv_meta, q_meta.segment.shape[1], bk)[:, 0])
    P = tab.shape[-1]
    km = pack_meta(kv_meta)  # [B, 4, S]
    return pl.pallas_call(
        functools.partial(_decode_kernel, scale=opts.scale, block_k=bk, num_splits=ns, kv_len=S),
        grid=(B, K, ns, R // br),
        in_specs=[
            pl.BlockSpec((None, P), lambda b, h, s, r: (b, 0)),
            pl.BlockSpec((None, None, br, D), lambda b, h, s, r: (b, h, r, 0)),
            pl.BlockSpec((None, S, None, D), lambda b, h, s, r: (b, 0, h, 0)),
            pl.BlockSpec((None, S, None, D), lambda b, h, s, r: (b, 0, h, 0)),
            pl.BlockSpec((None, 4, br), lambda b, h, s, r: (b, 0, r)),
            pl.BlockSpec((None, 4, S), lambda b, h, s, r: (b, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, br, D), lambda b, h, s, r: (b, h, s, r, 0)),
            pl.BlockSpec((None, None, None, br), lambda b, h, s, r: (b, h, s, r)),
        ],
        out_shape=[jax.ShapeDtypeStruct((B, K, ns, R, D), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, ns, R), jnp.float32)],
        name="sbd_flash_decode",
        **call_kwargs(opts),
    )(tab, q_rows, k, v, qm, km)


def forward_parts_with(rows, partials, q, parts, q_meta: TokenMeta, opts: PallasOptions):
    """Attention over the concatenation of K/V parts without concatenating them: parts =
    ((k [B, S_i, K, D], v, kv_meta [B, S_i]), ...), e.g. (cache, window keys). The driver of both
    kernel families: `rows` lays the window's queries out as rows per KV head, `partials`
    runs one kernel launch per part (its cache splits); all the splits are merged by log-sum-exp
    and the rows laid back out as heads. -> (o [B, Tq, H, D] in q's dtype, lse [B, H, Tq] f32)."""
    B, Tq, H, D = q.shape
    K = parts[0][0].shape[2]
    G = H // K
    q_rows, qm, br = rows(q, q_meta, K, opts)
    outs = [partials(q_rows, qm, br, q_meta, k, v, m, opts) for k, v, m in parts]
    o_part = jnp.concatenate([o for o, _ in outs], axis=2)
    lse_part = jnp.concatenate([l for _, l in outs], axis=2)
    o, lse = merge_splits(o_part, lse_part)  # [B, K, R, D], [B, K, R]
    o = o[:, :, :Tq * G].reshape(B, K, Tq, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Tq, H, D)
    lse = lse[:, :, :Tq * G].reshape(B, K, Tq, G).transpose(0, 1, 3, 2).reshape(B, H, Tq)
    return o.astype(q.dtype), lse


decode_forward_parts = functools.partial(forward_parts_with, _query_rows, _partials)
