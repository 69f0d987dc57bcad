"""attention_impl="pallas" on a device mesh: the kernels run per shard inside `jax.shard_map`
(sbd_jax/attention/sharded.py). On 8 fake CPU devices (interpret mode), in subprocesses because
XLA_FLAGS must be set before jax is imported:
  * the attention alone (outputs and q/k/v gradients) on several meshes == the unsharded XLA reference
    (float32, rel 1e-4), covering every head layout: KV heads split, q heads only (K/V replicated over
    "tensor", each shard slices its KV head), heads replicated (H % tensor != 0), a batch that does not
    divide the batch axes; and the in-place (cache, window) parts variant used by decoding;
  * one train step on a 2x2x2 mesh with "pallas" == the single-device "xla" step (loss, grads);
  * sharded SBD decoding with "pallas" == unsharded "xla" decoding (tokens, NFE);
  * the wrapper is really used: every pallas_call in the traced attention, train step and decoder sees
    per-shard shapes, and the compiled sharded attention has no all-gather (the raw kernel gets 9).
Shapes are tiny: interpret-mode Pallas is slow."""
import jax
import numpy as np
import pytest
from subproc import run_on_8_devices

from sbd_jax.attention.sharded import HeadLayout, ShardedAttentionError, head_layout, pallas_attention

# shared by the subprocess scripts: every pallas_call in a (closed) jaxpr, with its operand shapes
PRELUDE = r"""
import json, dataclasses
import jax, jax.numpy as jnp, numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

def pallas_operands(jaxpr, out=None):
    out = [] if out is None else out
    for e in jaxpr.eqns:
        if e.primitive.name == "pallas_call":
            out.append([list(x.aval.shape) for x in e.invars])
            continue
        for p in e.params.values():
            for j in (p if isinstance(p, (list, tuple)) else [p]):
                if isinstance(j, ClosedJaxpr):
                    pallas_operands(j.jaxpr, out)
                elif isinstance(j, Jaxpr):
                    pallas_operands(j, out)
    return out

def signature(calls):
    # order-free signature of the pallas_calls: a sharded trace has the signature of an unsharded
    # trace on per-shard shapes iff every kernel ran on per-shard operands
    return sorted(json.dumps(c) for c in calls)
"""

ATTENTION = PRELUDE + r"""
import re
from jax.sharding import NamedSharding, PartitionSpec as P
from sbd_jax.attention import (attention, attention_parts, block_starts, clean_meta, concat_meta, copy_meta,
                               reference_attention)
from sbd_jax.attention.pallas import pallas_attention as raw_kernel
from sbd_jax.sharding import MeshConfig, make_mesh

T, H, K, D, k = 8, 4, 2, 8, 4

def inputs(B, seed=0):
    rng = np.random.default_rng(seed)
    pos = np.broadcast_to(np.arange(T), (B, T))
    seg = np.ones((B, T), np.int32)
    seg[0, 6:] = 0  # padding
    if B > 1:
        seg[1, 3:] = 2  # two documents
        pos = np.where(seg == 2, pos - 3, pos) * (seg > 0)
    meta = concat_meta(clean_meta(seg, pos), copy_meta(seg, pos, block_starts(pos, k)))
    arr = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    return arr(B, 2 * T, H, D), arr(B, 2 * T, K, D), arr(B, 2 * T, K, D), arr(B, 2 * T, H, D), meta

def loss_and_grads(impl):
    def f(q, kk, v, w, meta):
        def loss(q, kk, v):
            o = attention(q, kk, v, meta, meta, impl=impl)
            return jnp.sum(o * w), o
        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, kk, v)
    return jax.jit(f)

def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())

res = {}
ref, sharded = loss_and_grads("xla"), loss_and_grads("pallas")
# (mesh, batch): q+kv heads split; q heads only; heads replicated (4 % 8); batch 2 on 4 batch devices
for shape, B in (((2, 1, 2), 4), ((2, 1, 4), 4), ((1, 1, 8), 2), ((2, 2, 2), 2)):
    mesh = make_mesh(MeshConfig(*shape), jax.devices()[:int(np.prod(shape))])
    args = inputs(B)
    (_, o_ref), g_ref = ref(*args)
    with jax.set_mesh(mesh):
        (_, o), g = sharded(*args)
        calls = pallas_operands(jax.make_jaxpr(sharded)(*args).jaxpr)
    res[str(shape)] = dict(out=rel(o, o_ref), grads=[rel(a, b) for a, b in zip(g, g_ref)], n_calls=len(calls),
                           shapes=sorted({str(c) for c in calls}))
    if shape == (2, 1, 2):  # per shard: batch 2 of 4, heads 2 of 4, kv heads 1 of 2
        loc = [x[:2, :, :x.shape[2] // 2] for x in args[:4]] + [args[4].take((slice(None, 2),))]
        res[str(shape)]["local"] = signature(calls) == signature(pallas_operands(jax.make_jaxpr(sharded)(*loc).jaxpr))

# the (cache, window) parts variant, forward (decoding's path): 2 x 4 mesh, q heads only
mesh = make_mesh(MeshConfig(2, 1, 4))
B = 4
q, kk, v, _, meta = inputs(B, seed=1)
cm = meta.take((slice(None), slice(None, 12)))
wm = meta.take((slice(None), slice(12, None)))
parts = [(kk[:, :12], v[:, :12], cm), (kk[:, 12:], v[:, 12:], wm)]
qw, qm = q[:, 12:], wm
want = reference_attention(qw, kk, v, qm, meta)
f = jax.jit(lambda q, parts, qm: attention_parts(q, parts, qm, impl="pallas"))
with jax.set_mesh(mesh):
    got = f(qw, parts, qm)
    calls = pallas_operands(jax.make_jaxpr(f)(qw, parts, qm).jaxpr)
# per shard: batch 2 of 4, q heads 1 of 4, the one KV head they share
rows = (slice(None, 2),)
loc = (qw[:2, :, :1], [(a[:2, :, :1], b[:2, :, :1], m.take(rows)) for a, b, m in parts], qm.take(rows))
res["parts"] = dict(out=rel(got, want), local=signature(calls) == signature(pallas_operands(jax.make_jaxpr(f)(*loc).jaxpr)))

# the compiled sharded attention on sharded inputs needs no all-gather; the raw kernel does
mesh = make_mesh(MeshConfig(2, 1, 2), jax.devices()[:4])
q, kk, v, w, meta = inputs(4)
hs, ms = NamedSharding(mesh, P("data", None, "tensor", None)), NamedSharding(mesh, P("data", None))
q, kk, v = (jax.device_put(x, hs) for x in (q, kk, v))
meta = jax.device_put(meta, ms)
for name, fn in (("wrapped", lambda q, kk, v, m: attention(q, kk, v, m, m, impl="pallas")),
                 ("raw", lambda q, kk, v, m: raw_kernel(q, kk, v, m, m))):
    with jax.set_mesh(mesh):
        hlo = jax.jit(fn).lower(q, kk, v, meta).compile().as_text()
    res["all_gathers_" + name] = len(re.findall(r"all-gather\(", hlo)) + len(re.findall(r"all-gather-start\(", hlo))
print("RESULT" + json.dumps(res))
"""

TRAIN = PRELUDE + r"""
from subproc import train_setup
from sbd_jax.sharding import MeshConfig, make_mesh
from sbd_jax.training.examples import PackedBatch
from sbd_jax.training.step import (StepOptions, abstract_state, create_state, jit_train_step, make_train_step,
                                   put_batch, state_shardings)

cfg, params, batch, tx, sched = train_setup()
B, L = batch.tokens.shape

def run(cfg, mesh):
    sh = state_shardings(cfg, tx, mesh)
    state = create_state(jax.tree.map(jnp.asarray, params), tx, jax.random.PRNGKey(0), sh)
    f = jit_train_step(make_train_step(cfg, StepOptions(3), tx, sched, mesh), mesh, sh, B)
    b = put_batch(batch, mesh, B)
    calls = pallas_operands(jax.make_jaxpr(f)(state, b).jaxpr)
    new, m = f(state, b)
    mu = jax.device_get(new.opt_state[1][0].mu)  # (1 - b1) * gradient after one step
    return mu, {k: float(v) for k, v in jax.device_get(m).items()}, calls

mu1, m1, _ = run(cfg, make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]))
mu8, m8, calls = run(dataclasses.replace(cfg, attention_impl="pallas"), make_mesh(MeshConfig(2, 2, 2)))
gdiff = max(float(np.abs(a - b).max() / (np.abs(a).max() + 1e-30)) for a, b in zip(jax.tree.leaves(mu1), jax.tree.leaves(mu8)))
# the per-shard problem, traced unsharded: batch 8 over data x fsdp = 4 -> 2 rows; heads 4 / kv 2 over
# tensor 2 -> 2 / 1 (head_dim 8 kept)
loc_cfg = dataclasses.replace(cfg, attention_impl="pallas", num_attention_heads=2, num_key_value_heads=1, head_dim=8)
loc_batch = PackedBatch(*(jax.ShapeDtypeStruct((2, L), jnp.int32) for _ in range(4)))
loc_calls = pallas_operands(jax.make_jaxpr(make_train_step(loc_cfg, StepOptions(3), tx, sched))(
    abstract_state(loc_cfg, tx), loc_batch).jaxpr)
print("RESULT" + json.dumps(dict(one=m1, mesh=m8, grad_rel=gdiff, n_calls=len(calls),
                                 local=signature(calls) == signature(loc_calls))))
"""

DECODE = PRELUDE + r"""
from decoding_fixtures import BASE, CFG, LENGTHS, make_params, make_prompts
from sbd_jax.decoding import generate
from sbd_jax.decoding import GenerateCall
from sbd_jax.models import param_shapes
from sbd_jax.sharding import MeshConfig, batch_sharding, make_mesh, shard_params

PCFG = dataclasses.replace(CFG, attention_impl="pallas")
mesh = make_mesh(MeshConfig(data=4, fsdp=1, tensor=2))
raw = make_params()
params = shard_params(raw, CFG, mesh)
ids = jax.device_put(make_prompts(), batch_sharding(mesh, 2, 4))
lens = jax.device_put(LENGTHS, batch_sharding(mesh, 1, 4))
kw = dict(gamma=2.0, temperature=0.0, eos_ids=[], **BASE)
got = generate(params, PCFG, ids, lens, key=jax.random.key(0), mesh=mesh, **kw)
want = generate(raw, CFG, make_prompts(), LENGTHS, key=jax.random.key(0), **kw)  # one device, "xla"
call = GenerateCall.build(params, PCFG, ids, lens, key=jax.random.key(0), mesh=mesh, **kw)
calls = pallas_operands(jax.make_jaxpr(call)().jaxpr)
# the per-shard problem, traced unsharded: batch 4 over data 4 -> 1 row; heads 4 / kv 2 over tensor 2 -> 2 / 1
loc_cfg = dataclasses.replace(PCFG, num_attention_heads=2, num_key_value_heads=1, head_dim=CFG.head_dim)
loc_params = jax.tree.map(lambda s: jnp.zeros(s, jnp.float32), param_shapes(loc_cfg), is_leaf=lambda x: isinstance(x, tuple))
call = GenerateCall.build(loc_params, loc_cfg, make_prompts()[:1], LENGTHS[:1], key=jax.random.key(0), **kw)
loc_calls = pallas_operands(jax.make_jaxpr(call)().jaxpr)
print("RESULT" + json.dumps(dict(tokens=[np.asarray(o.tokens).tolist() for o in (got, want)],
                                 nfe=[np.asarray(o.nfe).tolist() for o in (got, want)],
                                 kv_diff=float(np.abs(np.asarray(got.cache.k) - np.asarray(want.cache.k)).max()),
                                 n_calls=len(calls), local=signature(calls) == signature(loc_calls))))
"""


def test_head_layouts():
    mesh = jax.sharding.AbstractMesh((2, 2, 4), ("data", "fsdp", "tensor"))
    assert head_layout(mesh, 8, 32, 8) == HeadLayout(("data", "fsdp"), "split", 4)
    assert head_layout(mesh, 8, 8, 2) == HeadLayout(("data", "fsdp"), "q_only", 4)  # 2 q heads per KV head
    assert head_layout(mesh, 6, 6, 2) == HeadLayout(None, "replicated", 4)  # 6 heads on 4; 6 rows on 4
    assert head_layout(mesh, 4, 8, 1).heads == "q_only"  # MQA
    assert head_layout(mesh, 4, 12, 2).heads == "q_only"  # 3 q heads per shard, 6 per KV head
    assert head_layout(mesh, 4, 12, 3).heads == "replicated"  # 3 q heads per shard straddle groups of 4
    assert head_layout(None, 4, 4, 4).trivial
    assert head_layout(jax.sharding.AbstractMesh((1, 1, 1), ("data", "fsdp", "tensor")), 4, 4, 4).trivial
    assert head_layout(jax.sharding.AbstractMesh((4,), ("pipeline",)), 4, 4, 4).trivial  # unknown axes
    x = np.zeros((1, 4, 3, 8), np.float32)
    with pytest.raises(ShardedAttentionError, match="multiple of kv heads"):
        pallas_attention(x, np.zeros((1, 4, 2, 8), np.float32), np.zeros((1, 4, 2, 8), np.float32), None, None)


def test_sharded_attention_matches_reference():
    res = run_on_8_devices(ATTENTION)
    for name, r in res.items():
        if name.startswith("("):
            assert r["out"] <= 1e-4 and max(r["grads"]) <= 1e-4, (name, r)
            assert r["n_calls"] == 3, (name, r)  # forward, dq and dk/dv kernels
    assert res["(2, 1, 2)"]["local"], res["(2, 1, 2)"]  # per shard: batch 2 of 4, heads 2 of 4, kv 1 of 2
    assert res["parts"]["out"] <= 1e-4 and res["parts"]["local"], res["parts"]
    assert res["all_gathers_wrapped"] == 0 and res["all_gathers_raw"] > 0, res


def test_sharded_pallas_train_step_matches_single_device_xla():
    r = run_on_8_devices(TRAIN)
    for name in ("loss", "ntp_loss", "matp_loss", "grad_norm"):
        np.testing.assert_allclose(r["mesh"][name], r["one"][name], rtol=1e-5, err_msg=name)
    assert r["mesh"]["matp_tokens"] == r["one"]["matp_tokens"] > 0 and r["mesh"]["k"] == r["one"]["k"]
    assert r["grad_rel"] <= 1e-4, r["grad_rel"]
    # 2 layers x (clean half + copy half) x (forward, dq, dk/dv), all on per-shard shapes
    assert r["n_calls"] >= 6 and r["local"], r


def test_sharded_pallas_decoding_matches_unsharded_xla():
    r = run_on_8_devices(DECODE)
    got, want = r["tokens"]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(*map(np.asarray, r["nfe"]))
    assert r["kv_diff"] <= 1e-4, r["kv_diff"]
    assert r["n_calls"] >= 2 and r["local"], r
