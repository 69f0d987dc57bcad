"""Context parallelism: the SBD dual-loss train step with each row's sequence split over a "context"
mesh axis of 2, 4 and 8 fake CPU devices (alone, with data, fsdp and fsdp x tensor; XLA attention per shard, and once the
Pallas flash kernel in interpret mode; the balanced and the contiguous token order) equals the same XLA step on one
device: packed text rows, packed SFT rows with a compact copy stream (copy_len), loss chunks and 2 microbatches,
and a LoRA step that trains the mask token's embedding row.
Runs in a subprocess because XLA_FLAGS must be set before jax is imported. (attention/context.py's exchange does not
depend on the axis' size; a size whose chunks do not cut a half - 8 for L = 24 - only makes the step keep the
contiguous order: test_balanced_order.)
Tolerances (float32, as tests/test_training_sharded.py): loss, NTP and MATP losses, grad norm rtol 1e-5; gradients
(Adam's first moment after the step, (1 - b1) x the gradient) max abs diff <= 1e-5 x the leaf's max abs value."""
import textwrap

import numpy as np
import pytest
from subproc import run_on_8_devices

from sbd_jax.config import ConfigError, load_config
from sbd_jax.sharding import MeshConfig
from sbd_jax.training.config import TrainConfig
from sbd_jax.training.context import balanced_order

SCRIPT = textwrap.dedent("""
    import dataclasses, json
    import jax, jax.numpy as jnp, numpy as np
    from subproc import train_setup
    from sbd_jax.sharding import MeshConfig, make_mesh
    from sbd_jax.training.examples import PackedBatch
    from sbd_jax.training.step import (StepOptions, create_state, jit_train_step, make_train_step, put_batch,
                                       state_shardings)

    cfg, params, text, tx, sched = train_setup()

    def context_gathers(hlo):  # all-gathers over the context axis alone: the K/V (and key metadata) exchange
        return sum("all-gather(" in line and "{'context'}" in line for line in hlo.splitlines())
    cfg = dataclasses.replace(cfg, remat="full")  # as train.py runs it: the shard_map inside the remat'd layer

    def sft_batch(L=24):
        # packed SFT rows (prompt + response documents, padding), response tokens <= copy_len C = 16 per row
        rng = np.random.default_rng(1)
        seg, pos, lm = (np.zeros((4, L), np.int32) for _ in range(3))
        seg[0, :11], pos[0, :11], lm[0, 5:11] = 1, np.arange(11), 1
        seg[0, 11:22], pos[0, 11:22], lm[0, 14:22] = 2, np.arange(11), 1
        seg[1], pos[1], lm[1, 10:] = 1, np.arange(L), 1
        seg[2, :20], pos[2, :20], lm[2, 4:20] = 1, np.arange(20), 1
        seg[3, :7], pos[3, :7], lm[3, 2:7] = 1, np.arange(7), 1
        seg[3, 7:], pos[3, 7:], lm[3, 12:] = 2, np.arange(L - 7), 1
        return PackedBatch(*(a.astype(np.int32) for a in (rng.integers(4, 64, (4, L)) * (seg > 0), seg, pos, lm)))

    # SFT with copy_len also runs loss chunks of 5 (each shard's 10 or 20 tokens padded to whole chunks) and 2
    # microbatches
    CASES = {"text": (text, StepOptions(3, k_max=8)),
             "sft_copy_len": (sft_batch(), StepOptions(3, k_max=8, block_align="response", copy_len=16, loss_chunk=5,
                                                       grad_accum=2))}

    def run(mesh, case, impl="xla", order="balanced"):
        batch, opts = CASES[case]
        B, cfg_impl = batch.tokens.shape[0], dataclasses.replace(cfg, attention_impl=impl)
        sh = state_shardings(cfg, tx, mesh)
        state = create_state(jax.tree.map(jnp.asarray, params), tx, jax.random.PRNGKey(0), sh)
        f = jit_train_step(make_train_step(cfg_impl, opts, tx, sched, mesh, context_layout=order), mesh, sh, B)
        b = put_batch(batch, mesh, B)
        compiled = f.lower(state, b).compile()
        new, m = compiled(state, b)
        gathers = context_gathers(compiled.as_text())
        return jax.device_get(new.opt_state[1][0].mu), {k: float(v) for k, v in jax.device_get(m).items()}, gathers

    MESHES = {"data2_context4": MeshConfig(data=2, context=4), "fsdp2_context2_tensor2": MeshConfig(1, 2, 2, 2),
              "context8": MeshConfig(data=1, context=8)}
    # (mesh, attention per shard: "pallas" = the flash kernel in interpret mode, token order) against one device's
    # XLA step; "balanced" cuts both halves of every row (24 + 24, 24 + 16 tokens) into 2 x context chunks
    PLAN = {"text": [("data2_context4", "xla", "contiguous"), ("fsdp2_context2_tensor2", "pallas", "balanced"),
                     ("context8", "xla", "contiguous")],
            "sft_copy_len": [("fsdp2_context2_tensor2", "xla", "balanced")]}
    out = {}
    for case, meshes in PLAN.items():
        mu1, m1, _ = run(make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]), case)
        out[case] = {"one": m1}
        for name, impl, order in meshes:
            mesh = make_mesh(MESHES[name], jax.devices()[:int(np.prod([*MESHES[name].__dict__.values()]))])
            mu, m, gathers = run(mesh, case, impl, order)
            gdiff = max(float(np.abs(a - b).max() / (np.abs(a).max() + 1e-30))
                        for a, b in zip(jax.tree.leaves(mu1), jax.tree.leaves(mu)))
            out[case][f"{name}_{impl}_{order}"] = dict(metrics=m, grad_rel_diff=gdiff, axes=dict(mesh.shape), gathers=gathers)

    # LoRA (frozen base, the mask token's embedding row trained): the whole-table lookup under a RowPatch
    from training_fixtures import lora_step
    from sbd_jax.models.lora import LORA_TARGETS, AdapterLayout, init_adapter
    from sbd_jax.sharding import param_shardings
    from sbd_jax.training.model_source import add_mask_row
    lcfg, base = add_mask_row(dataclasses.replace(cfg, mask_token_id=None), params)
    layout = AdapterLayout(4, 8.0, tuple(LORA_TARGETS), mask_row=lcfg.mask_token_id)
    adapter = jax.tree.map(np.asarray, init_adapter(lcfg, layout, jax.random.key(0), base))

    def run_lora(mesh):
        ltx, sh, step = lora_step(lcfg, layout, mesh)
        state = create_state(jax.device_put(adapter, sh.params), ltx, jax.random.PRNGKey(0), sh)
        args = (state, put_batch(text, mesh, 8), jax.device_put(base, param_shardings(lcfg, mesh)))
        compiled = step.lower(*args).compile()
        new, m = compiled(*args)
        return (jax.device_get(new.opt_state[1][0].mu), {k: float(v) for k, v in jax.device_get(m).items()},
                context_gathers(compiled.as_text()))

    mu1, m1, _ = run_lora(make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]))
    mesh = make_mesh(MeshConfig(1, 2, 1, 4))
    mu, m, gathers = run_lora(mesh)
    gdiff = max(float(np.abs(a - b).max() / (np.abs(a).max() + 1e-30))
                for a, b in zip(jax.tree.leaves(mu1), jax.tree.leaves(mu)))
    out["lora_mask_row"] = {"one": m1, "fsdp2_context4_xla_balanced": dict(metrics=m, grad_rel_diff=gdiff,
                                                                            axes=dict(mesh.shape), gathers=gathers)}
    print("RESULT " + json.dumps(out))
""")


def test_context_parallel_step_matches_single_device():
    out = run_on_8_devices(SCRIPT)
    for case, runs in out.items():
        one = runs.pop("one")
        assert one["matp_tokens"] > 0 and one["ntp_tokens"] > 0, case
        for name, r in runs.items():
            assert r["axes"]["context"] in (2, 4, 8), r["axes"]
            assert r["gathers"] >= 2, (case, name)  # K and V really all-gathered over the context axis
            for key in ("loss", "ntp_loss", "matp_loss", "grad_norm"):
                np.testing.assert_allclose(r["metrics"][key], one[key], rtol=1e-5, err_msg=f"{case} {name} {key}")
            for key in ("ntp_tokens", "matp_tokens", "k", "tokens"):
                assert r["metrics"][key] == one[key], (case, name, key)
            assert r["grad_rel_diff"] <= 1e-5, (case, name, r["grad_rel_diff"])


def test_balanced_order():
    """Each half cut into 2n chunks, device i holding chunks i and 2n-1-i of both: a permutation whose shards hold
    equal shares of each half and equal sums of positions (the causal work); None when a half does not cut."""
    L, C, n = 24, 16, 4
    order = balanced_order(L, L + C, n)
    assert sorted(order) == list(range(L + C))
    shards = order.reshape(n, -1)
    assert ((shards < L).sum(1) == L // n).all()
    assert len({int(s[s < L].sum()) for s in shards}) == 1 and len({int(s[s >= L].sum()) for s in shards}) == 1
    assert list(shards[0]) == [0, 1, 2, 21, 22, 23, 24, 25, 38, 39]
    assert balanced_order(L, 2 * L, 1) is None and balanced_order(L, L + 12, 4) is None  # 12 does not cut into 8
    assert balanced_order(L, 2 * L, 8) is None  # 24 does not cut into 16: context 8 keeps the contiguous order
    assert balanced_order(L, L, 2) is not None  # NTP-only: one half


def test_context_config_errors_name_the_value():
    yaml = "configs/tiny_sbd.yaml"
    cfg = load_config(TrainConfig, yaml, ["data.seq_len=24", "mesh.context=4", "sbd.k_max=8"])
    assert cfg.mesh == MeshConfig(context=4) and cfg.row_tokens() == 48
    with pytest.raises(ConfigError, match=r"mesh.context \(5\) must divide the 48 tokens"):
        load_config(TrainConfig, yaml, ["data.seq_len=24", "mesh.context=5", "sbd.k_max=8"])
    with pytest.raises(ConfigError, match=r"mesh.context \(4\) must divide the 38 tokens .*copy stream 14"):
        load_config(TrainConfig, yaml, ["data.seq_len=24", "data.copy_len=14", "sbd.block_align=response",
                                        "mesh.context=4", "sbd.k_max=8"])
    with pytest.raises(ConfigError, match=r"mesh.context must be >= 1 \(or -1 for 'the rest'\), got 0"):
        MeshConfig(context=0)
    from sbd_jax.training.step import StepOptions, make_train_step
    with pytest.raises(ValueError, match=r"context layout must be one of \('balanced', 'contiguous'\), got 'zigzag'"):
        make_train_step(cfg.model.config, StepOptions(3), None, context_layout="zigzag")
