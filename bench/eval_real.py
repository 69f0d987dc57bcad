"""SmolLM2-135M-Instruct (or `--model`) + an SBD adapter on held-out stdlib functions, on this machine
(demos/real/adapter_eval.py): the base model's AR, the adapter's lossless (verify) rows per drafting policy and the
lossy EB / threshold rules; first-line exact, similarity, rows == the base's AR, tokens per forward, tokens/s at
`--batch` rows and at batch 1, and the ratios to the base's AR. Writes table.md and results.json to `--out`;
`--record` also writes the adapter's record.json (the settings, the functions and every row with its completions),
which `make demo-real-eval` decodes again.

    python bench/eval_real.py --adapter adapters/smollm2-135m-sbd-copy-lora-r32 --limit 64 --out results/real_cpu

The held-out functions are made from this interpreter's stdlib (`--prompt-tokens`), or read from a data stage's
heldout.jsonl (`--heldout`, e.g. the data the GPU campaign carries).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from demos.real import corpus  # noqa: E402
from demos.real.adapter_eval import settings  # noqa: E402
from demos.real.evaluation import read_records  # noqa: E402
from demos.real.recipe import stage_eval  # noqa: E402
from demos.real.reproduce import prompt_digest  # noqa: E402
from demos.real.stages import heldout_records, stage_base  # noqa: E402
from sbd_jax.io.tokenizer import Tokenizer  # noqa: E402


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
    ap.add_argument("--policies", nargs="*", default=["adaptive", "always"], help="lossless rows (none: lossy rows only)")
    ap.add_argument("--always-blocks", type=int, nargs="*", default=[2, 4],
                    help="the 'always' rows' block sizes, one row each (none given: one row at the table's, 16)")
    ap.add_argument("--gammas", type=float, nargs="*", default=[0.35, 1.0])
    ap.add_argument("--threshold-gammas", type=float, nargs="*", default=[0.35, 1.0])
    ap.add_argument("--lossy-latency", action="store_true", help="time the lossy rows at batch 1 too")
    ap.add_argument("--out", default="results/real_cpu")
    ap.add_argument("--record", action="store_true", help="also write <adapter>/record.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = settings(out_dir=str(out), prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens,
                   n_heldout=args.limit, lossless_policies=tuple(args.policies),
                   always_blocks=tuple(args.always_blocks), gammas=tuple(args.gammas),
                   threshold_gammas=tuple(args.threshold_gammas), eval_batch=args.batch, latency_n=args.latency_n,
                   latency_lossy=args.lossy_latency)
    base = Path(args.model) if args.model else stage_base(cfg)
    mods = None if args.heldout else corpus.load(None)
    records = (read_records(Path(args.heldout)) if args.heldout else
               heldout_records(cfg, Tokenizer.load(base), mods))[:args.limit]

    rows = stage_eval(cfg, base, Path(args.adapter), records, [], out)
    plain = [{k: v for k, v in r.items() if k != "outputs"} for r in rows]
    if args.record:
        rec = {"settings": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "out_dir"},
               "corpus": mods.summary() if mods else None, "device": str(jax.devices()[0].device_kind),
               "machine": f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}",
               "functions": [r["id"] for r in records],
               "prompt_digests": {r["id"]: prompt_digest(r["prompt_ids"]) for r in records},
               "rows": [{**p, "outputs": {i: o for i, o in zip((r["id"] for r in records), r["outputs"])}}
                        for p, r in zip(plain, rows)]}
        (Path(args.adapter) / "record.json").write_text(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
