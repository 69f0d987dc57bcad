"""Pallas SBD attention kernels against `reference_attention`, the oracle, for both kernel families
(the `backend` fixture, conftest.py):
  "triton": the Triton-style kernels, in Pallas interpret mode on CPU (compiled through Triton on a
            GPU: bench/gpu_run.sh runs this file there);
  "tpu":    the Mosaic-TPU kernels in TPU interpret mode (`pltpu.InterpretParams()`: simulated
            VMEM/SMEM, DMAs and scalar prefetch; uninitialised memory and reads past an array's end
            are NaN). Compilation for a real TPU: see test_pallas_lowering.py.
Outputs and gradients, float32 (<= 1e-4 relative) and
bfloat16 (<= 2e-2 relative), lengths that are not multiples of the tile or of k, packed segments,
padding, ragged cache lengths, GQA/MQA, both TPU activation layouts (head_dim 128: read in place;
other head dims: a transposed copy), exact tile skipping, options and input validation.

Relative error = max|got - want| / max|want| per tensor.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbd_jax.attention import TokenMeta, clean_meta, concat_meta, dense_mask, reference_attention
from layouts import decode_meta, random_qkv, training_meta
from sbd_jax.attention.pallas import (
    DEFAULT_BLOCKS,
    BlockSizes,
    PallasAttentionError,
    PallasOptions,
    PallasOptionsError,
    choose_kernel,
    force_backend,
    pallas_attention,
    pallas_attention_parts,
)
from sbd_jax.attention.pallas.options import default_backend
from sbd_jax.attention.pallas.tiling import compact_tiles, tile_visibility
from sbd_jax.attention.pallas.tpu_common import plan_axis

# pallas_attention keywords per kernel family
BACKENDS = {"triton": {}, "tpu": {"backend": "tpu", "interpret": True}}
# small tiles so that every test crosses several tiles; 16 is the smallest Triton-legal tile (the
# TPU-legal defaults are exercised by test_tpu_legal_tiles and the lowering tests)
BLOCKS = BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=32, decode_block_k=16,
                    decode_block_rows=16, num_splits=3)
MID = BlockSizes(block_q=32, block_k=32, block_q_dkv=32, block_k_dkv=32, decode_block_k=32,
                 decode_block_rows=32, num_splits=2)  # fewer interpreted grid steps
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}


def blocks_for(backend):
    """BLOCKS for the Triton family; MID on TPU, where each interpreted grid step is slow (the inputs are
    sized so that 32-token tiles still cross several tiles and leave a partial last one)."""
    return MID if backend == "tpu" else BLOCKS


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def decode_case(lengths, S, k, done=()):
    """(q_meta, kv_meta = cache slots ; window keys) of `decode_meta`."""
    q_meta, cache_meta, window_meta = decode_meta(lengths, S, k, done)
    return q_meta, concat_meta(cache_meta, window_meta)


@functools.partial(jax.jit, static_argnames=("impl", "kernel", "blocks", "grads"))
def run(q, k, v, w, q_meta, kv_meta, impl, kernel="auto", blocks=BLOCKS, grads=True):
    """Output (and dq, dk, dv for the output cotangent w) of the "xla" reference or a backend's
    kernels, jitted."""
    if impl == "xla":
        fn = lambda q, k, v: reference_attention(q, k, v, q_meta, kv_meta)
    else:
        fn = lambda q, k, v: pallas_attention(q, k, v, q_meta, kv_meta, kernel=kernel, blocks=blocks,
                                              **BACKENDS[impl])
    if not grads:
        return (fn(q, k, v),)
    o, vjp = jax.vjp(fn, q, k, v)
    return (o, *vjp(w))


def check_parity(backend, q, k, v, w, q_meta, kv_meta, kernel, tol, grads=True, blocks=BLOCKS):
    want = run(q, k, v, w, q_meta, kv_meta, "xla", grads=grads)
    got = run(q, k, v, w, q_meta, kv_meta, backend, kernel, blocks, grads)
    for name, g, r in zip(("o", "dq", "dk", "dv"), got, want):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert np.isfinite(np.asarray(g, np.float32)).all(), name
        assert rel(g, r) <= tol, (name, rel(g, r))
    return got


# ----------------------------------------------------------------------------------------------
# training kernels


# GQA (head_dim 16) and MQA (head_dim 128): both head mappings and, on TPU, both activation layouts (the query ->
# KV head index is the same function in either layout: tpu_common.HeadsLayout.spec only places (b, n, t))
@pytest.mark.parametrize("H,K,D", [(4, 2, 16), (2, 1, 128)], ids=["gqa-d16", "mqa-d128"])
def test_train_kernel_f32_outputs_and_grads(backend, H, K, D):
    # L = 23: 2L = 46 is not a multiple of the 16/32 tiles, 23 not a multiple of k = 4; row 0 packs
    # two documents + padding, row 1 one document. On TPU, D = 128 takes the in-place
    # [B, T, N * D] layout, D = 16 the transposed one.
    meta = training_meta([[10, 9], [23]], 23, k=4)
    q, k, v, w = random_qkv(jax.random.PRNGKey(0), 2, 46, 46, H, K, D, jnp.float32)
    o = check_parity(backend, q, k, v, w, meta, meta, "train", TOL[jnp.float32], blocks=blocks_for(backend))[0]
    # padding tokens (row 0, positions 19..22 of each half) attend nothing -> zeros
    assert np.all(np.asarray(o)[0, 19:23] == 0) and np.all(np.asarray(o)[0, 42:46] == 0)


def test_train_kernel_bf16_outputs_and_grads(backend):
    meta = training_meta([[7, 12, 5], [20]], 27, k=3)
    q, k, v, w = random_qkv(jax.random.PRNGKey(1), 2, 54, 54, 4, 2, 32, jnp.bfloat16)
    check_parity(backend, q, k, v, w, meta, meta, "train", TOL[jnp.bfloat16], blocks=blocks_for(backend))


def test_tpu_legal_tiles():
    """Tiles that satisfy Mosaic's block rules (the same options without interpret pass the
    checks): 128-row query tiles, 256-lane key tiles (lane-tiled metadata), several tiles per axis,
    head_dim 128."""
    blocks = BlockSizes(block_q=128, block_k=256, block_q_dkv=128, block_k_dkv=128,
                        decode_block_k=128, decode_block_rows=128, num_splits=2)
    PallasOptions(backend="tpu", blocks=blocks).resolved()
    meta = training_meta([[150]], 150, k=16)  # 300 tokens: 3 query tiles, 2 key tiles
    q, k, v, w = random_qkv(jax.random.PRNGKey(2), 1, 300, 300, 2, 1, 128, jnp.float32)
    check_parity("tpu", q, k, v, w, meta, meta, "train", TOL[jnp.float32], blocks=blocks)


def test_decode_kernel_on_training_layout(backend):
    """Both kernels take any metadata: the decode kernel on the doubled training sequence; in one split (the
    partial results are not merged)."""
    meta = training_meta([[10, 9], [23]], 23, k=4)
    q, k, v, w = random_qkv(jax.random.PRNGKey(2), 2, 46, 46, 4, 2, 16, jnp.float32)
    blocks = dataclasses.replace(blocks_for(backend), num_splits=1)
    check_parity(backend, q, k, v, w, meta, meta, "decode", 1e-4, grads=False, blocks=blocks)


# ----------------------------------------------------------------------------------------------
# decode kernel


@pytest.mark.parametrize("H,K,dtype", [(4, 2, jnp.float32), (4, 1, jnp.bfloat16)], ids=["gqa-f32", "mqa-bf16"])
def test_decode_kernel_ragged_cache(backend, H, K, dtype):
    # k = 5 (2k = 10 queries), cache S = 50 (+10 window keys = 60, not a multiple of the 16 tile:
    # on TPU the last block overhangs the array, read as NaN, masked and zeroed); ragged lengths,
    # one finished row (window = padding), 3 splits.
    S, kb = 50, 5
    q_meta, kv_meta = decode_case([37, 12, 20], S, kb, done=[2])
    q, k, v, w = random_qkv(jax.random.PRNGKey(3), 3, 2 * kb, S + 2 * kb, H, K, 16, dtype)
    assert choose_kernel(2 * kb, S + 2 * kb, PallasOptions()) == "decode"
    # gradients through the decode forward + the flash backward kernels on this layout (same rows, heads, cache and
    # window): test_parts_match_concatenated_reference, whose backward is this kernel's (the parts concatenated)
    o = check_parity(backend, q, k, v, w, q_meta, kv_meta, "decode", TOL[dtype], grads=False)[0]
    assert np.all(np.asarray(o, np.float32)[2] == 0)


def test_train_kernel_on_decode_layout_mha(backend):
    q_meta, kv_meta = decode_case([37, 12, 20], 50, 5, done=[2])
    q, k, v, w = random_qkv(jax.random.PRNGKey(4), 3, 10, 60, 2, 2, 16, jnp.float32)
    check_parity(backend, q, k, v, w, q_meta, kv_meta, "train", 1e-4, grads=False)


def test_decode_splits_do_not_change_result(backend, num_splits=8):
    """More splits than visible tiles (empty splits) agree with the reference (one split, no merge:
    test_decode_kernel_on_training_layout)."""
    q_meta, kv_meta = decode_case([70, 3], 80, 4)
    q, k, v, w = random_qkv(jax.random.PRNGKey(5), 2, 8, 88, 8, 2, 16, jnp.float32)
    blocks = BlockSizes(16, 16, 16, 16, 16, decode_block_rows=64, num_splits=num_splits)
    check_parity(backend, q, k, v, w, q_meta, kv_meta, "decode", 1e-4, grads=False, blocks=blocks)


# the Triton family has no head_dim-dependent layout: one case with a full, a ragged and a finished row
@pytest.mark.parametrize("backend,lengths,done,D,grads", [("triton", [45, 12, 20], [2], 128, True),
                                                          ("tpu", [37, 12, 20], [2], 16, True),
                                                          ("tpu", [45, 12], [], 128, False)],
                         ids=["triton-full-ragged-d128", "tpu-ragged-d16", "tpu-full-d128"])
def test_parts_match_concatenated_reference(backend, lengths, done, D, grads):
    """`pallas_attention_parts` on [(cache, 50 slots), (window, 10 keys)], with gradients, equals
    the reference over the concatenation. Ragged rows; in the "full" cases row 0 fills the cache
    (45 + 5 = 50 slots): on TPU the cache is read in place through the [B, S, K * D] view and its
    overhanging last tile is visible, so its NaN tail must be zeroed (50 slots: a multiple of neither the 16 nor
    the 32 tiles). That is the decode forward's: the backward (the flash kernels over the concatenated parts,
    split back per part) is the same for every layout of the parts and is checked in "tpu-ragged-d16"; its
    head_dim-128 (in-place) layout by test_train_kernel_f32_outputs_and_grads[tpu-mqa-d128] and test_tpu_legal_tiles."""
    S, kb = 50, 5
    q_meta, cache_meta, win_meta = decode_meta(lengths, S, kb, done)
    kv_meta = concat_meta(cache_meta, win_meta)
    q, k, v, w = random_qkv(jax.random.PRNGKey(10), len(lengths), 2 * kb, S + 2 * kb, 4, 2, D, jnp.float32)

    @jax.jit
    def parts_out_and_grads(q, k, v, w):
        def fn(q, k, v):
            parts = [(k[:, :S], v[:, :S], cache_meta), (k[:, S:], v[:, S:], win_meta)]
            return pallas_attention_parts(q, parts, q_meta, blocks=blocks_for(backend), **BACKENDS[backend])
        if not grads:
            return (fn(q, k, v),)
        o, vjp = jax.vjp(fn, q, k, v)
        return (o, *vjp(w))

    got = parts_out_and_grads(q, k, v, w)
    want = run(q, k, v, w, q_meta, kv_meta, "xla", grads=grads)
    assert len(got) == len(want) == (4 if grads else 1)
    for name, g, r in zip(("o", "dq", "dk", "dv"), got, want):
        assert rel(g, r) <= 1e-4, (name, rel(g, r))


# ----------------------------------------------------------------------------------------------
# tile skipping


def test_decode_never_reads_cache_tiles_past_the_lengths(backend):
    """NaN in every cache tile past each row's length: the kernel must not read them (a read tile
    multiplies its V by p = 0, and 0 * NaN = NaN would reach the output)."""
    S, kb, bk = 88, 4, BLOCKS.decode_block_k  # S + 2k = 96: no shifted last tile re-reading
                                              # poisoned columns
    q_meta, cache_meta, win_meta = decode_meta([41, 9], S, kb)
    kv_meta = concat_meta(cache_meta, win_meta)
    q, k, v, w = random_qkv(jax.random.PRNGKey(6), 2, 2 * kb, S + 2 * kb, 4, 2, 16, jnp.float32)
    want = run(q, k, v, w, q_meta, kv_meta, "xla", grads=False)[0]
    new_len = np.asarray(cache_meta.segment).sum(axis=1)
    first_dead = -(-new_len // bk) * bk  # first slot of the first all-invisible tile
    cols = np.arange(S + 2 * kb)[None]
    dead = (cols >= first_dead[:, None]) & (cols < (S // bk) * bk)  # not the window's tile
    assert dead.sum(axis=1).min() >= 2 * bk
    poison = jnp.asarray(dead)[:, :, None, None]
    kp, vp = jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v)
    got = run(q, kp, vp, w, q_meta, kv_meta, backend, "decode", grads=False)[0]
    assert np.isfinite(np.asarray(got)).all()
    assert rel(got, want) <= 1e-4


def test_train_never_reads_padding_tiles(backend):
    """NaN q/k/v in whole padding tiles: forward and gradients of the real tokens are unaffected
    (the masked tiles are neither read nor computed: 0 * NaN would leak)."""
    T, real = 64, 30  # tiles [32, 64) are all padding
    pos = np.broadcast_to(np.arange(T), (2, T))
    meta = clean_meta((pos < real).astype(np.int32), pos)
    q, k, v, w = random_qkv(jax.random.PRNGKey(7), 2, T, T, 4, 2, 16, jnp.float32)
    want = run(q, k, v, w, meta, meta, "xla")
    bad = jnp.asarray(pos >= 32)[:, :, None, None]
    q, k, v = (jnp.where(bad, jnp.nan, x) for x in (q, k, v))
    got = run(q, k, v, w, meta, meta, backend, "train", blocks_for(backend))
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
    meta = training_meta([[256]], 256, k=k)
    vis = np.asarray(tile_visibility(meta, meta, 16, 16))[0]
    assert vis.sum() == expected
    assert not vis[:16, 16:].any()  # clean queries never see copy tiles
    np.testing.assert_array_equal(vis[16:, 16:], np.eye(16, dtype=bool))


def test_plan_axis_tiles_divide_the_padded_length():
    assert plan_axis(300, 256, 512) == (512, (256, 512))  # 512 covers the padded axis: full dim
    assert plan_axis(46, 16, 32) == (64, (16, 32))
    assert plan_axis(10, 256) == (16, (16,))  # short axis: one tile = whole padded axis
    assert plan_axis(10, 256, align=128) == (128, (128,))  # ... lane-aligned
    assert plan_axis(400, 512, 256, align=128) == (512, (512, 256))
    assert plan_axis(1000, 128, 256) == (1024, (128, 256))


# ----------------------------------------------------------------------------------------------
# API: kernel choice, backends, options, validation


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
    assert PallasOptions(backend="tpu").resolved().backend == "tpu"
    assert PallasOptions(backend="tpu").resolved().interpret is False


def test_force_backend():
    default = PallasOptions().resolved().backend
    with force_backend("tpu", interpret=True):
        opts = PallasOptions().resolved()
        assert (opts.backend, opts.interpret, opts.blocks) == ("tpu", True, DEFAULT_BLOCKS["tpu"])
        # an explicit backend wins over the forced one
        assert PallasOptions(backend="interpret").resolved().backend == "interpret"
    assert PallasOptions().resolved().backend == default  # restored
    with pytest.raises(PallasOptionsError, match="backend must be one of"):
        with force_backend("cuda"):
            pass


def test_bad_inputs_raise_clear_errors():
    meta = training_meta([[9]], 9, k=3)
    q, k, v, _ = random_qkv(jax.random.PRNGKey(9), 1, 18, 18, 4, 2, 16, jnp.float32)
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
    # TPU: the defaults obey Mosaic's block rules; small tiles are refused unless interpreting
    PallasOptions(backend="tpu").resolved()
    PallasOptions(backend="tpu", interpret=True, blocks=BLOCKS).resolved()
    with pytest.raises(PallasOptionsError, match="multiple of 128"):
        pallas_attention(q, k, v, meta, meta, backend="tpu", blocks=BLOCKS)
    with pytest.raises(PallasOptionsError, match="must be >= 16"):
        pallas_attention(q, k, v, meta, meta, backend="tpu",
                         blocks=dataclasses.replace(DEFAULT_BLOCKS["tpu"], decode_block_rows=8))
    with pytest.raises(PallasOptionsError, match="tiles >= 8"):
        pallas_attention(q, k, v, meta, meta, backend="tpu", interpret=True,
                         blocks=BlockSizes(4, 4, 4, 4, 4, 4))
