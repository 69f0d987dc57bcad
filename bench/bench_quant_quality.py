"""Benchmark: what each weight quantization scheme costs in quality on the real SmolLM2-135M-Instruct, next to its
float32 weights (the installed GGUF, dequantized: demos/real_model.py), on held-out standard-library code (the real
demo's held-out modules, demos/real/corpus.py): perplexity and greedy top-1 agreement with the float32 model's
next-token choice, teacher-forced over `--windows` windows of `--window` tokens.

    .venv/bin/python bench/bench_quant_quality.py                 # -> bench/results/quant_quality_cpu.{md,json}

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
from sbd_jax.io.hf import from_pretrained  # noqa: E402
from sbd_jax.io.tokenizer import Tokenizer  # noqa: E402
from sbd_jax.models import forward  # noqa: E402
from sbd_jax.models.quant import Quantization, quantize_params  # noqa: E402

GOALS = {"int8": (1.0, 97.0), "fp8": (2.0, 94.0), "int4": (6.0, 90.0)}  # max ppl increase %, min agreement %


def windows(tok: Tokenizer, n: int, width: int) -> np.ndarray:
    """[n, width + 1] token windows from the held-out modules, in path order, one window per module at most (so
    the text spans many modules)."""
    out = []
    for m in corpus.load().heldout:
        ids = tok.encode(m.source, add_special_tokens=False)
        if len(ids) > width:
            out.append(ids[:width + 1])
        if len(out) == n:
            break
    return np.asarray(out, np.int32)


def scores(params, cfg, toks: np.ndarray, batch: int = 4):
    """-> (per-token negative log-likelihood [n, width], argmax [n, width]) teacher-forced."""
    T = toks.shape[1] - 1
    meta = clean_meta(jnp.ones((batch, T), jnp.int32), jnp.broadcast_to(jnp.arange(T), (batch, T)))

    @jax.jit
    def run(params, x, y):
        logits = forward(params, cfg, x, meta)[0]
        lp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(lp, y[..., None], axis=-1)[..., 0], jnp.argmax(logits, axis=-1)
    nll, top = [], []
    for i in range(0, len(toks), batch):
        a, b = run(params, toks[i:i + batch, :-1], toks[i:i + batch, 1:])
        nll.append(np.asarray(a))
        top.append(np.asarray(b))
    return np.concatenate(nll), np.concatenate(top)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default="int8,fp8,int4,int4-g64,int4-g128")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quant_quality_cpu"))
    args = ap.parse_args()
    d = model_dir()
    cfg, params = from_pretrained(d)
    toks = windows(Tokenizer.load(d), args.windows, args.window)
    base_nll, base_top = scores(params, cfg, toks)
    base_ppl = float(np.exp(base_nll.mean()))
    rows = [{"scheme": "float32", "ppl": base_ppl, "ppl_increase_pct": 0.0, "agreement_pct": 100.0}]
    print(f"float32: ppl {base_ppl:.4f} over {base_nll.size} tokens ({len(toks)} windows of {args.window})")
    for name in args.schemes.split(","):
        q = Quantization.of(name)
        t = time.perf_counter()
        qp = quantize_params(params, cfg, q)
        nll, top = scores(qp, cfg, toks)
        ppl = float(np.exp(nll.mean()))
        row = {"scheme": q.name, "ppl": ppl, "ppl_increase_pct": 100 * (ppl / base_ppl - 1),
               "agreement_pct": 100 * float(np.mean(top == base_top)), "seconds": time.perf_counter() - t}
        goal = GOALS[q.scheme]
        row["goal"] = f"<= {goal[0]}% / >= {goal[1]}%"
        row["met"] = row["ppl_increase_pct"] <= goal[0] and row["agreement_pct"] >= goal[1]
        rows.append(row)
        print(f"{q.name:10s} ppl {ppl:.4f} (+{row['ppl_increase_pct']:.2f}%)  agreement {row['agreement_pct']:.2f}%"
              f"  goal {row['goal']}: {'met' if row['met'] else 'MISSED'}")
    lines = ["| scheme | perplexity | increase | top-1 agreement | goal (increase / agreement) | met? |",
             "|---|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['ppl']:.4f} | {r['ppl_increase_pct']:+.2f}% | {r['agreement_pct']:.2f}% | "
                     f"{r.get('goal', '')} | {('met' if r['met'] else '**missed**') if 'met' in r else ''} |")
    md = "\n".join(lines) + f"\n\n{base_nll.size} tokens: {len(toks)} held-out stdlib modules' first {args.window} " \
                            f"tokens each (demos/real/corpus.py split), model {d.name}\n"
    Path(args.out + ".md").write_text(md)
    Path(args.out + ".json").write_text(json.dumps({"rows": rows, "tokens": int(base_nll.size),
                                                     "model": d.name}, indent=1))
    print(md)


if __name__ == "__main__":
    main()
