"""`python -m demos.toy [--quick] [--out DIR] [key=value ...]`: the paper's Table 1 in miniature on a CPU.

Generates the task suite and a tokenizer, pretrains a small Llama-style model with NTP, fine-tunes two
copies (NTP-only baseline and SBD dual loss) for the same steps, evaluates both on held-out problems
(AR baseline vs lossless SBD per drafting policy and lossy SBD at several gammas, block size 16), and
writes table.md, results.json and accuracy_vs_speedup.png to the output directory. Rerunning skips
finished stages; an interrupted training stage resumes from its last checkpoint. Overrides: any DemoConfig
field, e.g. `gammas=[0.1,0.5]`.
"""
from .cli import main as cli_main
from .pipeline import DemoConfig, run


def main(argv=None):
    cli_main(argv, prog="python -m demos.toy", doc=__doc__, config_cls=DemoConfig, run=run,
             quick_help="the same pipeline at toy scale (< 3 minutes)", default_out="results/ or results/quick/")


if __name__ == "__main__":
    main()
