"""Where a verify wide call's time goes on this device, at SmolLM2-135M's shape (random weights, float32, batch 1, a
cache of 320 slots): the model's forward (hidden states only) by queries per row, then the output head (`lm_head` +
argmax) by how its rows are grouped, each against the 1-query forward with its head (an AR step's call).

    .venv/bin/python bench/bench_wide_call.py --out bench/results/real_widths/wide_call_cpu.md

A width-w call runs w clean + w * w copy queries, then AR's tokens at the clean queries and the drafts of the
outcome its check chose: two heads of w rows, or (w <= step.py's ONE_HEAD_MAX_WIDTH) one head of every query's rows,
whichever this bench shows cheaper. Each variant runs 16 calls in one compiled
loop; medians of --rounds interleaved rounds, with their spread.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from sbd_jax.attention import clean_meta, concat_meta, copy_meta  # noqa: E402
from sbd_jax.models import init_params, unstack_layers  # noqa: E402
from sbd_jax.models.transformer import forward, init_cache, lm_head  # noqa: E402
from shapes import SHAPES  # noqa: E402

CALLS, CACHE, AT = 16, 320, 200
# (name, clean queries, copy queries, head row groups)
VARIANTS = [("AR step: 1 query, head of 1 row", 1, 0, [(0, 1)]),
            ("1 query, no head", 1, 0, []),
            ("w = 2: 2 clean + 4 copy, no head", 2, 4, []),
            ("w = 2: two heads of 2 rows", 2, 4, [(0, 2), (2, 4)]),
            ("w = 2: one head of all 6 rows (as built)", 2, 4, [(0, 6)]),
            ("w = 4: 4 clean + 16 copy, no head", 4, 16, []),
            ("w = 4: two heads of 4 rows", 4, 16, [(0, 4), (4, 8)]),
            ("w = 4: one head of all 20 rows (as built)", 4, 16, [(0, 20)])]


def program(cfg, clean: int, copies: int, heads):
    def run(params, cache):
        def call(i, carry):
            cache, acc = carry
            pos = AT + jnp.arange(clean, dtype=jnp.int32)[None]
            meta, tok = clean_meta(jnp.ones((1, clean), jnp.int32), pos), jnp.ones((1, clean), jnp.int32) + i
            if copies:
                cpos = AT + 1 + jnp.arange(copies, dtype=jnp.int32)[None]
                meta = concat_meta(meta, copy_meta(jnp.ones((1, copies), jnp.int32), cpos, cpos))
                tok = jnp.concatenate([tok, jnp.full((1, copies), cfg.mask_token_id, jnp.int32)], 1)
            h, cache = forward(params, cfg, tok, meta, cache, return_hidden=True)
            for a, b in heads:
                acc = acc + jnp.argmax(lm_head(params, cfg, h[:, a:b]), -1).sum()
            return cache, acc
        return jax.lax.fori_loop(0, CALLS, call, (cache, jnp.int32(0)))
    return jax.jit(run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cfg = dataclasses.replace(SHAPES["smollm2-135m"], mask_token_id=SHAPES["smollm2-135m"].vocab_size - 1)
    params = unstack_layers(jax.jit(lambda k: init_params(cfg, k))(jax.random.key(0)), delete=True)
    cache = init_cache(cfg, 1, CACHE)
    progs = [program(cfg, c, n, h) for _, c, n, h in VARIANTS]
    for p in progs:
        jax.block_until_ready(p(params, cache))
    ms = [[] for _ in progs]
    for _ in range(a.rounds):
        for i, p in enumerate(progs):
            t = time.perf_counter()
            jax.block_until_ready(p(params, cache))
            ms[i].append(1e3 * (time.perf_counter() - t) / CALLS)
    base = float(np.median(ms[0]))
    lines = [f"SmolLM2-135M shape, random float32 weights, batch 1, cache {CACHE}; {jax.devices()[0].device_kind}; "
             f"medians of {a.rounds} interleaved rounds of {CALLS} calls", "",
             "| call | ms | spread | x AR step |", "|---|---:|---:|---:|"]
    for (name, *_), m in zip(VARIANTS, ms):
        lines.append(f"| {name} | {np.median(m):.1f} | {min(m):.1f}-{max(m):.1f} | {np.median(m) / base:.2f} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
