"""Benchmark: what each weight quantization scheme costs in quality on the real SmolLM2-135M-Instruct, next to its
float32 weights (the installed GGUF, dequantized: demos/real_model.py), on held-out standard-library code (the real
demo's held-out modules, demos/real/corpus.py): perplexity and greedy top-1 agreement with the float32 model's
next-token choice, teacher-forced over `--windows` windows of `--window` tokens. Then greedy AR decoding with an int8
KV cache (and with int8 weights + the int8 cache) next to the float32 model's full cache: the share of identical
tokens and where rows first differ (`--kv-prompts` prompts of 128 tokens, 64 new tokens each).

    .venv/bin/python bench/bench_quant_quality.py                 # -> bench/results/quant_quality_cpu.{md,json}
    .venv/bin/python bench/bench_quant_quality.py --schemes "" --gptq fp8,int8 --windows 64 --out ...  # GPTQ rows

Goals (issue 42): int8 <= 1% perplexity increase and >= 97% agreement; fp8 <= 2% / >= 94%; int4 <= 6% / >= 90%.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from demos.real import corpus  # noqa: E402
from demos.real_model import model_dir  # noqa: E402
from sbd_jax.attention import clean_meta  # noqa: E402
from sbd_jax.decoding import generate  # noqa: E402
from sbd_jax.io.hf import from_pretrained  # noqa: E402
from sbd_jax.io.tokenizer import Tokenizer  # noqa: E402
from sbd_jax.models import forward, init_cache  # noqa: E402
from sbd_jax.models.gptq import gptq_params  # noqa: E402
from sbd_jax.models.quant import Quantization, quantize_params  # noqa: E402

GOALS = {"int8": (1.0, 97.0), "fp8": (2.0, 94.0), "int4": (6.0, 90.0)}  # max ppl increase %, min agreement %


def windows(tok: Tokenizer, n: int, width: int, per_module: int = 2) -> np.ndarray:
    """[n, width + 1] token windows from the held-out modules, in path order, at most `per_module` consecutive
    windows from each (so the text spans many modules)."""
    out = []
    for m in corpus.load().heldout:
        ids = tok.encode(m.source, add_special_tokens=False)
        for i in range(min(per_module, (len(ids) - 1) // width)):
            out.append(ids[i * width:(i + 1) * width + 1])
        if len(out) >= n:
            return np.asarray(out[:n], np.int32)
    raise SystemExit(f"the held-out modules give only {len(out)} windows of {width} tokens")


def calibration_windows(tok: Tokenizer, n: int, width: int) -> np.ndarray:
    """[n, width] token windows from the corpus's *training* modules (never the held-out ones scored here), one per
    module: GPTQ's calibration text."""
    out = []
    for m in corpus.load().train:
        ids = tok.encode(m.source, add_special_tokens=False)
        if len(ids) >= width:
            out.append(ids[:width])
        if len(out) == n:
            return np.asarray(out, np.int32)
    raise SystemExit(f"the training modules give only {len(out)} windows of {width} tokens")


def scores(params, cfg, toks: np.ndarray, batch: int = 4, kv_cache_dtype=None):
    """-> (per-token negative log-likelihood [n, width], argmax [n, width]) teacher-forced; with `kv_cache_dtype`
    the window is written to a KV cache of that dtype and attends it (as decoding does)."""
    @jax.jit
    def run(params, x, y):
        B, T = x.shape
        meta = clean_meta(jnp.ones((B, T), jnp.int32), jnp.broadcast_to(jnp.arange(T), (B, T)))
        cache = init_cache(cfg, B, T, kv_cache_dtype) if kv_cache_dtype else None
        logits = forward(params, cfg, x, meta, cache)[0]
        lp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(lp, y[..., None], axis=-1)[..., 0], jnp.argmax(logits, axis=-1)
    nll, top = [], []
    for i in range(0, len(toks), batch):
        a, b = run(params, toks[i:i + batch, :-1], toks[i:i + batch, 1:])
        nll.append(np.asarray(a))
        top.append(np.asarray(b))
    return np.concatenate(nll), np.concatenate(top)


def kv_rows(params, cfg, prompts: np.ndarray, qparams) -> list[dict]:
    """Greedy AR tokens: full cache (the reference), int8 cache, int8 weights + int8 cache."""
    lengths = np.full((len(prompts),), prompts.shape[1], np.int32)
    run = lambda p, kv: np.asarray(generate(p, cfg, prompts, lengths, mode="ar", max_new_tokens=64, eos_ids=(),  # noqa: E731
                                            temperature=0.0, kv_cache_dtype=kv).tokens)
    ref = run(params, None)
    rows = []
    for name, p in (("int8 KV cache", params), ("int8 weights + int8 KV cache", qparams)):
        got = run(p, "int8")
        same = got == ref
        first = np.where(same.all(1), ref.shape[1], np.argmin(same, axis=1))
        rows.append({"case": name, "identical_tokens_pct": 100 * float(same.mean()),
                     "rows_identical": int(same.all(1).sum()), "rows": len(ref),
                     "mean_first_difference": float(first.mean())})
        print(f"{name}: {rows[-1]}")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default="int8,fp8,int4,int4-g64,int4-g128")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--kv-prompts", type=int, default=16)
    ap.add_argument("--gptq", default="", help="schemes also quantized by GPTQ (e.g. fp8,int8); int8 also with the "
                                               "int8 KV cache")
    ap.add_argument("--calibration", type=int, default=16, help="GPTQ: calibration windows (training modules)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quant_quality_cpu"))
    args = ap.parse_args()
    d = model_dir()
    cfg, params = from_pretrained(d)
    toks = windows(Tokenizer.load(d), args.windows, args.window)
    base_nll, base_top = scores(params, cfg, toks)
    base_ppl = float(np.exp(base_nll.mean()))
    rows = [{"scheme": "float32", "ppl": base_ppl, "ppl_increase_pct": 0.0, "agreement_pct": 100.0}]
    print(f"float32: ppl {base_ppl:.4f} over {base_nll.size} tokens ({len(toks)} windows of {args.window})")
    gptq = [g for g in args.gptq.split(",") if g]
    cal = calibration_windows(Tokenizer.load(d), args.calibration, args.window) if gptq else None
    gptq_cache = {}
    names = [n for n in args.schemes.split(",") if n] + ["int8 KV cache", "int8 + int8 KV cache"] * bool(args.schemes)
    names += [f"{g} GPTQ" for g in gptq] + ["int8 GPTQ + int8 KV cache"] * ("int8" in gptq)
    for name in names:
        kv = "int8" if name.endswith("KV cache") else None
        q = Quantization.of(name.split()[0]) if not name.startswith("int8 KV") else None
        t = time.perf_counter()
        if "GPTQ" in name:
            qp = gptq_cache.get(q.name) or gptq_cache.setdefault(q.name, gptq_params(params, cfg, q, cal))
        else:
            qp = quantize_params(params, cfg, q) if q else params
        nll, top = scores(qp, cfg, toks, kv_cache_dtype=kv)
        ppl = float(np.exp(nll.mean()))
        label = (q.name if q else "float32") + (" GPTQ" if "GPTQ" in name else "") + (" + int8 KV cache" if kv else "")
        q = q or Quantization("int8")  # the KV cache's goal: int8's
        row = {"scheme": label, "ppl": ppl, "ppl_increase_pct": 100 * (ppl / base_ppl - 1),
               "agreement_pct": 100 * float(np.mean(top == base_top)), "seconds": time.perf_counter() - t}
        goal = GOALS[q.scheme]
        row["goal"] = f"<= {goal[0]}% / >= {goal[1]}%"
        row["met"] = row["ppl_increase_pct"] <= goal[0] and row["agreement_pct"] >= goal[1]
        rows.append(row)
        print(f"{label:10s} ppl {ppl:.4f} (+{row['ppl_increase_pct']:.2f}%)  agreement {row['agreement_pct']:.2f}%"
              f"  goal {row['goal']}: {'met' if row['met'] else 'MISSED'}")
    lines = ["| scheme | perplexity | increase | top-1 agreement | goal (increase / agreement) | met? |",
             "|---|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['ppl']:.4f} | {r['ppl_increase_pct']:+.2f}% | {r['agreement_pct']:.2f}% | "
                     f"{r.get('goal', '')} | {('met' if r['met'] else '**missed**') if 'met' in r else ''} |")
    md = "\n".join(lines) + f"\n\n{base_nll.size} tokens: {len(toks)} windows of {args.window} tokens from the " \
                            f"held-out stdlib modules (demos/real/corpus.py split; at most 2 per module), model {d.name}\n"
    if gptq:
        md += f"GPTQ calibration: {len(cal)} windows of {args.window} tokens, one per training module\n"
    kv = kv_rows(params, cfg, toks[:args.kv_prompts, :128], quantize_params(params, cfg, "int8")) \
        if args.kv_prompts and args.schemes else []
    if kv:
        md += ("\n| greedy AR, 64 new tokens | identical tokens | rows identical | mean first difference |\n"
               "|---|---:|---:|---:|\n" + "".join(
                   f"| {r['case']} | {r['identical_tokens_pct']:.1f}% | {r['rows_identical']} / {r['rows']} | "
                   f"{r['mean_first_difference']:.1f} |\n" for r in kv)
               + f"\n(next to float32 weights with a float32 cache; {len(kv and toks[:args.kv_prompts])} prompts: "
                 "the first 128 tokens of the windows above)\n")
    Path(args.out + ".md").write_text(md)
    Path(args.out + ".json").write_text(json.dumps({"rows": rows, "kv_cache": kv, "tokens": int(base_nll.size),
                                                     "model": d.name}, indent=1))
    print(md)


if __name__ == "__main__":
    main()
