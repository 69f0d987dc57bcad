"""Do the draft metrics (sbd_jax/training/draft_quality.py) predict lossless decoding? For a model (and adapter) and
held-out {"prompt_ids", "response_ids"} records (the base's greedy continuations, distill.py): the one-forward
metric's 1 + accepted at block k (blocks at fixed starts) and the chained metric (the decoder's own sequence of blocks
replayed from k forwards), next to the tokens per forward that verify mode measures decoding the same prompts with
every call drafting at width k (`--draft-policy always`), greedy, as many new tokens as each continuation.

    python bench/bench_draft_metric.py --model DIR [--adapter DIR] --data heldout_distilled.jsonl --rows 16 --k 4 8
"""
from __future__ import annotations

import argparse
import json
import time

import jax.numpy as jnp
import numpy as np

from sbd_jax.decoding import generate
from sbd_jax.io.hf import from_pretrained
from sbd_jax.io.peft import apply_adapter
from sbd_jax.training.draft_quality import chained_tokens_per_forward, draft_quality, load_draft_set


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapter", default=None)
    ap.add_argument("--data", required=True)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=192)
    ap.add_argument("--cont-len", type=int, default=128)
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    cfg, params = from_pretrained(args.model)
    if args.adapter:
        cfg, params = apply_adapter(cfg, params, args.adapter, model_dir=args.model)
    ds = load_draft_set(args.data, rows=args.rows, prompt_len=args.prompt_len, cont_len=args.cont_len)
    rows = []
    for k in args.k:
        q = draft_quality(params, cfg, ds, k)
        chained = chained_tokens_per_forward(params, cfg, ds, k)
        made = nfe = 0
        t0 = time.time()
        for i in range(0, len(ds.prompt_lengths), args.batch):
            lens = ds.prompt_lengths[i:i + args.batch]
            P = int(lens.max())
            ids = np.stack([np.pad(ds.tokens[r, :lens[r - i]], (0, P - lens[r - i])) for r in range(i, i + len(lens))])
            out = generate(params, cfg, jnp.asarray(ids, jnp.int32), jnp.asarray(lens), mode="sbd", verify=True,
                           draft_policy="always", block_size=k, max_new_tokens=args.cont_len,
                           row_max_new_tokens=jnp.asarray(ds.cont_lengths[i:i + args.batch]), eos_ids=())
            made += int(np.sum(np.asarray(out.lengths)))
            nfe += int(np.sum(np.asarray(out.nfe)))
        row = {"k": k, "metric_tokens_per_forward": round(1 + q.accepted, 3),
               "chained_tokens_per_forward": round(chained, 3), "measured_tokens_per_forward":
               round(made / nfe, 3), "agreement": [round(float(a), 3) for a in q.agreement],
               "ar_agreement": round(q.ar_agreement, 3), "blocks": q.blocks, "decode_s": round(time.time() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "adapter": args.adapter, "data": args.data, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
