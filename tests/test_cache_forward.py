"""`forward` with a KV cache == `forward` without one (the no-cache path is the brute-force reference)."""
import jax
import jax.numpy as jnp
import numpy as np

import sbd_jax
from sbd_jax.attention import clean_meta, concat_meta, copy_meta
from sbd_jax.models import causal_meta, init_cache

CFG = sbd_jax.ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, mask_token_id=49)
PARAMS = sbd_jax.init_params(CFG, jax.random.key(0), std=0.2)
fwd = jax.jit(sbd_jax.forward, static_argnums=1)


def test_chunked_prefill_with_ragged_rows_matches_full_forward():
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 48, (2, 12)).astype(np.int32)
    lengths = np.array([12, 7])
    full, _ = fwd(PARAMS, CFG, toks, causal_meta(lengths, 12))
    cache = init_cache(CFG, 2, 16)
    pos = np.broadcast_to(np.arange(12), (2, 12))
    seg = (pos < lengths[:, None]).astype(np.int32)
    a, cache = fwd(PARAMS, CFG, toks[:, :5], clean_meta(seg[:, :5], pos[:, :5]), cache)
    b, cache = fwd(PARAMS, CFG, toks[:, 5:], clean_meta(seg[:, 5:], pos[:, 5:]), cache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    chunked = np.concatenate([np.asarray(a), np.asarray(b)], axis=1)
    for r, n in enumerate(lengths):
        np.testing.assert_allclose(chunked[r, :n], np.asarray(full)[r, :n], atol=1e-5)


def test_copy_window_over_cache_matches_dense_doubled_layout():
    """Prompt of 6 clean tokens in the cache, then a block of k=4 copy tokens (2 still masked) opened at
    position 6: logits equal the no-cache forward over [prompt ; block] with the dense mask."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 48, (1, 6)).astype(np.int32)
    block = np.array([[CFG.mask_token_id, 7, CFG.mask_token_id, 9]], np.int32)
    cache = init_cache(CFG, 1, 16)
    _, cache = fwd(PARAMS, CFG, prompt, clean_meta(np.ones((1, 6)), np.arange(6)[None]), cache)
    wmeta = copy_meta(np.ones((1, 4)), np.arange(6, 10)[None], np.full((1, 4), 6))
    cached, cache2 = fwd(PARAMS, CFG, block, wmeta, cache)
    assert int(cache2.lengths[0]) == 6  # copy tokens are never committed to the cache
    meta = concat_meta(clean_meta(np.ones((1, 6)), np.arange(6)[None]), wmeta)
    dense, _ = fwd(PARAMS, CFG, np.concatenate([prompt, block], 1), meta)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(dense)[:, 6:], atol=1e-5)


def test_clean_prefix_split_attention_matches_full_square():
    """forward(clean_prefix=L) on [x ; x_hat] == the full 2L x 2L attention (values and gradients)."""
    from sbd_jax.attention import block_starts
    rng = np.random.default_rng(2)
    L = 11
    x = rng.integers(0, 48, (2, L)).astype(np.int32)
    seg = np.array([[1] * 6 + [2] * 5, [1] * 9 + [0] * 2])
    pos = np.array([list(range(6)) + list(range(5)), list(range(9)) + [0, 0]])
    meta = concat_meta(clean_meta(seg, pos), copy_meta(seg, pos, block_starts(pos, 3)))
    toks = np.concatenate([x, np.where(rng.random((2, L)) < 0.5, CFG.mask_token_id, x)], axis=1)

    def loss(p, prefix):
        logits, _ = sbd_jax.forward(p, CFG, toks, meta, clean_prefix=prefix)
        return jnp.sum(jnp.where(meta.segment[..., None] > 0, logits, 0.0) ** 2) / 1e3, logits

    (a, la), ga = jax.value_and_grad(loss, has_aux=True)(PARAMS, None)
    (b, lb), gb = jax.value_and_grad(loss, has_aux=True)(PARAMS, L)
    valid = np.asarray(meta.segment) > 0
    np.testing.assert_allclose(np.asarray(la)[valid], np.asarray(lb)[valid], atol=1e-5)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-6), ga, gb)
