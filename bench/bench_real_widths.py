"""Benchmark: lossless (verify) decoding of the committed copy-only adapter on SmolLM2-135M at batch 1, by block
size (the widest draft width) and drafting policy, next to the base's AR: tokens per forward, tokens/s (compilation
excluded), rows equal to AR; then what a call costs on this machine by its queries per row (one forward with the
cache, timed), which is what turns tokens per forward into tokens/s.

    .venv/bin/python bench/bench_real_widths.py --n 8 --out bench/results/real_widths/cpu.md

A width-w verify call runs w + w * w queries per row (w clean, one copy block of w per outcome of its check).
ms / call: seconds per forward (at batch 1 each call is one forward of the row).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from demos.real import corpus  # noqa: E402
from demos.real.config import RealDemoConfig  # noqa: E402
from demos.real.evaluation import _prompts, load_models  # noqa: E402
from demos.real.reproduce import ADAPTER, load_record  # noqa: E402
from demos.real.stages import heldout_records, stage_base  # noqa: E402
from demos.toy.evaluation import batch_decoder, decode_all, suite_width  # noqa: E402
from sbd_jax.attention import clean_meta  # noqa: E402
from sbd_jax.config import from_dict  # noqa: E402
from sbd_jax.io.tokenizer import Tokenizer  # noqa: E402
from sbd_jax.models.transformer import forward, init_cache  # noqa: E402

CONFIGS = ("ar", "2:always", "4:always", "8:always", "4:adaptive", "16:adaptive")


def real_setup(n: int):
    """-> ({"base": the base model, "lora": the base with the committed adapter merged}, the first `n` held-out
    functions of the adapter's record as prompts)."""
    rec = load_record(ADAPTER)
    cfg = from_dict(RealDemoConfig, {**rec["settings"], "out_dir": "/tmp/bench_real_widths"})
    base = stage_base(cfg)
    by_id = {r["id"]: r for r in heldout_records(cfg, Tokenizer.load(base), corpus.load(cfg.corpus_root))}
    prompts = _prompts([by_id[i] for i in rec["functions"][:n]])
    return load_models({"base": base, "lora": (base, ADAPTER)}), prompts


def decode_rows(models, prompts, width: int, conf: str, max_new: int) -> dict:
    if conf == "ar":
        mcfg, params = models["base"]
        kw = dict(mode="ar", block_size=16, verify=False)
    else:
        k, policy = conf.split(":")
        mcfg, params = models["lora"]
        kw = dict(mode="sbd", block_size=int(k), verify=True, draft_policy=policy)
    dec = batch_decoder(params, mcfg, gamma=0.0, rule="eb", max_new_tokens=max_new, batch_size=1,
                        prompt_width=width, **kw)
    rows, s = decode_all(dec, prompts)
    return {"conf": conf, "tokens_per_forward": s.tokens_per_forward, "tokens_per_s": s.tokens_per_s,
            "ms_per_call": 1e3 * s.tokens_per_forward / s.tokens_per_s,
            "outputs": [r.tokens for r in rows]}


def call_seconds(models, queries: tuple[int, ...], cache_len: int, rounds: int = 7) -> dict[int, float]:
    """Per query count q: one forward of q clean tokens per row (batch 1) against a cache of `cache_len`, logits
    of all q included (a verify call computes 2w of them), median seconds over `rounds` interleaved rounds."""
    mcfg, params = models["base"]
    cache = init_cache(mcfg, 1, cache_len)
    calls = {}
    for q in queries:
        tok = jnp.ones((1, q), jnp.int32)
        meta = clean_meta(jnp.ones((1, q), jnp.int32), jnp.arange(q, dtype=jnp.int32)[None] + cache_len // 2)
        f = jax.jit(lambda p, t, m, c: forward(p, mcfg, t, m, c)[0])
        f(params, tok, meta, cache).block_until_ready()
        calls[q] = (f, tok, meta)
    times = {q: [] for q in queries}
    for _ in range(rounds):
        for q, (f, tok, meta) in calls.items():
            t0 = time.perf_counter()
            f(params, tok, meta, cache).block_until_ready()
            times[q].append(time.perf_counter() - t0)
    return {q: sorted(t)[len(t) // 2] for q, t in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8, help="held-out functions, decoded one at a time")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), help="ar, or BLOCK:POLICY")
    ap.add_argument("--out", default="bench/results/real_widths/cpu.md")
    args = ap.parse_args(argv)
    models, prompts = real_setup(args.n)
    width = suite_width(prompts)
    rows = [decode_rows(models, prompts, width, c, args.max_new) for c in args.configs]
    ar = next((r for r in rows if r["conf"] == "ar"), None)
    cache_len = width + args.max_new
    seconds = call_seconds(models, (1, 2, 4, 6, 12, 20, 72), cache_len)
    one = seconds[1]
    costs = {q: s / one for q, s in seconds.items() if q > 1}
    lines = [f"{args.n} held-out functions one at a time, {args.max_new} new tokens, greedy; "
             f"{jax.devices()[0].device_kind}\n",
             "| decoding | tokens / forward | tokens/s | ms / call | ratio to AR | rows = AR |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        same = sum(a == b for a, b in zip(r["outputs"], ar["outputs"])) / len(r["outputs"]) if ar else float("nan")
        ratio = r["tokens_per_s"] / ar["tokens_per_s"] if ar else float("nan")
        label = "base, AR" if r["conf"] == "ar" else f"adapter, lossless, block {r['conf'].replace(':', ', ')}"
        lines.append(f"| {label} | {r['tokens_per_forward']:.2f} | {r['tokens_per_s']:.1f} | {r['ms_per_call']:.1f} | "
                     f"{ratio:.2f}x | {100 * same:.0f}% |")
    lines += ["", f"A forward by queries per row (batch 1, cache {cache_len}, logits included; 1 query = "
              f"{1e3 * one:.1f} ms; medians of 7 interleaved rounds):", "",
              "| queries | " + " | ".join(str(q) for q in costs) + " |", "|---|" + "---:|" * len(costs),
              "| cost in 1-query forwards | " + " | ".join(f"{c:.2f}" for c in costs.values()) + " |"]
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"rows": [{k: v for k, v in r.items() if k != "outputs"}
                                                             for r in rows], "call_costs": costs,
                                                    "one_query_s": one}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
