import sys; sys.path.insert(0, "bench"); sys.argv=["x"]
import bench_adaptive as B
from pathlib import Path
from sbd_jax.io.hf import from_pretrained
class A: demo="/tmp/demo0"; latency_n=30; max_new=48
cfg, params = from_pretrained(Path("/tmp/demo0/ft_sbd/hf"))
prompts, width = B.demo_problems(A, 30)
d = B.batch_decoders(params, cfg, ("w8", "verify"), 1, width, 48)
d2 = B.batch_decoders(params, cfg, ("w8", "verify"), 1, width, 48)
decs = {"w8": d["w8"], "verify": d["verify"], "w8_again": d2["w8"], "verify_again": d2["verify"]}
B.timed(decs, prompts, 9, print)
