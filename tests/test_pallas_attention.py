"""Pallas SBD attention kernels (interpret mode on CPU) against `reference_attention`, the oracle:
outputs and gradients, float32 (<= 1e-4 relative) and bfloat16 (<= 2e-2 relative), lengths that
are not multiples of the tile or of k, packed segments, padding, ragged cache lengths, GQA/MQA,
exact tile skipping, and input validation.

Relative error = max|got - want| / max|want| per tensor.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbd_jax.attention import (
    TokenMeta,
    block_starts,
    clean_meta,
    concat_meta,
    copy_meta,
    dense_mask,
    reference_attention,
)
from sbd_jax.attention.pallas import (
    BlockSizes,
    PallasAttentionError,
    PallasOptions,
    PallasOptionsError,
    choose_kernel,
    pallas_attention,
)
from sbd_jax.attention.pallas.options import default_backend
from sbd_jax.attention.pallas.tiling import compact_tiles, tile_visibility

# small tiles so every test crosses several tiles; 16 is the smallest Triton-legal tile
BLOCKS = BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=32, decode_block_k=16,
                    decode_block_rows=16, num_splits=3)
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


# ----------------------------------------------------------------------------------------------
# metadata layouts (built with the library's builders only)


def doubled_meta(rows, L, k):
    """Training layout [x ; x_hat] per row; rows = list of document-length lists (rest = pad)."""
    seg = np.zeros((len(rows), L), np.int32)
    pos = np.zeros((len(rows), L), np.int32)
    for b, docs in enumerate(rows):
        off = 0
        for d, n in enumerate(docs, start=1):
            seg[b, off:off + n], pos[b, off:off + n] = d, np.arange(n)
            off += n
    return concat_meta(clean_meta(seg, pos), copy_meta(seg, pos, block_starts(pos, k)))


def decode_meta(lengths, S, k, done=()):
    """What `forward` builds for a cached window of k clean (just-finished block, written to the
    cache) + k copy tokens: q_meta [B, 2k], kv_meta [B, S + 2k] = cache slots ; window keys."""
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
    cache = clean_meta((slot < new_len[:, None]).astype(np.int32), slot)
    window_keys = q_meta._replace(segment=jnp.where(q_meta.stream == 0, 0, q_meta.segment))
    return q_meta, concat_meta(cache, window_keys), new_len


def qkv(key, B, Tq, Tk, H, K, D, dtype):
    kq, kk, kv, kw = jax.random.split(key, 4)
    q = jax.random.normal(kq, (B, Tq, H, D), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, Tk, K, D), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, Tk, K, D), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (B, Tq, H, D), jnp.float32).astype(dtype)  # output cotangent
    return q, k, v, w


@functools.partial(jax.jit, static_argnames=("impl", "kernel", "blocks", "grads"))
def run(q, k, v, w, q_meta, kv_meta, impl, kernel="auto", blocks=BLOCKS, grads=True):
    """Output (and dq, dk, dv for the output cotangent w) of one implementation, jitted."""
    if impl == "xla":
        fn = lambda q, k, v: reference_attention(q, k, v, q_meta, kv_meta)
    else:
        fn = lambda q, k, v: pallas_attention(q, k, v, q_meta, kv_meta, kernel=kernel, blocks=blocks)
    if not grads:
        return (fn(q, k, v),)
    o, vjp = jax.vjp(fn, q, k, v)
    return (o, *vjp(w))


def check_parity(q, k, v, w, q_meta, kv_meta, kernel, tol, grads=True, blocks=BLOCKS):
    want = run(q, k, v, w, q_meta, kv_meta, "xla", grads=grads)
    got = run(q, k, v, w, q_meta, kv_meta, "pallas", kernel, blocks, grads)
    for name, g, r in zip(("o", "dq", "dk", "dv"), got, want):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert np.isfinite(np.asarray(g, np.float32)).all(), name
        assert rel(g, r) <= tol, (name, rel(g, r))
    return got


# ----------------------------------------------------------------------------------------------
# training kernel


@pytest.mark.parametrize("H,K", [(4, 2), (4, 1)], ids=["gqa", "mqa"])
def test_train_kernel_f32_outputs_and_grads(H, K):
    # L = 23: 2L = 46 is not a multiple of the 16/32 tiles, 23 not a multiple of k = 4;
    # row 0 packs two documents + padding, row 1 one document.
    meta = doubled_meta([[10, 9], [23]], 23, k=4)
    q, k, v, w = qkv(jax.random.PRNGKey(0), 2, 46, 46, H, K, 16, jnp.float32)
    o = check_parity(q, k, v, w, meta, meta, "train", TOL[jnp.float32])[0]
    # padding tokens (row 0, positions 19..22 of each half) attend nothing -> zeros
    assert np.all(np.asarray(o)[0, 19:23] == 0) and np.all(np.asarray(o)[0, 42:46] == 0)


def test_train_kernel_bf16_outputs_and_grads():
    meta = doubled_meta([[7, 12, 5], [20]], 27, k=3)
    q, k, v, w = qkv(jax.random.PRNGKey(1), 2, 54, 54, 4, 2, 32, jnp.bfloat16)
    check_parity(q, k, v, w, meta, meta, "train", TOL[jnp.bfloat16])


def test_decode_kernel_on_training_layout():
    """Both kernels take any metadata: the decode kernel on the doubled training sequence."""
    meta = doubled_meta([[10, 9], [23]], 23, k=4)
    q, k, v, w = qkv(jax.random.PRNGKey(2), 2, 46, 46, 4, 2, 16, jnp.float32)
    check_parity(q, k, v, w, meta, meta, "decode", 1e-4, grads=False)


# ----------------------------------------------------------------------------------------------
# decode kernel


@pytest.mark.parametrize("H,K,dtype,grads", [(4, 2, jnp.float32, True), (4, 1, jnp.float32, False),
                                             (4, 2, jnp.bfloat16, False)],
                         ids=["gqa-f32", "mqa-f32", "gqa-bf16"])
def test_decode_kernel_ragged_cache(H, K, dtype, grads):
    # k = 5 (2k = 10 queries), cache S = 50 (+10 window keys = 60, not a multiple of the 16 tile);
    # ragged lengths, one finished row (window = padding), splits = 3.
    S, kb = 50, 5
    q_meta, kv_meta, _ = decode_meta([37, 12, 20], S, kb, done=[2])
    q, k, v, w = qkv(jax.random.PRNGKey(3), 3, 2 * kb, S + 2 * kb, H, K, 16, dtype)
    assert choose_kernel(2 * kb, S + 2 * kb, PallasOptions()) == "decode"
    # gradients (gqa-f32) flow through the decode forward + the flash backward kernels
    o = check_parity(q, k, v, w, q_meta, kv_meta, "decode", TOL[dtype], grads=grads)[0]
    assert np.all(np.asarray(o, np.float32)[2] == 0)


def test_train_kernel_on_decode_layout_mha():
    q_meta, kv_meta, _ = decode_meta([37, 12, 20], 50, 5, done=[2])
    q, k, v, w = qkv(jax.random.PRNGKey(4), 3, 10, 60, 2, 2, 16, jnp.float32)
    check_parity(q, k, v, w, q_meta, kv_meta, "train", 1e-4, grads=False)


@pytest.mark.parametrize("num_splits", [1, 8])
def test_decode_splits_do_not_change_result(num_splits):
    """One split (no merge) and more splits than visible tiles (empty splits) agree."""
    q_meta, kv_meta, _ = decode_meta([70, 3], 80, 4)
    q, k, v, w = qkv(jax.random.PRNGKey(5), 2, 8, 88, 8, 2, 16, jnp.float32)
    blocks = BlockSizes(16, 16, 16, 16, 16, decode_block_rows=64, num_splits=num_splits)
    check_parity(q, k, v, w, q_meta, kv_meta, "decode", 1e-4, grads=False, blocks=blocks)


# ----------------------------------------------------------------------------------------------
# tile skipping


def test_decode_never_reads_cache_tiles_past_the_lengths():
    """NaN in every cache tile past each row's length: the kernel must not read them (a read tile
    multiplies its V by p = 0, and 0 * NaN = NaN would reach the output)."""
    S, kb, bk = 88, 4, BLOCKS.decode_block_k  # S + 2k = 96: no shifted last tile re-reading
                                              # poisoned columns
    q_meta, kv_meta, new_len = decode_meta([41, 9], S, kb)
    q, k, v, w = qkv(jax.random.PRNGKey(6), 2, 2 * kb, S + 2 * kb, 4, 2, 16, jnp.float32)
    want = run(q, k, v, w, q_meta, kv_meta, "xla", grads=False)[0]
    first_dead = -(-new_len // bk) * bk  # first slot of the first all-invisible tile
    cols = np.arange(S + 2 * kb)[None]
    dead = (cols >= first_dead[:, None]) & (cols < (S // bk) * bk)  # not the window's tile
    assert dead.sum(axis=1).min() >= 2 * bk
    poison = jnp.asarray(dead)[:, :, None, None]
    kp, vp = jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v)
    got = run(q, kp, vp, w, q_meta, kv_meta, "pallas", "decode", grads=False)[0]
    assert np.isfinite(np.asarray(got)).all()
    assert rel(got, want) <= 1e-4


def test_train_never_reads_padding_tiles():
    """NaN q/k/v in whole padding tiles: forward and gradients of the real tokens are unaffected."""
    T, real = 64, 30  # tiles [32, 64) are all padding
    pos = np.broadcast_to(np.arange(T), (2, T))
    meta = clean_meta((pos < real).astype(np.int32), pos)
    q, k, v, w = qkv(jax.random.PRNGKey(7), 2, T, T, 4, 2, 16, jnp.float32)
    want = run(q, k, v, w, meta, meta, "xla")
    bad = jnp.asarray(pos >= 32)[:, :, None, None]
    q, k, v = (jnp.where(bad, jnp.nan, x) for x in (q, k, v))
    got = run(q, k, v, w, meta, meta, "pallas", "train")
    for g, r in zip(got, want):
        g = np.asarray(g)
        assert np.isfinite(g).all()
        assert rel(g[:, :real], np.asarray(r)[:, :real]) <= 1e-4
        assert np.all(g[:, real:] == 0)


def _random_meta(rng, B, T):
    seg = rng.integers(0, 3, (B, T))
    pos = rng.integers(0, 12, (B, T))
    stream = rng.integers(0, 2, (B, T))
    blk = rng.integers(0, 12, (B, T))
    return TokenMeta(*(jnp.asarray(a, jnp.int32) for a in (seg, pos, stream, blk)))


def test_tile_table_is_exact_any_of_the_mask():
    rng = np.random.default_rng(0)
    qm, km = _random_meta(rng, 2, 37), _random_meta(rng, 2, 53)
    dense = np.asarray(dense_mask(qm, km))
    dense = np.pad(dense, [(0, 0), (0, 40 - 37), (0, 64 - 53)]).reshape(2, 5, 8, 4, 16)
    want = dense.any(axis=(2, 4))
    assert want.any() and not want.all()
    np.testing.assert_array_equal(tile_visibility(qm, km, 8, 16), want)
    # chunked evaluation (bounded memory) gives the same table
    np.testing.assert_array_equal(tile_visibility(qm, km, 8, 16, budget=300), want)
    lists = np.asarray(compact_tiles(jnp.asarray(want)))
    assert lists.shape[-1] == 8  # next power of two >= 4 + 1 (count + 4 key tiles)
    for b in range(2):
        for i in range(5):
            n = lists[b, i, 0]
            np.testing.assert_array_equal(lists[b, i, 1:1 + n], np.flatnonzero(want[b, i]))


@pytest.mark.parametrize("k,expected", [(16, 136 + 120 + 16), (4, 136 + 136 + 16)])
def test_training_tiles_computed(k, expected):
    """L = 256, 16-token tiles (16 clean + 16 copy tiles): clean tiles are causal (136 pairs); a
    copy tile sees the clean tiles of strictly earlier blocks and its own copy tile - not the
    whole 32 x 32 = 1024 square (nor the 528 of a causal 2L mask)."""
    meta = doubled_meta([[256]], 256, k=k)
    vis = np.asarray(tile_visibility(meta, meta, 16, 16))[0]
    assert vis.sum() == expected
    assert not vis[:16, 16:].any()  # clean queries never see copy tiles
    np.testing.assert_array_equal(vis[16:, 16:], np.eye(16, dtype=bool))


# ----------------------------------------------------------------------------------------------
# API: dispatcher, kernel choice, backends, validation


def test_kernel_choice_and_backend():
    opts = PallasOptions()
    assert choose_kernel(46, 46, opts) == "train"  # no cache: training
    assert choose_kernel(32, 4128, opts) == "decode"  # window against a cache
    assert choose_kernel(512, 4608, opts) == "train"  # long prefill against a cache
    assert choose_kernel(32, 4128, PallasOptions(kernel="train")) == "train"
    # the backend follows the platform (CI: cpu -> interpret; bench/gpu_run.sh runs this file on a GPU)
    expected = {"cpu": "interpret", "gpu": "triton", "tpu": "tpu"}[jax.default_backend()]
    assert default_backend() == expected
    assert PallasOptions().resolved().backend == expected
    assert PallasOptions(backend="tpu").resolved().backend == "tpu"  # tests/test_pallas_tpu.py


def test_bad_inputs_raise_clear_errors():
    meta = doubled_meta([[9]], 9, k=3)
    q, k, v, _ = qkv(jax.random.PRNGKey(9), 1, 18, 18, 4, 2, 16, jnp.float32)
    with pytest.raises(PallasAttentionError, match="multiple of kv heads"):
        pallas_attention(q[:, :, :3], k, v, meta, meta)
    with pytest.raises(PallasAttentionError, match="4-D"):
        pallas_attention(q[0], k, v, meta, meta)
    with pytest.raises(PallasAttentionError, match="kv_meta.segment has shape"):
        pallas_attention(q, k, v, meta, meta.take((slice(None), slice(0, 5))))
    with pytest.raises(PallasAttentionError, match="dtypes differ"):
        pallas_attention(q, k.astype(jnp.bfloat16), v, meta, meta)
    with pytest.raises(PallasOptionsError, match="power of two"):
        BlockSizes(block_q=24)
    with pytest.raises(PallasOptionsError, match="kernel must be"):
        pallas_attention(q, k, v, meta, meta, kernel="fast")
    with pytest.raises(PallasOptionsError, match="Triton dots need tiles >= 16"):
        pallas_attention(q, k, v, meta, meta, backend="triton", blocks=BlockSizes(8, 8, 8, 8, 8, 8))
    with pytest.raises(PallasOptionsError, match="power-of-two head_dim"):
        pallas_attention(q[..., :12], k[..., :12], v[..., :12], meta, meta, backend="triton")


# ----------------------------------------------------------------------------------------------
# K/V given as parts (cache ; window keys) without concatenation


def test_parts_api_matches_concatenated_reference():
    from sbd_jax.attention.pallas import pallas_attention_parts
    S, kb = 50, 5
    q_meta, kv_meta, _ = decode_meta([37, 12, 20], S, kb, done=[2])
    q, k, v, w = qkv(jax.random.PRNGKey(10), 3, 2 * kb, S + 2 * kb, 4, 2, 16, jnp.float32)
    cut = lambda x, a, b: x[:, a:b]
    cache_meta = kv_meta.take((slice(None), slice(0, S)))
    win_meta = kv_meta.take((slice(None), slice(S, None)))

    @jax.jit
    def parts_out_and_grads(q, k, v, w):
        def fn(q, k, v):
            parts = [(cut(k, 0, S), cut(v, 0, S), cache_meta), (cut(k, S, None), cut(v, S, None), win_meta)]
            return pallas_attention_parts(q, parts, q_meta, blocks=BLOCKS)
        o, vjp = jax.vjp(fn, q, k, v)
        return (o, *vjp(w))

    got = parts_out_and_grads(q, k, v, w)
    want = run(q, k, v, w, q_meta, kv_meta, "xla")
    for name, g, r in zip(("o", "dq", "dk", "dv"), got, want):
        assert rel(g, r) <= 1e-4, (name, rel(g, r))
