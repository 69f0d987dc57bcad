"""Train step pieces on one device: gradient accumulation == one big batch, bf16 compute with float32
master weights, the LR schedule, clipping and the weight-decay mask."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sbd_jax.models.config import ModelConfig
from sbd_jax.sharding import MeshConfig, make_mesh
from sbd_jax.training.config import OptimConfig
from sbd_jax.training.optim import decay_mask, make_optimizer, make_schedule
from sbd_jax.training.step import (
    StepOptions,
    create_state,
    jit_train_step,
    make_train_step,
    put_batch,
    state_shardings,
)
from training_fixtures import CFG, np_params, packed_batch


@functools.cache
def _compiled(cfg, opts):
    mesh = make_mesh(MeshConfig())
    tx, sched = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=0, eps=1e-6), 10)
    sh = state_shardings(cfg, tx, mesh)
    return mesh, tx, sh, jit_train_step(make_train_step(cfg, opts, tx, sched, mesh), mesh, sh, 8)


def _run(cfg, opts, steps=2):
    """`steps` train steps from the same initial params on batches packed_batch(seed=0..steps-1)."""
    mesh, tx, sh, f = _compiled(cfg, opts)
    state = create_state(np_params(cfg), tx, jax.random.PRNGKey(0), sh)
    ms = []
    for i in range(steps):
        state, m = f(state, put_batch(packed_batch(seed=i), mesh, 8))
        ms.append(jax.device_get(m))
    return jax.device_get(state), ms


def test_grad_accumulation_equals_full_batch():
    s1, m1 = _run(CFG, StepOptions(mask_token_id=3, grad_accum=1))
    s4, m4 = _run(CFG, StepOptions(mask_token_id=3, grad_accum=4))
    for a, b in zip(m1, m4):
        for key in ("loss", "ntp_loss", "matp_loss", "grad_norm"):
            np.testing.assert_allclose(b[key], a[key], rtol=2e-5, err_msg=key)
        assert a["k"] == b["k"] and a["matp_tokens"] == b["matp_tokens"] and a["matp_tokens"] > 0
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params)):
        np.testing.assert_allclose(b, a, atol=2e-6)


def test_bf16_compute_keeps_float32_master_weights():
    _, m32 = _run(CFG, StepOptions(mask_token_id=3, grad_accum=1))
    bf = ModelConfig(**{**CFG.__dict__, "dtype": "bfloat16"})
    s16, m16 = _run(bf, StepOptions(mask_token_id=3))
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(s16.params))
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(s16.opt_state) if np.ndim(x) > 0)
    assert np.isfinite(m16[0]["loss"])
    np.testing.assert_allclose(m16[0]["loss"], m32[0]["loss"], atol=0.05)  # bf16 activations: ~1e-2
    assert m16[0]["loss"] != m32[0]["loss"]  # really computed in bf16
    delta = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(s16.params), jax.tree.leaves(np_params(bf)))]
    assert max(delta) > 1e-4  # the float32 master weights moved


def test_step_metrics_and_ntp_only():
    _, m = _run(CFG, StepOptions(mask_token_id=3, grad_accum=1))
    assert all(2 <= x["k"] <= 16 for x in m) and m[0]["tokens"] == 8 * 22
    assert m[0]["lr"] == pytest.approx(1e-3, rel=1e-6)
    _, mn = _run(CFG, StepOptions(mask_token_id=None, ntp_only=True), steps=1)
    assert mn[0]["matp_tokens"] == 0 and mn[0]["loss"] == pytest.approx(mn[0]["ntp_loss"])
    np.testing.assert_allclose(mn[0]["ntp_loss"], m[0]["ntp_loss"], rtol=1e-5)  # same params, same batch


def test_schedule_warmup_cosine_linear():
    c = OptimConfig(lr=1.0, warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    s = make_schedule(c, 104)
    assert float(s(0)) == pytest.approx(0.2) and float(s(4)) == pytest.approx(1.0)
    assert float(s(54)) == pytest.approx(0.55, abs=1e-6)  # halfway down the cosine: (1 + 0.1) / 2
    assert float(s(104)) == pytest.approx(0.1) and float(s(500)) == pytest.approx(0.1)
    lin = make_schedule(OptimConfig(lr=1.0, warmup_steps=0, schedule="linear", min_lr_ratio=0.0), 10)
    assert [round(float(lin(i)), 6) for i in (0, 5, 10)] == [1.0, 0.5, 0.0]


def test_clipping_and_decay_mask():
    rng = np.random.default_rng(0)
    params = {"embed": rng.normal(size=(6, 4)), "final_norm": np.ones(4),
              "layers": {"attn_norm": np.ones((2, 4)), "wq": rng.normal(size=(2, 4, 2, 2)), "bq": np.zeros((2, 2, 2))}}
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    mask = decay_mask(params)
    assert mask["embed"] and mask["layers"]["wq"] and not mask["layers"]["attn_norm"] and not mask["final_norm"]
    assert not mask["layers"]["bq"]
    g1 = jax.tree.map(lambda p: jnp.full_like(p, 3.0), params)
    g2 = jax.tree.map(lambda p: jnp.full_like(p, -0.01), params)
    clip = lambda g: optax.clip_by_global_norm(0.5).update(g, None)[0]
    with_clip, _ = make_optimizer(OptimConfig(clip_norm=0.5, warmup_steps=0, weight_decay=0.0), 10)
    no_clip, _ = make_optimizer(OptimConfig(clip_norm=None, warmup_steps=0, weight_decay=0.0), 10)

    def two_updates(tx, grads):
        st = tx.init(params)
        for g in grads:
            u, st = tx.update(g, st, params)
        return u
    a = two_updates(with_clip, [g1, g2])
    b = two_updates(no_clip, [clip(g1), clip(g2)])
    c = two_updates(no_clip, [g1, g2])
    for x, y, _z in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(c)):
        np.testing.assert_allclose(x, y, rtol=1e-5)
    assert not np.allclose(jax.tree.leaves(a)[0], jax.tree.leaves(c)[0], rtol=1e-3)
