"""The two metadata layouts SBD attention serves, built with `mask.py`'s builders, and random inputs:
what the kernel tests (tests/) and benchmarks (bench/bench_attention.py) run on."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sbd_jax.attention.mask import TokenMeta, block_starts, clean_meta, concat_meta, copy_meta


def training_meta(rows, L: int, k: int) -> TokenMeta:
    """The training layout [x ; x_hat], [B, 2L]: `rows` lists each batch row's document lengths
    (packed from position 0, the rest of the L tokens padding); blocks of k from each document's start."""
    seg = np.zeros((len(rows), L), np.int32)
    pos = np.zeros((len(rows), L), np.int32)
    for b, docs in enumerate(rows):
        off = 0
        for d, n in enumerate(docs, start=1):
            seg[b, off:off + n], pos[b, off:off + n] = d, np.arange(n)
            off += n
    return concat_meta(clean_meta(seg, pos), copy_meta(seg, pos, block_starts(pos, k)))


def decode_meta(lengths, S: int, k: int, done=()):
    """One cached decode step of rows holding `lengths` tokens: the window of 2k queries (the finished
    block as clean tokens, which the step writes to the cache, then the next block of k copy tokens)
    against S cache slots; rows in `done` are finished (their window is padding and writes nothing).
    -> (q_meta [B, 2k], cache_meta [B, S], window_key_meta [B, 2k]: only the copy tokens are keys)."""
    lengths = np.asarray(lengths)
    B = len(lengths)
    win_pos = lengths[:, None] + np.arange(2 * k)[None]
    win_seg = np.ones((B, 2 * k), np.int32)
    win_seg[list(done)] = 0
    blk = np.broadcast_to((lengths + k)[:, None], (B, k))
    q_meta = concat_meta(clean_meta(win_seg[:, :k], win_pos[:, :k]),
                         copy_meta(win_seg[:, k:], win_pos[:, k:], blk))
    new_len = np.where(win_seg[:, 0] > 0, lengths + k, lengths)
    slot = np.broadcast_to(np.arange(S), (B, S))
    cache_meta = clean_meta((slot < new_len[:, None]).astype(np.int32), slot)
    return q_meta, cache_meta, q_meta._replace(segment=jnp.where(q_meta.stream == 0, 0, q_meta.segment))


def random_qkv(key, B: int, Tq: int, Tk: int, H: int, K: int, D: int, dtype):
    """Standard normal q [B, Tq, H, D], k and v [B, Tk, K, D], and an output cotangent w like q."""
    kq, kk, kv, kw = jax.random.split(key, 4)
    normal = lambda key, T, N: jax.random.normal(key, (B, T, N, D), jnp.float32).astype(dtype)
    return normal(kq, Tq, H), normal(kk, Tk, K), normal(kv, Tk, K), normal(kw, Tq, H)
