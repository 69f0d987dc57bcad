"""One train step on a 2x2x2 (data, fsdp, tensor) mesh of 8 fake CPU devices equals the same step on
one device. Runs in a subprocess because XLA_FLAGS must be set before jax is imported.
Tolerances (float32): loss, grad norm rtol 1e-5; gradients (Adam's first moment after the step) max abs
diff <= 1e-5 x the leaf's max; updated params atol 1e-5 = 1% of one AdamW step (lr 1e-3): AdamW divides
by sqrt(v) + eps, so coordinates with near-zero gradients turn reduction-order noise into ~1e-6 moves."""
import textwrap

import numpy as np
from subproc import run_on_8_devices

SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from subproc import train_setup
    from sbd_jax.sharding import MeshConfig, make_mesh
    from sbd_jax.training.step import (StepOptions, create_state, jit_train_step, make_train_step, put_batch,
                                       state_shardings)

    cfg, params, batch, tx, sched = train_setup()
    B = batch.tokens.shape[0]

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
    out = run_on_8_devices(SCRIPT)
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
