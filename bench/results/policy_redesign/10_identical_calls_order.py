"""Decoders making identical calls, side by side (w8 and the policy, twice each), 9 interleaved rounds."""
import sys
from pathlib import Path

sys.path.insert(0, "bench")
import bench_adaptive as B  # noqa: E402

from sbd_jax.io.hf import from_pretrained  # noqa: E402


class A:
    demo, latency_n, max_new = "/tmp/demo0", 30, 48


cfg, params = from_pretrained(Path("/tmp/demo0/ft_sbd/hf"))
prompts, width = B.demo_problems(A, 30)
d = B.batch_decoders(params, cfg, ("w8", "verify"), 1, width, 48)
d2 = B.batch_decoders(params, cfg, ("w8", "verify"), 1, width, 48)
B.timed({"w8": d["w8"], "verify": d["verify"], "w8_again": d2["w8"], "verify_again": d2["verify"]}, prompts, 9, print)
