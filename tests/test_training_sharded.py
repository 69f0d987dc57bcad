"""One train step on a 2x2x2 (data, fsdp, tensor) mesh of 8 fake CPU devices equals the same step on
one device. Runs in a subprocess because XLA_FLAGS must be set before jax is imported.
Tolerances (float32): loss, grad norm rtol 1e-5; gradients (Adam's first moment after the step) max abs
diff <= 1e-5 x the leaf's max; updated params atol 1e-5 = 1% of one AdamW step (lr 1e-3): AdamW divides
by sqrt(v) + eps, so coordinates with near-zero gradients turn reduction-order noise into ~1e-6 moves."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from sbd_jax.config import ModelConfig
    from sbd_jax.models import param_shapes
    from sbd_jax.sharding import MeshConfig, make_mesh
    from sbd_jax.training.config import OptimConfig
    from sbd_jax.training.examples import PackedBatch
    from sbd_jax.training.optim import make_optimizer
    from sbd_jax.training.step import (StepOptions, create_state, jit_train_step, make_train_step, put_batch,
                                       state_shardings)

    assert len(jax.devices()) == 8, jax.devices()
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, mask_token_id=3)
    rng = np.random.default_rng(0)
    params = jax.tree.map_with_path(
        lambda path, s: (1.0 if path[-1].key.endswith("norm") else 0.0) + rng.normal(0, 0.05, s).astype(np.float32),
        param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    B, L = 8, 24
    tok = rng.integers(4, 64, (B, L))
    cut = rng.integers(6, L - 6, B)
    ar = np.arange(L)
    seg = np.where(ar < cut[:, None], 1, 2); seg[:, -2:] = 0
    pos = np.where(seg == 1, ar, ar - cut[:, None]) * (seg > 0)
    batch = PackedBatch(*(a.astype(np.int32) for a in (tok * (seg > 0), seg, pos, (seg > 0).astype(int))))
    tx, sched = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=0, eps=1e-6), 10)

    def run(mesh, accum):
        sh = state_shardings(cfg, tx, mesh)
        state = create_state(jax.tree.map(jnp.asarray, params), tx, jax.random.PRNGKey(0), sh)
        old_leaf = state.params["layers"]["wq"]
        f = jit_train_step(make_train_step(cfg, StepOptions(3, grad_accum=accum), tx, sched, mesh), mesh, sh, B)
        b = put_batch(batch, mesh, B)
        new, m = f(state, b)
        info = {"wq": str(new.params["layers"]["wq"].sharding.spec),
                "embed": str(new.params["embed"].sharding.spec),
                "mu_wq": str(new.opt_state[1][0].mu["layers"]["wq"].sharding.spec),
                "batch": str(b.tokens.sharding.spec),
                "wq_local_shape": list(new.params["layers"]["wq"].addressable_shards[0].data.shape),
                "donated": bool(old_leaf.is_deleted())}
        mu = jax.device_get(new.opt_state[1][0].mu)  # (1 - b1) * gradient after one step
        return jax.device_get(new.params), mu, {k: float(v) for k, v in jax.device_get(m).items()}, info

    p1, mu1, m1, _ = run(make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]), 1)
    out = {"one": m1}
    for accum in (1, 2):
        p8, mu8, m8, info = run(make_mesh(MeshConfig(2, 2, 2)), accum)
        gdiff = max(float(np.abs(a - b).max() / (np.abs(a).max() + 1e-30))
                    for a, b in zip(jax.tree.leaves(mu1), jax.tree.leaves(mu8)))
        diffs = [float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p8))]
        moved = [float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(params))]
        out[f"mesh_accum{accum}"] = dict(metrics=m8, max_param_diff=max(diffs), max_grad_rel_diff=gdiff,
                                          min_param_move=min(moved), **info)
    print("RESULT " + json.dumps(out))
""")


def test_sharded_step_matches_single_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    one = out["one"]
    for key in ("mesh_accum1", "mesh_accum2"):
        r = out[key]
        for name in ("loss", "ntp_loss", "matp_loss", "grad_norm"):
            np.testing.assert_allclose(r["metrics"][name], one[name], rtol=1e-5, err_msg=f"{key} {name}")
        assert r["metrics"]["matp_tokens"] == one["matp_tokens"] > 0 and r["metrics"]["k"] == one["k"]
        assert r["max_grad_rel_diff"] <= 1e-5, r["max_grad_rel_diff"]  # gradients (via Adam's first moment)
        assert r["max_param_diff"] <= 1e-5, r["max_param_diff"]  # <= 1% of one step of size lr
        assert r["min_param_move"] > 1e-5  # every parameter really changed in the step
        # the layout really is sharded: wq [L, D, H, Dh] -> (None, fsdp, tensor, None), moments alike
        assert r["wq"] == r["mu_wq"] == "P(None, 'fsdp', 'tensor', None)", r
        assert r["wq_local_shape"] == [2, 16, 2, 8]
        assert r["embed"] == "P('tensor', 'fsdp')"
        assert r["batch"] == "P(('data', 'fsdp'), None)"
        assert r["donated"]  # the input state was donated
