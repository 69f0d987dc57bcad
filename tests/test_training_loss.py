"""The dual loss against an independent slow reference: numpy (float64) builds the doubled sequence,
its dense attention mask straight from docs/sbd.md (Training, rule 4), runs a numpy Llama forward and loops over
tokens for the cross-entropies. Tolerance: relative 2e-5 on each term (float32 model vs float64)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbd_jax.models.config import ModelConfig
from sbd_jax.models import init_params, param_shapes
from sbd_jax.training.examples import (
    PackedBatch,
    build_ntp_example,
    build_sbd_example,
    sample_masked,
)
from sbd_jax.training.loss import auto_chunk, sbd_loss
from sbd_jax.training.spec import ExampleSpec

M = 5
CFG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-6, mask_token_id=M)


def _batch():
    """2 rows of L=20: row 0 = docs of 12 and 6 tokens + 2 padding; row 1 = SFT (prompt 5, response 9) + 6 text."""
    rng = np.random.default_rng(3)
    tok = rng.integers(6, 48, (2, 20))
    seg = np.array([[1] * 12 + [2] * 6 + [0] * 2, [1] * 14 + [2] * 6])
    pos = np.array([list(range(12)) + list(range(6)) + [0, 0], list(range(14)) + list(range(6))])
    lm = np.array([[1] * 18 + [0] * 2, [0] * 5 + [1] * 15])
    tok = tok * (seg > 0)
    return tok, seg, pos, lm


# ---------------------------------------------------------------------------------------------- reference


def _ref_doubled(tok, seg, pos, masked, k):
    """numpy: [x ; x_hat], duplicated positions, stream ids, and the docs/sbd.md mask (blocks from doc start)."""
    L = len(tok)
    t2 = np.concatenate([tok, np.where(masked, M, tok)])
    p2 = np.concatenate([pos, pos])
    s2 = np.concatenate([seg, seg])
    copy = np.arange(2 * L) >= L
    mask = np.zeros((2 * L, 2 * L), bool)
    for q in range(2 * L):
        for j in range(2 * L):
            if s2[q] == 0 or s2[q] != s2[j]:
                continue
            if not copy[q]:  # clean query: clean keys with pos_j <= pos_q
                mask[q, j] = (not copy[j]) and p2[j] <= p2[q]
            else:  # copy query in block b: clean keys of earlier blocks, copy keys of block b
                b = p2[q] // k
                mask[q, j] = (p2[j] < b * k) if not copy[j] else (p2[j] // k == b)
    return t2, p2, mask


def _np_forward(P, cfg, tokens, positions, mask):
    f = lambda a: np.asarray(a, np.float64)
    H, K, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, Dh, 2) / Dh))
    ang = positions[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rope(x):
        x1, x2 = x[..., :Dh // 2], x[..., Dh // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps) * w

    lay = {k: f(v) for k, v in P["layers"].items()}
    h = f(P["embed"])[tokens]
    for i in range(cfg.num_hidden_layers):
        x = norm(h, lay["attn_norm"][i])
        q = rope(np.einsum("td,dhk->thk", x, lay["wq"][i]))
        kk = rope(np.einsum("td,dhk->thk", x, lay["wk"][i]))
        v = np.einsum("td,dhk->thk", x, lay["wv"][i])
        kk, v = np.repeat(kk, H // K, axis=1), np.repeat(v, H // K, axis=1)
        s = np.einsum("thd,shd->hts", q, kk) / np.sqrt(Dh)
        s = np.where(mask[None], s, -np.inf)
        mx = np.max(s, -1, keepdims=True)
        p = np.where(mask[None], np.exp(s - np.where(np.isfinite(mx), mx, 0)), 0.0)
        p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
        h = h + np.einsum("thd,hde->te", np.einsum("hts,shd->thd", p, v), lay["wo"][i])
        x = norm(h, lay["mlp_norm"][i])
        g = x @ lay["w_gate"][i]
        h = h + (g / (1 + np.exp(-g)) * (x @ lay["w_up"][i])) @ lay["w_down"][i]
    return norm(h, f(P["final_norm"])) @ f(P["lm_head"])


def _ce(logits, t):
    m = logits.max()
    return np.log(np.sum(np.exp(logits - m))) + m - logits[t]


def reference_losses(P, cfg, tok, seg, pos, lm, masked, k):
    ntp, matp = [], []
    L = tok.shape[1]
    for b in range(tok.shape[0]):
        t2, p2, mask = _ref_doubled(tok[b], seg[b], pos[b], masked[b], k)
        logits = _np_forward(P, cfg, t2, p2, mask)
        for i in range(L):
            if seg[b, i] > 0 and i + 1 < L and seg[b, i + 1] == seg[b, i] and lm[b, i + 1]:
                ntp.append(_ce(logits[i], tok[b, i + 1]))
            if masked[b, i]:
                matp.append(_ce(logits[L + i], tok[b, i]))
    return np.mean(ntp), np.mean(matp), len(ntp), len(matp)


# ---------------------------------------------------------------------------------------------- tests


def np_params(cfg, seed=0, std=0.02):
    """Random params drawn on the host (compiling jax.random for every leaf is slow on a busy CPU);
    norm weights ~ 1."""
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        base = 1.0 if path[-1].key.endswith("norm") else 0.0
        return jnp.asarray(base + rng.normal(0, std, shape), jnp.float32)
    return jax.tree.map_with_path(leaf, param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))


_loss = jax.jit(lambda p, e: sbd_loss(p, CFG, e))


@pytest.fixture(scope="module")
def setup():
    params = np_params(CFG, std=0.15)
    tok, seg, pos, lm = _batch()
    batch = PackedBatch(*(jnp.asarray(a, jnp.int32) for a in (tok, seg, pos, lm)))
    masked = np.asarray(jax.jit(sample_masked)(jax.random.PRNGKey(7), batch))
    return params, batch, masked


@pytest.mark.parametrize("k", [3, 4])
def test_loss_matches_slow_reference(setup, k):
    params, batch, masked = setup
    ex = build_sbd_example(batch, jnp.asarray(masked), jnp.int32(k), ExampleSpec(M))
    loss, m = _loss(params, ex)
    r_ntp, r_matp, n_ntp, n_matp = reference_losses(params, CFG, *(np.asarray(a) for a in batch), masked, k)
    assert n_matp > 4 and int(m["matp_tokens"]) == n_matp and int(m["ntp_tokens"]) == n_ntp
    np.testing.assert_allclose(float(m["ntp_loss"]), r_ntp, rtol=2e-5)
    np.testing.assert_allclose(float(m["matp_loss"]), r_matp, rtol=2e-5)
    np.testing.assert_allclose(float(loss), r_ntp + r_matp, rtol=2e-5)


def test_reference_is_sensitive_to_k_and_positions(setup):
    """Guard: the comparison above would fail with another block size (the mask matters)."""
    params, batch, masked = setup
    ex = build_sbd_example(batch, jnp.asarray(masked), jnp.int32(4), ExampleSpec(M))
    _, m = _loss(params, ex)
    _, r_matp3, _, _ = reference_losses(params, CFG, *(np.asarray(a) for a in batch), masked, 3)
    assert abs(float(m["matp_loss"]) - r_matp3) > 1e-3


@pytest.fixture(scope="module")
def grads(setup):
    """One compiled function: per-term gradients (unchunked) and the chunked loss's value and gradient."""
    params, batch, masked = setup
    ex = build_sbd_example(batch, jnp.asarray(masked), jnp.int32(4), ExampleSpec(M))

    def terms(p):
        _, m = sbd_loss(p, CFG, ex)
        return jnp.stack([m["ntp_loss"], m["matp_loss"]])

    def f(p):
        per_term = jax.jacrev(terms)(p)
        chunked = jax.value_and_grad(lambda q: sbd_loss(q, CFG, ex, chunk=7)[0])(p)  # 40 = 5*7+5: padded
        return terms(p), per_term, chunked
    return jax.jit(f)(params)


def test_gradients_of_both_terms_finite_and_nonzero(grads):
    per_term = jax.device_get(grads[1])
    for i, term in enumerate(("ntp", "matp")):
        g = jax.tree.map(lambda x, i=i: x[i], per_term)
        leaves = jax.tree.leaves(g)
        assert all(np.isfinite(x).all() for x in leaves)
        assert np.sqrt(sum(np.sum(x * x) for x in leaves)) > 1e-3
        for name in ("wq", "wk", "w_down"):
            assert np.abs(g["layers"][name]).max() > 0, (term, name)
        # the <m> embedding is learned through MATP only (the clean half never contains it)
        mrow = np.abs(g["embed"][M]).max()
        assert (mrow > 0) if term == "matp" else (mrow == 0)


def test_chunked_loss_equals_full(grads):
    values, per_term, (c_loss, c_grad) = jax.device_get(grads)
    np.testing.assert_allclose(float(c_loss), float(values.sum()), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(jax.tree.map(lambda x: x.sum(0), per_term)), jax.tree.leaves(c_grad)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-7)


def test_ntp_only_equals_ntp_term_of_dual_loss(setup):
    """Clean queries never see the copy, so the dual loss's NTP term is exactly the NTP baseline's loss."""
    params, batch, masked = setup
    ex = build_sbd_example(batch, jnp.asarray(masked), jnp.int32(4), ExampleSpec(M))
    _, m_dual = _loss(params, ex)
    loss_ntp, m_ntp = _loss(params, build_ntp_example(batch))
    np.testing.assert_allclose(float(loss_ntp), float(m_dual["ntp_loss"]), rtol=1e-6)
    assert float(m_ntp["matp_tokens"]) == 0 and float(m_ntp["matp_loss"]) == 0


def full_copy_seg(batch):
    from sbd_jax.training.examples import response_start
    return jnp.where(batch.position >= response_start(batch), batch.segment, 0)


def test_compact_copy_stream_equals_the_full_layout(setup):
    """`copy_len`: the copy stream without the prompts (L + C tokens instead of 2L) gives the same losses,
    token counts and gradients as the full [x ; x_hat] layout (response-aligned blocks), also with the
    clean-prefix attention split the train step uses."""
    from sbd_jax.training.loss import combine, loss_sums
    params, batch, masked = setup
    L = batch.tokens.shape[1]
    # copy-stream tokens per row: row 0 its 18 text tokens (2 pads dropped), row 1 20 - its 5-token prompt
    assert np.asarray(full_copy_seg(batch) > 0).sum(1).tolist() == [18, 15]
    resp = ExampleSpec(M, block_align="response")
    full = build_sbd_example(batch, jnp.asarray(masked), jnp.int32(4), resp)

    def value_and_grad(ex, prefix):
        return jax.value_and_grad(lambda p: combine(loss_sums(p, CFG, ex, clean_prefix=prefix)))(params)

    f_val, f_grad = jax.jit(lambda: value_and_grad(full, None))()
    for C in (18, 20):
        ex = build_sbd_example(batch, jnp.asarray(masked), jnp.int32(4), dataclasses.replace(resp, copy_len=C))
        assert ex.tokens.shape == (2, L + C)
        assert float(ex.matp_weight.sum()) == float(full.matp_weight.sum()) > 4
        np.testing.assert_array_equal(np.sort(np.asarray(ex.targets[:, L:])[np.asarray(ex.matp_weight[:, L:]) > 0]),
                                      np.sort(np.asarray(full.targets[:, L:])[np.asarray(full.matp_weight[:, L:]) > 0]))
        for prefix in (None, L):
            val, grad = jax.jit(lambda ex=ex, prefix=prefix: value_and_grad(ex, prefix))()
            np.testing.assert_allclose(float(val), float(f_val), rtol=1e-6)
            for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(f_grad)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="copy_len .* needs sbd.block_align='response'"):
        ExampleSpec(M, block_align="document", copy_len=18)


@pytest.mark.parametrize("options", [dict(scan_unroll=2), dict(remat="full"), dict(remat="save_dots"),
                                     dict(remat="full", scan_unroll=2)], ids=str)
def test_speed_and_memory_options_change_nothing(setup, options):
    """`scan_unroll` (layers per scan iteration) and `remat` (what the backward pass recomputes) change speed
    and memory only: the same loss and gradients as the rolled loop that keeps every activation."""
    params, batch, masked = setup
    ex = build_sbd_example(batch, jnp.asarray(masked), jnp.int32(4), ExampleSpec(M))
    other = dataclasses.replace(CFG, **options)
    (v0, m0), g0 = jax.jit(jax.value_and_grad(lambda p: sbd_loss(p, CFG, ex), has_aux=True))(params)
    (v1, m1), g1 = jax.jit(jax.value_and_grad(lambda p: sbd_loss(p, other, ex), has_aux=True))(params)
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-6)
    np.testing.assert_allclose(float(m1["matp_loss"]), float(m0["matp_loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)


def test_remat_shrinks_the_backward_pass_memory():
    """XLA's buffer plan of one gradient: "full" keeps each layer's input only, "save_dots" adds the matmul
    outputs, "none" every activation; the loss chunking keeps the [B, T, V] logits out (auto above 256 MiB)."""
    cfg = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, mask_token_id=M)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    tok = jax.ShapeDtypeStruct((2, 512), jnp.int32)

    def temp_bytes(remat):
        c = dataclasses.replace(cfg, remat=remat)
        def loss(p, t):
            ex = build_ntp_example(PackedBatch(t, jnp.ones_like(t), jnp.broadcast_to(jnp.arange(512), t.shape),
                                               jnp.ones_like(t)))
            return sbd_loss(p, c, ex)[0]
        return jax.jit(jax.grad(loss)).lower(params, tok).compile().memory_analysis().temp_size_in_bytes

    none, dots, full = temp_bytes("none"), temp_bytes("save_dots"), temp_bytes("full")
    assert full < dots < none and full < 0.5 * none, (none, dots, full)
    assert auto_chunk(128256, 8192) == 1024 and auto_chunk(cfg.vocab_size, 512) == 0
