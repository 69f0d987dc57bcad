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


def test_training_layout_equals_decoding_calls():
    """The MATP logits the training loss sees (`build_sbd_example`, response-aligned [x ; x_hat], forward with
    clean_prefix) equal what the decoder computes for the same block state: the prompt (and the finished
    first block) as clean tokens in the cache, the current block as copy tokens with the same masks."""
    from sbd_jax.training.examples import PackedBatch, build_sbd_example
    from sbd_jax.training.spec import ExampleSpec
    rng = np.random.default_rng(3)
    P, R, k, L = 5, 8, 4, 16  # prompt 5, response 8 = two blocks of 4, row of 16 (3 padding)
    x = rng.integers(0, 48, P + R).astype(np.int32)
    row = np.zeros((4, 1, L), np.int32)
    row[0, 0, :P + R], row[1, 0, :P + R], row[2, 0, :P + R], row[3, 0, P:P + R] = x, 1, np.arange(P + R), 1
    masked = np.zeros((1, L), bool)
    masked[0, P:P + k] = True                      # first block fully masked (the decoder's first step)
    masked[0, P + k + 1] = masked[0, P + k + 3] = True  # second block partly decoded
    ex = build_sbd_example(PackedBatch(*(jnp.asarray(a) for a in row)), jnp.asarray(masked), jnp.int32(k),
                           ExampleSpec(CFG.mask_token_id, block_align="response"))
    train, _ = sbd_jax.forward(PARAMS, CFG, ex.tokens, ex.meta, clean_prefix=L)
    train = np.asarray(train)[0, L:]
    M = CFG.mask_token_id
    # decoder, block 1: [prompt CLEAN ; 4 masks COPY] in one call (the prompt folded into the first step)
    cache = init_cache(CFG, 1, 32)
    b1 = np.full((1, k), M, np.int32)
    meta1 = concat_meta(clean_meta(np.ones((1, P)), np.arange(P)[None]),
                        copy_meta(np.ones((1, k)), np.arange(P, P + k)[None], np.full((1, k), P)))
    got1, cache = fwd(PARAMS, CFG, np.concatenate([x[None, :P], b1], 1), meta1, cache)
    np.testing.assert_allclose(np.asarray(got1)[0, P:], train[P:P + k], atol=2e-5)
    # decoder, block 2: [finished block 1 CLEAN ; block 2 COPY with its masks] over the cached prompt
    b2 = np.where(masked[0, P + k:P + 2 * k], M, x[P + k:P + 2 * k])[None].astype(np.int32)
    meta2 = concat_meta(clean_meta(np.ones((1, k)), np.arange(P, P + k)[None]),
                        copy_meta(np.ones((1, k)), np.arange(P + k, P + 2 * k)[None], np.full((1, k), P + k)))
    got2, _ = fwd(PARAMS, CFG, np.concatenate([x[None, P:P + k], b2], 1), meta2, cache)
    np.testing.assert_allclose(np.asarray(got2)[0, k:], train[P + k:P + 2 * k], atol=2e-5)


def test_per_layer_weights_equal_the_stacked_forward():
    """`unstack_layers` (the decoders' layout: one buffer per layer, a Python loop instead of the scan) computes
    what the stacked scan computes, with and without a cache; `delete` frees the stacked buffers."""
    from sbd_jax.models import unstack_layers
    params = jax.tree.map(jnp.array, PARAMS)  # a copy: `delete` must not free the module's weights
    per_layer = unstack_layers(params, delete=True)
    assert all(x.is_deleted() for x in jax.tree.leaves(params["layers"]))
    assert len(per_layer["layers"]) == CFG.num_hidden_layers and unstack_layers(per_layer) is per_layer
    np.testing.assert_array_equal(np.asarray(per_layer["layers"][1]["wq"]), np.asarray(PARAMS["layers"]["wq"][1]))
    toks = np.random.default_rng(3).integers(0, 48, (2, 9)).astype(np.int32)
    meta = causal_meta(np.array([9, 6]), 9)
    want, _ = fwd(PARAMS, CFG, toks, meta)
    got, _ = fwd(per_layer, CFG, toks, meta)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    want_c, cache_a = fwd(PARAMS, CFG, toks, meta, init_cache(CFG, 2, 12))
    got_c, cache_b = fwd(per_layer, CFG, toks, meta, init_cache(CFG, 2, 12))
    np.testing.assert_allclose(np.asarray(got_c), np.asarray(want_c), atol=1e-5)
    np.testing.assert_allclose(np.asarray(cache_b.k), np.asarray(cache_a.k), atol=1e-5)
