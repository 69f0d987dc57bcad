"""The draft metric against training time: 1 + accepted (the tokens per forward of lossless decoding in which every
call checks a block and drafts the next) from each run's <out_dir>/draft_quality.jsonl, one line per run.

    python bench/plot_draft_curve.py RUN_DIR[=LABEL] ... --out docs/draft_curve.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories, each optionally =LABEL")
    ap.add_argument("--out", required=True)
    ap.add_argument("--goal", type=float, default=2.5, help="a horizontal line at this many tokens per forward")
    args = ap.parse_args(argv)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for spec in args.runs:
        path, _, label = spec.partition("=")
        recs = [json.loads(ln) for ln in (Path(path) / "draft_quality.jsonl").read_text().splitlines() if ln.strip()]
        ax.plot([r["seconds"] / 60 for r in recs], [r["tokens_per_forward"] for r in recs], marker="o",
                label=label or Path(path).name)
    ax.axhline(args.goal, color="grey", linestyle="--", linewidth=1, label=f"goal {args.goal:g}")
    ax.set_xlabel("training minutes (this CPU)")
    ax.set_ylabel("1 + accepted drafts per block (block 16)")
    ax.set_title("Draft quality on held-out functions (bench/plot_draft_curve.py)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
