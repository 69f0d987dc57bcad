"""Acceptance rules, entropies and sampling (sbd_jax.decoding.sampling) against plain numpy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbd_jax.decoding import sampling


def _np_eb(h, masked, gamma):
    idx = sorted((i for i in range(len(h)) if masked[i]), key=lambda i: (h[i], i))
    acc = np.zeros(len(h), bool)
    total = 0.0
    for s, i in enumerate(idx):
        if s > 0 and total > gamma:
            break
        acc[i] = True
        total += h[i]
    return acc


def _np_threshold(h, masked, gamma):
    idx = [i for i in range(len(h)) if masked[i]]
    acc = np.zeros(len(h), bool)
    if idx:
        best = min(idx, key=lambda i: (h[i], i))
        for i in idx:
            acc[i] = h[i] < gamma or i == best
    return acc


def test_rules_match_numpy():
    rng = np.random.default_rng(0)
    R, K = 400, 8
    h = rng.exponential(1.0, (R, K)).astype(np.float32)
    h[:50, 2] = h[:50, 5]  # exact ties: broken by position
    h[50:60] = 0.0          # all-zero entropies (one-hot predictions)
    masked = rng.random((R, K)) < 0.7
    masked[0] = False       # nothing masked -> nothing accepted
    gamma = rng.choice([0.0, 0.3, 1.0, 2.5, 10.0], R).astype(np.float32)
    eb = np.asarray(jax.jit(sampling.accept_eb)(h, masked, gamma))
    th = np.asarray(jax.jit(sampling.accept_threshold)(h, masked, gamma))
    for r in range(R):
        np.testing.assert_array_equal(eb[r], _np_eb(h[r], masked[r], gamma[r]), err_msg=f"eb row {r}")
        np.testing.assert_array_equal(th[r], _np_threshold(h[r], masked[r], gamma[r]), err_msg=f"thr row {r}")
    anym = masked.any(1)
    assert (eb.sum(1)[anym] >= 1).all() and (th.sum(1)[anym] >= 1).all()
    assert not eb[~anym].any() and not (eb & ~masked).any() and not (th & ~masked).any()
    assert 1 < eb.sum(1)[anym].mean() < masked.sum(1)[anym].mean()  # the sample is not degenerate
    # the traced rule index selects the same rules
    for rid, ref in ((0, eb), (1, th)):
        got = np.asarray(jax.jit(sampling.accept)(jnp.int32(rid), h, masked, gamma))
        np.testing.assert_array_equal(got, ref)


def test_eb_rule_worked_example():
    # sorted entropies 0.1, 0.2, 0.4, 3.0 ; gamma 0.3: prefix sums before each = 0, 0.1, 0.3, 0.7
    h = np.array([[0.4, 3.0, 0.1, 0.2]], np.float32)
    got = np.asarray(sampling.accept_eb(h, np.ones((1, 4), bool), np.array([0.3], np.float32)))
    np.testing.assert_array_equal(got[0], [True, False, True, True])  # 0.1 + 0.2 <= 0.3 -> third accepted
    got = np.asarray(sampling.accept_threshold(h, np.ones((1, 4), bool), np.array([0.3], np.float32)))
    np.testing.assert_array_equal(got[0], [False, False, True, True])


def test_entropy_matches_numpy_and_tempering():
    rng = np.random.default_rng(1)
    logits = (3 * rng.normal(size=(3, 4, 50))).astype(np.float32)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = -(p * np.log(p)).sum(-1)
    np.testing.assert_allclose(np.asarray(sampling.entropy(logits)), ref, rtol=1e-5, atol=1e-6)
    t = np.array([0.0, 0.5, 2.0], np.float32)
    got = np.asarray(sampling.entropy(logits, t, tempered=True))
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)  # T = 0 row: temperature-1 entropy
    for r in (1, 2):
        q = np.exp(logits[r] / t[r] - (logits[r] / t[r]).max(-1, keepdims=True))
        q /= q.sum(-1, keepdims=True)
        np.testing.assert_allclose(got[r], -(q * np.log(q)).sum(-1), rtol=1e-5, atol=1e-6)
    assert got[1].mean() < ref[1].mean() < got[2].mean()  # colder is sharper, hotter flatter


def test_shape_logits_top_k_top_p():
    logits = np.log(np.array([[[0.5, 0.25, 0.15, 0.1]]], np.float32))
    one = np.ones((1,), np.float32)
    keep = lambda **kw: np.isfinite(np.asarray(sampling.shape_logits(logits, one, **kw)))[0, 0]
    np.testing.assert_array_equal(keep(top_k=2), [True, True, False, False])
    np.testing.assert_array_equal(keep(top_p=0.5), [True, False, False, False])
    np.testing.assert_array_equal(keep(top_p=0.7), [True, True, False, False])
    np.testing.assert_array_equal(keep(top_p=0.8), [True, True, True, False])
    np.testing.assert_array_equal(keep(top_k=3, top_p=0.95), [True, True, True, False])
    np.testing.assert_array_equal(keep(), [True] * 4)
    # temperature divides the logits (T = 0 rows are left raw: they take the argmax)
    out = np.asarray(sampling.shape_logits(logits, np.array([2.0], np.float32)))
    np.testing.assert_allclose(out, logits / 2, rtol=1e-6)


def test_sample_greedy_distribution_and_determinism():
    rng = np.random.default_rng(2)
    V = 6
    logits = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.04, 0.01], np.float32))
    N = 4000
    lg = np.broadcast_to(logits, (2, N, V)).copy()
    keys = jax.random.split(jax.random.key(0), 2)
    step = jnp.array([0, 0])
    temp = jnp.array([0.0, 1.0])
    s = np.asarray(jax.jit(sampling.sample)(lg, keys, step, temp))
    assert (s[0] == 0).all()  # greedy row
    freq = np.bincount(s[1], minlength=V) / N
    np.testing.assert_allclose(freq, np.exp(logits), atol=0.03)
    again = np.asarray(sampling.sample(lg, keys, step, temp))
    np.testing.assert_array_equal(s, again)  # same key + step -> same draws
    other = np.asarray(sampling.sample(lg, keys, step + 1, temp))
    assert not np.array_equal(s[1], other[1])  # the step changes the stream
    # the suppressed token (the mask token) is never drawn, even when it is the argmax
    sup = np.asarray(sampling.sample(lg, keys, step, temp, suppress=0))
    assert not (sup == 0).any()
    # top-k 2 at temperature 1: only the two most likely tokens
    s2 = np.asarray(sampling.sample(lg, keys, step, jnp.array([1.0, 1.0]), top_k=2))
    assert set(np.unique(s2)) <= {0, 1}
    del rng


def test_row_keys_forms():
    k = jax.random.key(3)
    a = sampling.row_keys(k, 3)
    assert a.shape == (3,)
    b = sampling.row_keys(jax.random.key_data(k), 3)  # raw uint32[2]
    np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))
    c = sampling.row_keys(a, 3)
    np.testing.assert_array_equal(jax.random.key_data(c), jax.random.key_data(a))
    with pytest.raises(ValueError, match="per-row keys must have shape"):
        sampling.row_keys(a, 4)


def test_fast_argmax_equals_jnp_argmax_with_ties():
    rng = np.random.default_rng(4)
    x = rng.integers(0, 5, (6, 3, 40)).astype(np.float32)  # many ties: first index wins in both
    x[0, 0] = -np.inf
    x[0, 0, 7] = 1.0
    np.testing.assert_array_equal(np.asarray(sampling.argmax(x)), np.asarray(jnp.argmax(x, axis=-1)))
