"""HF checkpoints straight into their shards: `from_pretrained(dir, mesh=...)` builds every weight from the
slices its devices hold, and `save_pretrained` writes a sharded model tensor by tensor. On 8 fake CPU devices
(device memory is host memory here), so what is measured is the load's transient host memory: the peak RSS
growth beyond the loaded shards themselves."""
import json

import jax
import numpy as np
import pytest

import sbd_jax
from subproc import ROOT, finish, free_port, run_on_8_devices, start_processes

SCRIPT = r"""
import json, sys
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
import sbd_jax
from sbd_jax.sharding import MeshConfig, make_mesh, maybe_initialize_distributed, param_shardings
maybe_initialize_distributed()

def rss():  # (current, peak) resident set in bytes
    f = dict(l.split(":", 1) for l in Path("/proc/self/status").read_text().splitlines() if ":" in l)
    return int(f["VmRSS"].split()[0]) * 1024, int(f["VmHWM"].split()[0]) * 1024

d, out = Path(sys.argv[2]), Path(sys.argv[3])
mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
cfg0 = sbd_jax.io.load_hf_config(d)
jax.block_until_ready(jax.device_put(jnp.zeros((8, 8)), param_shardings(cfg0, mesh)["embed"]))  # runtime warm
Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
base = rss()[0]
cfg, params = sbd_jax.from_pretrained(d, mesh=mesh)
jax.block_until_ready(params)
now, peak = rss()
sh = param_shardings(cfg, mesh)
placed = all(p.sharding == s for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(sh)))
sbd_jax.save_pretrained(cfg, params, out, max_shard_bytes=100 * 2**20)
model = sum(p.nbytes for p in jax.tree.leaves(params))
largest = max(p.nbytes for p in jax.tree.leaves(params) if p.ndim == 2)
print("RESULT" + json.dumps(dict(model=model, largest=largest, resident=now - base, peak=peak - base,
                                  placed=placed, sharded=any(len(p.sharding.device_set) == 8 and
                                  p.addressable_shards[0].data.size < p.size for p in jax.tree.leaves(params)))))
"""


@pytest.mark.parametrize("processes", [1, 2])
def test_sharded_load_reads_slices_and_round_trips(tmp_path, processes):
    """1 process x 8 devices: no transient memory beyond the shards. 2 processes x 4 devices (one
    jax.distributed job): each process holds, and so reads, only half of the model; the export gathers
    tensor by tensor and process 0 writes."""
    cfg = sbd_jax.ModelConfig(vocab_size=32768, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                              num_attention_heads=8, num_key_value_heads=4, qk_norm=True, model_type="qwen3")
    params = jax.tree.map(np.asarray, sbd_jax.init_params(cfg, jax.random.key(0)))
    sbd_jax.save_pretrained(cfg, params, tmp_path / "in", max_shard_bytes=64 * 2**20)
    args = (tmp_path / "in", tmp_path / "out")
    if processes == 1:
        results = [run_on_8_devices(SCRIPT, *args)]
    else:
        outs = finish(start_processes(["-c", SCRIPT, str(ROOT), *map(str, args)], processes=2, devices_each=4,
                                      port=free_port()))
        results = [json.loads(o.split("RESULT", 1)[1]) for o in outs]
    for r in results:
        assert r["placed"] and r["sharded"]
        transient = r["peak"] - r["resident"]
        print(f"{processes} process(es): model {r['model'] / 2**20:.0f} MiB, largest tensor "
              f"{r['largest'] / 2**20:.0f} MiB, peak RSS growth {r['peak'] / 2**20:.0f} MiB "
              f"({transient / 2**20:.0f} MiB beyond what stays resident)")
        # the shards this process holds plus the runtime's own buffers; nothing transient near a model copy
        assert r["resident"] < (1.5 / processes) * r["model"] and transient < 0.5 * r["largest"], r
    # the sharded model written tensor by tensor (several files) reloads exactly
    cfg2, back = sbd_jax.from_pretrained(tmp_path / "out")
    assert cfg2 == cfg and len(list((tmp_path / "out").glob("*.safetensors"))) > 1
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(b), a)
