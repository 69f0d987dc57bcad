"""Sharded decoding on 8 fake CPU devices (data 4 x tensor 2): params tensor-parallel by the training
rules, batch over data, KV cache sharded to match; tokens and NFE == single-device decoding (verify mode too).
The 8 devices need XLA_FLAGS before jax is imported, so the sharded run is a subprocess. The
single-device reference here is the brute-force decoder (cheap to compile in whichever pytest worker
runs this file); test_decoding.py pins the single-device cached decoder to it exactly."""
import json

import jax
import numpy as np
from subproc import run_on_8_devices
from decoding_fixtures import BASE, CFG, LENGTHS, make_params, make_prompts

from brute import brute_force_generate, brute_force_verify

SCRIPT = r"""
import json, sys
import jax, numpy as np
from decoding_fixtures import BASE, CFG, LENGTHS, make_params, make_prompts
from sbd_jax.decoding import generate
from sbd_jax.models import unstack_layers
from sbd_jax.models.quant import quantize_params
from sbd_jax.sharding import MeshConfig, batch_sharding, make_mesh, shard_params
mesh = make_mesh(MeshConfig(data=4, fsdp=1, tensor=2))
stacked = shard_params(make_params(), CFG, mesh)
per_layer = unstack_layers(stacked)
quantized = unstack_layers(quantize_params(stacked, CFG, "int8"))
ids = jax.device_put(make_prompts(), batch_sharding(mesh, 2, 4))
lens = jax.device_put(LENGTHS, batch_sharding(mesh, 1, 4))
res = {}
for name, kw in json.loads(sys.argv[2]).items():
    params = quantized if kw.pop("int8", False) else per_layer if kw.pop("per_layer", False) else stacked
    out = generate(params, CFG, ids, lens, key=jax.random.key(kw.pop("seed")), mesh=mesh, **kw, **BASE)
    res[name] = dict(tokens=np.asarray(out.tokens).tolist(), nfe=np.asarray(out.nfe).tolist(),
                     cache_spec=list(out.cache.k.sharding.spec), wq_spec=list(stacked["layers"]["wq"].sharding.spec),
                     wq0_spec=list(per_layer["layers"][0]["wq"].sharding.spec),
                     wq_int8_spec=list(quantized["layers"][0]["wq"].qvalue.sharding.spec),
                     scale_spec=list(out.cache.k_scale.sharding.spec) if out.cache.k_scale is not None else None)
print("RESULT" + json.dumps(res))
"""

CASES = {"greedy": {"gamma": 2.0, "temperature": 0.0, "seed": 0, "eos_ids": []},
         "sampled": {"gamma": 1.0, "temperature": 1.0, "seed": 7, "eos_ids": []},
         "ar": {"mode": "ar", "temperature": 1.0, "seed": 3, "eos_ids": []},
         # the decoders' layout (`unstack_layers`): one buffer per layer, sharded as the stacked weight
         "sampled_per_layer": {"gamma": 1.0, "temperature": 1.0, "seed": 7, "eos_ids": [], "per_layer": True},
         "ar_per_layer": {"mode": "ar", "temperature": 1.0, "seed": 3, "eos_ids": [], "per_layer": True},
         # the adaptive policy at a stated cost: both processes' calls follow the same costs
         "verify_per_layer": {"verify": True, "gamma": 1.0, "temperature": 1.0, "seed": 3, "eos_ids": [],
                              "wide_cost": 1.2, "per_layer": True},
         # int8 weights (sbd_jax/models/quant.py), sharded as the full-precision ones, and an int8 KV cache
         # (its scales sharded as the cache): verify == AR on them
         "verify_int8": {"verify": True, "gamma": 1.0, "temperature": 1.0, "seed": 3, "eos_ids": [],
                         "wide_cost": 1.2, "int8": True, "kv_cache_dtype": "int8"},
         "ar_int8": {"mode": "ar", "temperature": 1.0, "seed": 3, "eos_ids": [], "int8": True,
                     "kv_cache_dtype": "int8"}}
QUANTIZED = ("verify_int8", "ar_int8")


def test_sharded_tokens_equal_single_device():
    res = run_on_8_devices(SCRIPT, json.dumps(CASES))
    params = make_params()
    refs = {}  # the oracle's decodings by request (a per-layer case's is its stacked case's)
    for name, kw in CASES.items():
        if name in QUANTIZED:
            continue
        kw = {k: v for k, v in kw.items() if k != "per_layer"}
        if repr(kw) not in refs:
            oracle = brute_force_verify if kw.get("verify") else brute_force_generate
            args = dict(kw)
            refs[repr(kw)] = oracle(params, CFG, make_prompts(), LENGTHS, key=jax.random.key(args.pop("seed")),
                                    max_new_tokens=BASE["max_new_tokens"], block_size=BASE["block_size"],
                                    pad_id=BASE["pad_id"], **args)
        out = refs[repr(kw)]
        np.testing.assert_array_equal(np.asarray(res[name]["tokens"]), np.asarray(out.tokens), err_msg=name)
        np.testing.assert_array_equal(np.asarray(res[name]["nfe"]), np.asarray(out.nfe), err_msg=name)
        # cache [L, B, S, K, Dh]: batch over data, KV heads over tensor; weights (wq [L, D, H, Dh])
        # tensor-parallel over heads, as in training
        assert (res[name]["cache_spec"] + [None] * 5)[:5] == [None, "data", None, "tensor", None], res[name]
        assert (res[name]["wq_spec"] + [None] * 4)[:4] == [None, None, "tensor", None], res[name]
        assert (res[name]["wq0_spec"] + [None] * 3)[:3] == [None, "tensor", None], res[name]
    assert res["verify_per_layer"]["tokens"] == res["ar_per_layer"]["tokens"]  # lossless: AR's tokens, same key
    assert res["verify_int8"]["tokens"] == res["ar_int8"]["tokens"]  # and on the int8 model, its own AR's
    assert res["ar_int8"]["tokens"] != res["ar_per_layer"]["tokens"]  # (which is not the float model's)
    assert (res["ar_int8"]["wq_int8_spec"] + [None] * 3)[:3] == [None, "tensor", None]  # int8 values sharded
    assert (res["ar_int8"]["scale_spec"] + [None] * 4)[:4] == [None, "data", None, "tensor"]  # as the cache
