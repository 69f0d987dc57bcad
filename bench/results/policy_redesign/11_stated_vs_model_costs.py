import sys; sys.path.insert(0, "bench"); sys.argv=["x"]
import bench_adaptive as B
from pathlib import Path
from sbd_jax.io.hf import from_pretrained
from sbd_jax.decoding import DecodeSpec
from sbd_jax.decoding.runner import BatchDecoder, DecodeOptions
from sbd_jax.decoding.modes.verify import costs
class A: demo="/tmp/demo0"; latency_n=30; max_new=48
cfg, params = from_pretrained(Path("/tmp/demo0/ft_sbd/hf"))
prompts, width = B.demo_problems(A, 30)
d = B.batch_decoders(params, cfg, ("w8", "verify"), 1, width, 48)
spec = B.spec_of("verify", 48)
c = costs.call_costs(params, cfg, spec, 1, width + 48); print(c)
st = DecodeSpec.make(spec, wide_cost=c)
d["verify_stated"] = BatchDecoder(params, cfg, DecodeOptions(spec=st, batch_size=1, pad_multiple=width))
B.timed(d, prompts, 9, print)
