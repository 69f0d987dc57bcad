"""Whole model with attention_impl="pallas" vs "xla", for both kernel families (the `backend`
fixture; "tpu" forces the Mosaic-TPU kernels in TPU interpret mode): same training loss and
gradients on the doubled [x ; x_hat] sequence, same logits, greedy tokens and KV cache through
cached SBD decode windows."""
import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import sbd_jax
from sbd_jax.attention import clean_meta, concat_meta, copy_meta
from layouts import training_meta
from sbd_jax.attention.pallas import force_backend
from sbd_jax.models import init_cache

CFG = sbd_jax.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, mask_token_id=63, attention_impl="xla")
PALLAS = dataclasses.replace(CFG, attention_impl="pallas")
PARAMS = sbd_jax.init_params(CFG, jax.random.key(0), std=0.2)
KERNELS = {"triton": ("sbd_flash_fwd", "sbd_flash_dq", "sbd_flash_dkv"),
           "tpu": ("sbd_tpu_flash_fwd", "sbd_tpu_flash_dq", "sbd_tpu_flash_dkv")}


def forced(backend):
    """Where options with backend=None resolve to `backend`'s kernels: trace jitted calls inside."""
    return force_backend("tpu", interpret=True) if backend == "tpu" else contextlib.nullcontext()


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _loss_fn(cfg):
    @jax.jit
    def loss_and_grads(params, tokens, meta, labels, weights):
        def loss(p):
            logits, _ = sbd_jax.forward(p, cfg, tokens, meta)
            logp = jax.nn.log_softmax(logits, axis=-1)
            nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
            return jnp.sum(nll * weights) / jnp.sum(weights)
        return jax.value_and_grad(loss)(params)
    return loss_and_grads


def test_training_loss_and_grads_match_xla(backend):
    # two rows of L = 19 (not a multiple of k = 4 nor of the 32-token tile): row 0 packs two
    # documents and padding, row 1 is one document
    L, k = 19, 4
    rng = np.random.default_rng(0)
    meta = training_meta([[8, 8], [L]], L, k)
    seg = np.asarray(meta.segment[:, :L])
    x = rng.integers(0, 62, (2, L)).astype(np.int32)
    masked = rng.random((2, L)) < 0.5
    tokens = np.concatenate([x, np.where(masked, CFG.mask_token_id, x)], axis=1)
    labels = np.concatenate([np.roll(x, -1, axis=1), x], axis=1)  # NTP on clean, MATP on copy
    weights = np.concatenate([seg > 0, (seg > 0) & masked], axis=1).astype(np.float32)

    lx, gx = _loss_fn(CFG)(PARAMS, tokens, meta, labels, weights)
    with forced(backend):
        loss_fn = _loss_fn(PALLAS)  # a fresh jit: traced here
        jaxpr = str(jax.make_jaxpr(loss_fn)(PARAMS, tokens, meta, labels, weights))
        lp, gp = loss_fn(PARAMS, tokens, meta, labels, weights)
    for name in KERNELS[backend]:
        assert name in jaxpr  # the backend's kernels ran, not the other family's
    other, = set(KERNELS) - {backend}
    assert KERNELS[other][0] not in jaxpr
    assert abs(float(lp) - float(lx)) <= 1e-5 * abs(float(lx))
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(gp), jax.tree.leaves(gp),
                          jax.tree.leaves(gx)):
        assert np.isfinite(np.asarray(a)).all(), path[0]
        assert rel(a, b) <= 1e-4, (jax.tree_util.keystr(path[0]), rel(a, b))


def test_compact_copy_stream_training_loss_matches_xla(backend):
    """The train step's layout with a compact copy stream (data.copy_len: responses only, L + C tokens)
    and the clean-prefix attention split: the Pallas kernel's loss and gradients equal XLA's."""
    from sbd_jax.training.examples import PackedBatch, build_sbd_example
    from sbd_jax.training.loss import combine, loss_sums
    from sbd_jax.training.spec import ExampleSpec
    L, C, k = 24, 14, 4
    rng = np.random.default_rng(1)
    seg = np.zeros((2, L), np.int32)
    pos = np.zeros((2, L), np.int32)
    lm = np.zeros((2, L), np.int32)
    seg[0, :11], pos[0, :11], lm[0, 5:11] = 1, np.arange(11), 1   # prompt 5, response 6
    seg[0, 11:22], pos[0, 11:22], lm[0, 14:22] = 2, np.arange(11), 1  # prompt 3, response 8
    seg[1], pos[1], lm[1, 10:] = 1, np.arange(L), 1  # prompt 10, response 14 = C
    batch = PackedBatch(*(jnp.asarray(a) for a in (rng.integers(0, 62, (2, L)) * (seg > 0), seg, pos, lm)))
    masked = jnp.asarray((rng.random((2, L)) < 0.5) & (lm > 0))
    ex = build_sbd_example(batch, masked, jnp.int32(k), ExampleSpec(CFG.mask_token_id, block_align="response", copy_len=C))
    assert ex.tokens.shape == (2, L + C) and float(ex.matp_weight.sum()) > 4

    def run(cfg):
        f = lambda p: combine(loss_sums(p, cfg, ex, clean_prefix=L))
        return jax.jit(jax.value_and_grad(f))(PARAMS)
    lx, gx = run(CFG)
    with forced(backend):
        lp, gp = run(PALLAS)
    assert abs(float(lp) - float(lx)) <= 1e-5 * abs(float(lx))
    for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(gx)):
        assert rel(a, b) <= 1e-4


def test_cached_decode_windows_match_xla(backend):
    """Step 1: ragged prompts (clean) + the first block of k mask tokens (copy) over an empty
    cache. Step 2: the finished block as clean queries + the next block of masks (2k queries).
    Both steps run the decode kernel (few queries, cache in front); with the Triton-style
    interpret-mode tiles (32) and 2 splits, step 2's programs each accumulate more than one key tile."""
    k, S, P = 4, 64, 40
    rng = np.random.default_rng(1)
    lengths = np.array([33, 40])
    ppos = np.broadcast_to(np.arange(P), (2, P))
    pseg = (ppos < lengths[:, None]).astype(np.int32)
    bpos = lengths[:, None] + np.arange(k)[None]
    meta1 = concat_meta(clean_meta(pseg, ppos),
                        copy_meta(np.ones((2, k)), bpos, np.broadcast_to(lengths[:, None], (2, k))))
    tokens1 = np.concatenate([rng.integers(0, 62, (2, P)), np.full((2, k), CFG.mask_token_id)], 1)
    meta2 = concat_meta(clean_meta(np.ones((2, k)), bpos),
                        copy_meta(np.ones((2, k)), bpos + k, np.broadcast_to(lengths[:, None] + k, (2, k))))

    outs = {}
    for name, cfg in (("xla", CFG), ("pallas", PALLAS)):
        fwd = jax.jit(sbd_jax.forward, static_argnums=1)  # a fresh jit: traced inside `forced`
        with forced(backend):
            cache = init_cache(cfg, 2, S)
            logits1, cache = fwd(PARAMS, cfg, tokens1.astype(np.int32), meta1, cache)
            block = np.asarray(jnp.argmax(logits1[:, P:], axis=-1), np.int32)  # greedy, whole block
            tokens2 = np.concatenate([block, np.full((2, k), CFG.mask_token_id, np.int32)], 1)
            logits2, cache = fwd(PARAMS, cfg, tokens2, meta2, cache)
        outs[name] = (logits1, block, logits2, np.asarray(jnp.argmax(logits2, -1)), cache)

    (l1x, bx, l2x, tx, cx), (l1p, bp, l2p, tp, cp) = outs["xla"], outs["pallas"]
    valid1 = np.concatenate([pseg, np.ones((2, k), np.int32)], 1) > 0
    assert rel(np.asarray(l1p)[valid1], np.asarray(l1x)[valid1]) <= 1e-4
    assert rel(l2p, l2x) <= 1e-4
    np.testing.assert_array_equal(bp, bx)
    np.testing.assert_array_equal(tp, tx)
    np.testing.assert_array_equal(np.asarray(cp.lengths), lengths + k)
    assert rel(cp.k, cx.k) <= 1e-4 and rel(cp.v, cx.v) <= 1e-4
