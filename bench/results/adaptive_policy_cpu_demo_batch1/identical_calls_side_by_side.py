"""Decoders making identical calls, side by side, 9 interleaved rounds: w8 and the policy twice each
(identical_calls_side_by_side.log), or with `stated`: w8, the policy with the cost model, and the policy with the
cost model's numbers stated (its figures: BENCHMARKS.md, "Lossless SBD next to AR: drafting policy")."""
import sys
from pathlib import Path

sys.path.insert(0, "bench")
import bench_adaptive as B  # noqa: E402

from sbd_jax.decoding import DecodeSpec  # noqa: E402
from sbd_jax.decoding.modes.verify import costs  # noqa: E402
from sbd_jax.decoding.runner import BatchDecoder, DecodeOptions  # noqa: E402
from sbd_jax.io.hf import from_pretrained  # noqa: E402


class A:
    demo, latency_n, max_new = "/tmp/demo0", 30, 48


cfg, params = from_pretrained(Path("/tmp/demo0/ft_sbd/hf"))
prompts, width = B.demo_problems(A, 30)
d = B.batch_decoders(params, cfg, ("w8", "verify"), 1, width, 48)
if sys.argv[1:] == ["stated"]:
    spec = B.spec_of("verify", 48)
    c = costs.call_costs(params, cfg, spec, 1, width + 48)
    print(c)
    d["verify_stated"] = BatchDecoder(params, cfg, DecodeOptions(spec=DecodeSpec.make(spec, wide_cost=c),
                                                                 batch_size=1, pad_multiple=width))
else:
    d2 = B.batch_decoders(params, cfg, ("w8", "verify"), 1, width, 48)
    d = {"w8": d["w8"], "verify": d["verify"], "w8_again": d2["w8"], "verify_again": d2["verify"]}
B.timed(d, prompts, 9, print)
