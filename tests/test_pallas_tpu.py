"""Mosaic-TPU SBD kernels (backend "tpu") run in TPU interpret mode on CPU
(`pltpu.InterpretParams()`: simulated VMEM/SMEM, DMAs and scalar prefetch; uninitialised memory
and reads past an array's end are NaN) against `reference_attention`, the oracle: outputs and
gradients, float32 (<= 1e-4 relative) and bfloat16 (<= 2e-2), lengths that are not multiples
of the tile or of k, packed segments, padding, ragged cache lengths, GQA/MQA, both activation
layouts (head_dim 128: read in place; other head dims: transposed copy), tile skipping, and the
whole model with attention_impl="pallas" forced onto the TPU kernels.

Compilation for a real TPU is not tested here (no TPU): see tests/test_pallas_lowering.py for
what the cross-lowering checks.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_pallas_attention import TOL, decode_meta, doubled_meta, qkv, rel

import sbd_jax
from sbd_jax.attention import clean_meta, reference_attention
from sbd_jax.attention.pallas import (
    DEFAULT_BLOCKS,
    BlockSizes,
    PallasOptions,
    PallasOptionsError,
    force_backend,
    pallas_attention,
    pallas_attention_parts,
)
from sbd_jax.attention.pallas.tpu_common import plan_axis

# tiny tiles so short sequences cross several tiles (legal in interpret mode only; the
# TPU-legal defaults are exercised by test_tpu_legal_tiles and the lowering tests)
SMALL = BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=32, decode_block_k=16,
                   decode_block_rows=16, num_splits=3)
MID = BlockSizes(block_q=32, block_k=32, block_q_dkv=32, block_k_dkv=32, decode_block_k=32,
                 decode_block_rows=32, num_splits=2)  # fewer interpreted grid steps


@functools.partial(jax.jit, static_argnames=("impl", "kernel", "blocks", "grads"))
def run(q, k, v, w, q_meta, kv_meta, impl, kernel="auto", blocks=SMALL, grads=True):
    """Output (and dq, dk, dv for the output cotangent w): "xla" reference or the TPU kernels."""
    if impl == "xla":
        fn = lambda q, k, v: reference_attention(q, k, v, q_meta, kv_meta)
    else:
        fn = lambda q, k, v: pallas_attention(q, k, v, q_meta, kv_meta, kernel=kernel,
                                              backend="tpu", interpret=True, blocks=blocks)
    if not grads:
        return (fn(q, k, v),)
    o, vjp = jax.vjp(fn, q, k, v)
    return (o, *vjp(w))


def check(q, k, v, w, q_meta, kv_meta, kernel, tol, grads=True, blocks=SMALL):
    want = run(q, k, v, w, q_meta, kv_meta, "xla", grads=grads)
    got = run(q, k, v, w, q_meta, kv_meta, "tpu", kernel, blocks, grads)
    errs = {}
    for name, g, r in zip(("o", "dq", "dk", "dv"), got, want):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert np.isfinite(np.asarray(g, np.float32)).all(), name
        errs[name] = rel(g, r)
    assert max(errs.values()) <= tol, errs
    return got


# ----------------------------------------------------------------------------------------------
# training kernels (forward, dq, dk/dv)


@pytest.mark.parametrize("H,K,D", [(4, 2, 16), (4, 1, 128)], ids=["gqa-d16", "mqa-d128"])
def test_train_f32_outputs_and_grads(H, K, D):
    # 2L = 46 tokens: not a multiple of the 16/32 tiles, L = 23 not a multiple of k = 4; the row
    # packs two documents + padding (batch 1 keeps the interpreted grid small). D = 128 takes
    # the in-place [B, T, N * D] layout, D = 16 the transposed one.
    meta = doubled_meta([[10, 9]], 23, k=4)
    q, k, v, w = qkv(jax.random.PRNGKey(0), 1, 46, 46, H, K, D, jnp.float32)
    o = check(q, k, v, w, meta, meta, "train", TOL[jnp.float32])[0]
    assert np.all(np.asarray(o)[0, 19:23] == 0) and np.all(np.asarray(o)[0, 42:46] == 0)


def test_train_bf16_outputs_and_grads():
    meta = doubled_meta([[7, 12, 5]], 27, k=3)
    q, k, v, w = qkv(jax.random.PRNGKey(1), 1, 54, 54, 4, 2, 32, jnp.bfloat16)
    check(q, k, v, w, meta, meta, "train", TOL[jnp.bfloat16], blocks=MID)


def test_tpu_legal_tiles():
    """Tiles that satisfy Mosaic's block rules (checked: the same options without interpret pass
    `check_tpu_blocks`): 128-row query tiles, 256-lane key tiles (lane-tiled metadata), several
    tiles per axis, head_dim 128."""
    blocks = BlockSizes(block_q=128, block_k=256, block_q_dkv=128, block_k_dkv=128,
                        decode_block_k=128, decode_block_rows=128, num_splits=2)
    from sbd_jax.attention.pallas.options import check_tpu_blocks
    check_tpu_blocks(PallasOptions(backend="tpu", blocks=blocks).resolved())
    meta = doubled_meta([[150]], 150, k=16)  # 300 tokens: 3 query tiles, 2 key tiles
    q, k, v, w = qkv(jax.random.PRNGKey(2), 1, 300, 300, 2, 1, 128, jnp.float32)
    check(q, k, v, w, meta, meta, "train", TOL[jnp.float32], blocks=blocks)


def test_train_never_reads_padding_tiles():
    """NaN q/k/v in whole padding tiles: forward and gradients of the real tokens unaffected
    (the masked tiles are neither DMA'd nor computed: 0 * NaN would leak)."""
    T, real = 64, 30  # tiles [32, 64) are all padding
    pos = np.broadcast_to(np.arange(T), (2, T))
    meta = clean_meta((pos < real).astype(np.int32), pos)
    q, k, v, w = qkv(jax.random.PRNGKey(7), 2, T, T, 4, 2, 16, jnp.float32)
    want = run(q, k, v, w, meta, meta, "xla")
    bad = jnp.asarray(pos >= 32)[:, :, None, None]
    q, k, v = (jnp.where(bad, jnp.nan, x) for x in (q, k, v))
    got = run(q, k, v, w, meta, meta, "tpu", "train", MID)
    for g, r in zip(got, want):
        g = np.asarray(g)
        assert np.isfinite(g).all()
        assert rel(g[:, :real], np.asarray(r)[:, :real]) <= 1e-4
        assert np.all(g[:, real:] == 0)


# ----------------------------------------------------------------------------------------------
# decode kernel


@pytest.mark.parametrize("H,K,dtype", [(4, 2, jnp.float32), (4, 1, jnp.float32),
                                       (4, 2, jnp.bfloat16)], ids=["gqa-f32", "mqa-f32", "gqa-bf16"])
def test_decode_ragged_cache(H, K, dtype):
    # k = 5 (2k = 10 queries), 50 cache slots + 10 window keys = 60: the last 16-key block
    # overhangs the array (read as NaN in interpret mode: masked and zeroed); ragged lengths,
    # one finished row (window = padding), 3 splits. (Gradients through the decode forward:
    # test_parts_cache_in_place_and_window.)
    S, kb = 50, 5
    q_meta, kv_meta, _ = decode_meta([37, 12, 20], S, kb, done=[2])
    q, k, v, w = qkv(jax.random.PRNGKey(3), 3, 2 * kb, S + 2 * kb, H, K, 16, dtype)
    o = check(q, k, v, w, q_meta, kv_meta, "decode", TOL[dtype], grads=False)[0]
    assert np.all(np.asarray(o, np.float32)[2] == 0)


def test_decode_never_reads_cache_tiles_past_the_lengths():
    S, kb, bk = 88, 4, SMALL.decode_block_k
    q_meta, kv_meta, new_len = decode_meta([41, 9], S, kb)
    q, k, v, w = qkv(jax.random.PRNGKey(6), 2, 2 * kb, S + 2 * kb, 4, 2, 16, jnp.float32)
    want = run(q, k, v, w, q_meta, kv_meta, "xla", grads=False)[0]
    first_dead = -(-new_len // bk) * bk
    cols = np.arange(S + 2 * kb)[None]
    dead = (cols >= first_dead[:, None]) & (cols < (S // bk) * bk)
    assert dead.sum(axis=1).min() >= 2 * bk
    poison = jnp.asarray(dead)[:, :, None, None]
    kp, vp = jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v)
    got = run(q, kp, vp, w, q_meta, kv_meta, "tpu", "decode", grads=False)[0]
    assert np.isfinite(np.asarray(got)).all()
    assert rel(got, want) <= 1e-4


def test_parts_cache_in_place_and_window():
    """`pallas_attention_parts` on [(cache, 50 slots), (window, 10 keys)] with head_dim 128 (the
    cache is read in place through the [B, S, K * D] view; its last tile overhangs), with
    gradients, equals the reference over the concatenation. Ragged rows; row 0 fills the cache
    (45 + 5 = 50 slots), so the overhanging last cache tile is visible and its NaN tail must be
    zeroed."""
    S, kb = 50, 5
    q_meta, kv_meta, _ = decode_meta([45, 12], S, kb)
    q, k, v, w = qkv(jax.random.PRNGKey(10), 2, 2 * kb, S + 2 * kb, 4, 2, 128, jnp.float32)
    cache_meta = kv_meta.take((slice(None), slice(0, S)))
    win_meta = kv_meta.take((slice(None), slice(S, None)))

    @jax.jit
    def parts_out_and_grads(q, k, v, w):
        def fn(q, k, v):
            parts = [(k[:, :S], v[:, :S], cache_meta), (k[:, S:], v[:, S:], win_meta)]
            return pallas_attention_parts(q, parts, q_meta, blocks=SMALL, backend="tpu",
                                          interpret=True)
        o, vjp = jax.vjp(fn, q, k, v)
        return (o, *vjp(w))

    got = parts_out_and_grads(q, k, v, w)
    want = run(q, k, v, w, q_meta, kv_meta, "xla")
    for name, g, r in zip(("o", "dq", "dk", "dv"), got, want):
        assert rel(g, r) <= 1e-4, (name, rel(g, r))


# ----------------------------------------------------------------------------------------------
# whole model, attention_impl="pallas" forced onto the TPU kernels (interpret mode)


def test_model_loss_grads_and_decode_on_tpu_kernels_match_xla():
    from test_pallas_model import CFG, PALLAS, PARAMS, _loss_fn

    from sbd_jax.attention import block_starts, concat_meta, copy_meta
    from sbd_jax.models import init_cache

    L, k = 19, 4
    rng = np.random.default_rng(0)
    seg = np.zeros((2, L), np.int32)
    pos = np.zeros((2, L), np.int32)
    seg[0, :8], pos[0, :8] = 1, np.arange(8)
    seg[0, 8:16], pos[0, 8:16] = 2, np.arange(8)
    seg[1], pos[1] = 1, np.arange(L)
    meta = concat_meta(clean_meta(seg, pos), copy_meta(seg, pos, block_starts(pos, k)))
    x = rng.integers(0, 62, (2, L)).astype(np.int32)
    masked = rng.random((2, L)) < 0.5
    tokens = np.concatenate([x, np.where(masked, CFG.mask_token_id, x)], axis=1)
    labels = np.concatenate([np.roll(x, -1, axis=1), x], axis=1)
    weights = np.concatenate([seg > 0, (seg > 0) & masked], axis=1).astype(np.float32)

    lx, gx = _loss_fn(CFG)(PARAMS, tokens, meta, labels, weights)
    with force_backend("tpu", interpret=True):
        loss_fn = _loss_fn(PALLAS)  # a fresh jit: traced here, inside force_backend
        jaxpr = str(jax.make_jaxpr(loss_fn)(PARAMS, tokens, meta, labels, weights))
        lp, gp = loss_fn(PARAMS, tokens, meta, labels, weights)
    for name in ("sbd_tpu_flash_fwd", "sbd_tpu_flash_dq", "sbd_tpu_flash_dkv"):
        assert name in jaxpr  # the TPU kernels ran, not the Triton-style ones
    assert "sbd_flash_fwd" not in jaxpr
    assert abs(float(lp) - float(lx)) <= 1e-5 * abs(float(lx))
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(gp), jax.tree.leaves(gp),
                          jax.tree.leaves(gx)):
        assert np.isfinite(np.asarray(a)).all(), path[0]
        assert rel(a, b) <= 1e-4, (jax.tree_util.keystr(path[0]), rel(a, b))

    # cached decode: ragged prompts + a block of masks over an empty cache, then the finished
    # block (clean) + the next block of masks: the decode kernel over (cache, window) parts
    S, P = 64, 40
    lengths = np.array([33, 40])
    ppos = np.broadcast_to(np.arange(P), (2, P))
    pseg = (ppos < lengths[:, None]).astype(np.int32)
    bpos = lengths[:, None] + np.arange(k)[None]
    meta1 = concat_meta(clean_meta(pseg, ppos),
                        copy_meta(np.ones((2, k)), bpos, np.broadcast_to(lengths[:, None], (2, k))))
    tokens1 = np.concatenate([rng.integers(0, 62, (2, P)), np.full((2, k), CFG.mask_token_id)],
                             1).astype(np.int32)
    meta2 = concat_meta(clean_meta(np.ones((2, k)), bpos),
                        copy_meta(np.ones((2, k)), bpos + k,
                                  np.broadcast_to(lengths[:, None] + k, (2, k))))
    outs = {}
    for name, cfg in (("xla", CFG), ("tpu", PALLAS)):
        fwd = jax.jit(lambda p, t, m, c, cfg=cfg: sbd_jax.forward(p, cfg, t, m, c))  # fresh jit
        with force_backend("tpu", interpret=True):
            cache = init_cache(cfg, 2, S)
            logits1, cache = fwd(PARAMS, tokens1, meta1, cache)
            block = np.asarray(jnp.argmax(logits1[:, P:], axis=-1), np.int32)
            tokens2 = np.concatenate([block, np.full((2, k), CFG.mask_token_id, np.int32)], 1)
            logits2, cache = fwd(PARAMS, tokens2, meta2, cache)
        outs[name] = (logits1, block, logits2, cache)
    (l1x, bx, l2x, cx), (l1p, bp, l2p, cp) = outs["xla"], outs["tpu"]
    valid1 = np.concatenate([pseg, np.ones((2, k), np.int32)], 1) > 0
    assert rel(np.asarray(l1p)[valid1], np.asarray(l1x)[valid1]) <= 1e-4
    assert rel(l2p, l2x) <= 1e-4
    np.testing.assert_array_equal(bp, bx)
    assert rel(cp.k, cx.k) <= 1e-4 and rel(cp.v, cx.v) <= 1e-4


# ----------------------------------------------------------------------------------------------
# options


def test_backend_choice_and_block_rules():
    assert PallasOptions(backend="tpu").resolved().interpret is False
    assert PallasOptions().resolved().backend == "interpret"  # CPU default unchanged
    with force_backend("tpu", interpret=True):
        opts = PallasOptions().resolved()
        assert (opts.backend, opts.interpret, opts.blocks) == ("tpu", True, DEFAULT_BLOCKS["tpu"])
        # an explicit backend wins over the forced one
        assert PallasOptions(backend="interpret").resolved().backend == "interpret"
    assert PallasOptions().resolved().backend == "interpret"  # restored
    with pytest.raises(PallasOptionsError, match="backend must be one of"):
        with force_backend("cuda"):
            pass
    # defaults obey Mosaic's rules; small tiles are refused unless interpreting
    from sbd_jax.attention.pallas.options import check_tpu_blocks
    check_tpu_blocks(PallasOptions(backend="tpu").resolved())
    check_tpu_blocks(PallasOptions(backend="tpu", interpret=True, blocks=SMALL).resolved())
    meta = doubled_meta([[9]], 9, k=3)
    q, k, v, _ = qkv(jax.random.PRNGKey(9), 1, 18, 18, 4, 2, 16, jnp.float32)
    with pytest.raises(PallasOptionsError, match="multiple of 128"):
        pallas_attention(q, k, v, meta, meta, backend="tpu", blocks=SMALL)
    with pytest.raises(PallasOptionsError, match="must be >= 16"):
        pallas_attention(q, k, v, meta, meta, backend="tpu",
                         blocks=dataclasses.replace(DEFAULT_BLOCKS["tpu"], decode_block_rows=8))
    with pytest.raises(PallasOptionsError, match="tiles >= 8"):
        pallas_attention(q, k, v, meta, meta, backend="tpu", interpret=True,
                         blocks=BlockSizes(4, 4, 4, 4, 4, 4))


def test_plan_axis_tiles_divide_the_padded_length():
    assert plan_axis(300, 256, 512) == (512, (256, 512))  # 512 covers the padded axis: full dim
    assert plan_axis(46, 16, 32) == (64, (16, 32))
    assert plan_axis(10, 256) == (16, (16,))  # short axis: one tile = whole padded axis
    assert plan_axis(10, 256, align=128) == (128, (128,))  # ... lane-aligned
    assert plan_axis(400, 512, 256, align=128) == (512, (512, 256))
    assert plan_axis(1000, 128, 256) == (1024, (128, 256))
