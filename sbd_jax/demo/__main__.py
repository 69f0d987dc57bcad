"""`python -m sbd_jax.demo [--quick] [--out DIR] [key=value ...]`: the paper's Table 1 in miniature on a CPU.

Generates the task suite and a tokenizer, pretrains a small Llama-style model with NTP, fine-tunes two
copies (NTP-only baseline and SBD dual loss) for the same steps, evaluates both on held-out problems
(AR baseline vs SBD at several gammas, block size 16), and writes table.md, results.json and
accuracy_vs_speedup.png to the output directory. Rerunning skips finished stages; an interrupted
training stage resumes from its last checkpoint. Overrides: any DemoConfig field, e.g. `gammas=[0.1,0.5]`.
"""
import argparse
import dataclasses

from ..config import apply_overrides, from_dict
from .pipeline import DemoConfig, run


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m sbd_jax.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the same pipeline at toy scale (< 3 minutes)")
    ap.add_argument("--out", default=None, help="output directory (default results/ or results/quick/)")
    ap.add_argument("overrides", nargs="*", help="DemoConfig fields as key=value")
    args = ap.parse_args(argv)
    base = DemoConfig.quick() if args.quick else DemoConfig()
    data = apply_overrides(dataclasses.asdict(base), args.overrides)
    if args.out:
        data["out_dir"] = args.out
    run(from_dict(DemoConfig, data))


if __name__ == "__main__":
    main()
