"""SmolLM2-135M-Instruct (or `--model`) + an SBD adapter on held-out stdlib functions, on this machine: the base model's AR, the
adapter's AR, lossless (verify, adaptive policy; "always": every call at the widest width) and the lossy EB /
threshold rules, through the real demo's evaluation (demos/real/evaluation.py: decode.py's batch runner, greedy,
block 16): first-line exact, similarity, rows == the base's AR, tokens per forward, tokens/s at `--batch` rows and
at batch 1, and the ratios to the base's AR.

    python bench/eval_real.py --adapter adapters/smollm2-135m-sbd-copy-lora --limit 64 --out results/real_cpu

The held-out functions are made from this interpreter's stdlib (`--prompt-tokens`), or read from a data stage's
heldout.jsonl (`--heldout`, e.g. the data the GPU campaign carries).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from demos.real import corpus
from demos.real.config import RealDemoConfig
from demos.real.evaluation import evaluate, read_records
from demos.real.metrics import identical_share
from demos.real.stages import heldout_records, stage_base
from sbd_jax.io.tokenizer import Tokenizer


def table(rows: list[dict], batch: int) -> str:
    ar = next(r for r in rows if r["model"] == "base")
    head = (f"| decoding | first-line exact | similarity | = base AR | tokens / forward | tokens/s, batch {batch} | "
            "ratio | tokens/s, batch 1 | ratio |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    out = []
    for r in rows:
        lat = r["latency_tokens_per_s"]
        out.append(f"| {r['label']} | {100 * r['first_line_exact']:.1f}% | {r['similarity']:.3f} | "
                   f"{100 * r['same_as_base_ar']:.0f}% | {r['tokens_per_forward']:.2f} | {r['tokens_per_s']:.0f} | "
                   f"{r['tokens_per_s'] / ar['tokens_per_s']:.2f}x | "
                   + (f"{lat:.1f} | {lat / ar['latency_tokens_per_s']:.2f}x |" if lat == lat else "| |"))
    return head + "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--model", default=None, help="the base's HF directory (default: SmolLM2-135M-Instruct's)")
    ap.add_argument("--heldout", default=None, help="a data stage's heldout.jsonl (default: made from the stdlib)")
    ap.add_argument("--limit", type=int, default=64, help="held-out functions")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--latency-n", type=int, default=8, help="prompts timed one at a time")
    ap.add_argument("--prompt-tokens", type=int, default=192)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--policies", nargs="+", default=["adaptive"])
    ap.add_argument("--gammas", type=float, nargs="*", default=[0.35, 1.0])
    ap.add_argument("--threshold-gammas", type=float, nargs="*", default=[0.35])
    ap.add_argument("--lossy-latency", action="store_true", help="time the lossy rows at batch 1 too")
    ap.add_argument("--out", default="results/real_cpu")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = RealDemoConfig(out_dir=str(out), prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens,
                         n_heldout=args.limit, lossless_policies=tuple(args.policies), gammas=tuple(args.gammas),
                         threshold_gammas=tuple(args.threshold_gammas), eval_batch=args.batch,
                         latency_n=args.latency_n, latency_lossy=args.lossy_latency, lora_rank=1)
    base = Path(args.model) if args.model else stage_base(cfg)
    records = (read_records(Path(args.heldout)) if args.heldout else
               heldout_records(cfg, Tokenizer.load(base), corpus.load(None)))[:args.limit]
    done = {}

    def save(row):
        done[row["label"]] = row
        with open(out / "rows.jsonl", "a") as f:
            f.write(json.dumps({k: v for k, v in row.items() if k != "outputs"}) + "\n")
    rows = evaluate(cfg, {"base": base, "lora": (base, Path(args.adapter))}, records, [], on_row=save,
                    select=lambda d: d.model == "base" or (d.model == "lora" and d.label != "SBD LoRA r1, AR"))
    ar = next(r for r in rows if r["model"] == "base")
    for r in rows:
        r["label"] = r["label"].replace("SBD LoRA r1", "adapter").replace("original model", "base model")
        r["same_as_base_ar"] = identical_share(r["outputs"], ar["outputs"])
    md = table(rows, args.batch)
    (out / "table.md").write_text(md)
    (out / "results.json").write_text(json.dumps({"adapter": args.adapter, "settings": dataclasses.asdict(cfg),
                                                  "rows": [{k: v for k, v in r.items() if k != "outputs"}
                                                           for r in rows]}, indent=1))
    print(md)


if __name__ == "__main__":
    main()
