"""Benchmark: what a verify call costs when its draft width is chosen at run time (the adaptive policy's program:
every width's step compiled, one taken per call) against the same width fixed at trace time (one step compiled),
on the committed copy-only adapter (SmolLM2-135M) at batch 1: ms per call, tokens per forward, tokens/s.

    .venv/bin/python bench/bench_chosen_width.py --n 3 --out bench/results/real_widths/chosen_width_cpu.md

Policies are functions choose(state, env) -> kind (0: AR, i: the i-th draft width of the block): "fixed" returns a
Python int (XLA sees a constant and compiles one step), "run time" the same value computed from the loop state.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_real_widths import real_setup  # noqa: E402
from sbd_jax.decoding.decoder import generate  # noqa: E402


def fixed_w2_of_16(state, env):
    return 4  # block 16's widths (16, 8, 4, 2): kind 4 = width 2


def chosen_w2_of_16(state, env):
    return jnp.where(jnp.sum(state.nfe) >= 0, 4, 0).astype(jnp.int32)  # always 4, known only at run time


def fixed_ar_of_16(state, env):
    return 0


def chosen_ar_of_16(state, env):
    return jnp.where(jnp.sum(state.nfe) < 0, 4, 0).astype(jnp.int32)


CONFIGS = {"base, AR": ("base", dict(mode="ar")),
           "block 2, always (width 2)": ("lora", dict(block_size=2, draft_policy="always")),
           "block 16, width 2 fixed": ("lora", dict(block_size=16, draft_policy=fixed_w2_of_16)),
           "block 16, width 2 chosen at run time": ("lora", dict(block_size=16, draft_policy=chosen_w2_of_16)),
           "block 16, AR calls fixed": ("lora", dict(block_size=16, draft_policy=fixed_ar_of_16)),
           "block 16, AR calls chosen at run time": ("lora", dict(block_size=16, draft_policy=chosen_ar_of_16)),
           "block 16, adaptive": ("lora", dict(block_size=16, draft_policy="adaptive"))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3, help="held-out functions, decoded one at a time")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="timed runs per prompt (the fastest kept)")
    ap.add_argument("--out", default="bench/results/real_widths/chosen_width_cpu.md")
    args = ap.parse_args(argv)
    if min(args.n, args.max_new, args.reps) < 1:
        ap.error(f"--n, --max-new and --reps must be >= 1, got {args.n}, {args.max_new}, {args.reps}")
    models, prompts = real_setup(args.n)
    P = max(len(p.ids) for p in prompts)
    lines = [f"{args.n} held-out functions one at a time, {args.max_new} new tokens, greedy, fastest of {args.reps} "
             f"runs each; {jax.devices()[0].device_kind}\n",
             "| decoding | ms / call | tokens / forward | tokens/s |", "|---|---:|---:|---:|"]
    for label, (model, kw) in CONFIGS.items():
        mcfg, params = models[model]
        kw = kw if model == "base" else dict(mode="sbd", verify=True, **kw)
        seconds = calls = nfe = 0
        for p in prompts:
            ids = np.zeros((1, P), np.int32)
            ids[0, :len(p.ids)] = p.ids
            run = lambda: generate(params, mcfg, ids, np.array([len(p.ids)]), max_new_tokens=args.max_new,  # noqa: E731
                                   eos_ids=(), **kw)
            jax.block_until_ready(run().tokens)  # compiled, warm
            best = float("inf")
            for _ in range(args.reps):
                t0 = time.perf_counter()
                out = run()
                jax.block_until_ready(out.tokens)
                best = min(best, time.perf_counter() - t0)
            seconds, calls, nfe = seconds + best, calls + int(out.iterations), nfe + int(np.asarray(out.nfe).sum())
        tokens = args.n * args.max_new
        lines.append(f"| {label} | {1e3 * seconds / calls:.1f} | {tokens / nfe:.2f} | {tokens / seconds:.1f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
