"""Benchmark: SBD Pallas attention kernels vs the XLA reference (and jax.nn.dot_product_attention
with the dense SBD mask), at Llama-3.1-8B attention shapes (32 query heads, 8 KV heads,
head_dim 128, bfloat16).

  decode:   a window of 2k queries (the finished block as clean queries + the next block of k
            masks) against a full static cache of S slots: k in {16, 32}, S in {4k..32k},
            batch in {1..32}. Reports the kernel's achieved memory bandwidth (K/V bytes it must
            read / time) against the device's measured copy bandwidth.
  training: the doubled [x ; x_hat] sequence (T = 2L), L in {2k, 4k, 8k}, k = 16, forward and
            forward+backward.

Ratios (kernel time / other time) come from one run of this script. Run it on a GPU:

    .venv/bin/python bench/bench_attention.py               # full grid
    .venv/bin/python bench/bench_attention.py --quick       # a few shapes

On CPU, Pallas only runs in interpret mode, whose timings mean nothing: the script refuses
(exit status 2) unless --allow-cpu, which runs tiny shapes only to check that the script works.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/layouts.py: the shared fixtures

import jax
import jax.numpy as jnp
import numpy as np

from sbd_jax.attention import concat_meta, dense_mask, reference_attention
from sbd_jax.attention.pallas import pallas_attention, pallas_attention_parts
from sbd_jax.decoding.roofline import copy_bandwidth
from sbd_jax.attention.pallas.tiling import tile_visibility
from layouts import decode_meta, random_qkv, training_meta

H, K, D = 32, 8, 128
DTYPE = jnp.bfloat16


LAST = {}  # name -> last output of the timed function (for the error column)


def _checksum(out):
    """A scalar that depends on every output element (so no output can be dead code)."""
    return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(out))


def timeit(fn, *args, reps=10, warmup=2, name=None, loop=(4, 12)):
    """Device time (s) of one call of `fn(*args)`, or None + reason on failure.

    Each measurement runs `fn` n times inside ONE jitted `fori_loop` (each iteration's first
    argument is perturbed by a runtime scalar carried from the previous output, so nothing is
    hoisted out of the loop or elided) and the time of n1 iterations is subtracted from the time of
    n2: what is left is device time per call, free of the host's dispatch and sync cost (which can
    exceed a decode kernel's time: BENCHMARKS.md "Pallas kernels on an H100"). Median over `reps` pairs."""
    n1, n2 = loop

    def looped(n):
        @jax.jit
        def run(first, *rest):
            def body(i, c):
                out = fn((first + c.astype(first.dtype)), *rest)
                return (c + _checksum(out)) * 1e-30
            return jax.lax.fori_loop(0, n, body, jnp.float32(0))
        return run

    try:
        out = jax.block_until_ready(jax.jit(fn)(*args))
        runs = {n: looped(n) for n in (n1, n2)}
        for _ in range(warmup):
            for r in runs.values():
                jax.block_until_ready(r(*args))
        ts = []
        for _ in range(reps):
            pair = []
            for n in (n1, n2):
                t = time.perf_counter()
                jax.block_until_ready(runs[n](*args))
                pair.append(time.perf_counter() - t)
            ts.append((pair[1] - pair[0]) / (n2 - n1))
        if name:
            LAST[name] = out
        return statistics.median(ts), ""
    except (jax.errors.JaxRuntimeError, ValueError, NotImplementedError, TypeError) as e:
        # out of memory, or a baseline that does not support the shape: a table cell, not fatal
        if name:
            LAST.pop(name, None)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"


def rel_err(a, b):
    """max |a - b| / max |b| over all leaves, or 'n/a' when either output is missing."""
    if a is None or b is None:
        return "n/a"
    la = [np.asarray(x, np.float32) for x in jax.tree.leaves(a)]
    lb = [np.asarray(x, np.float32) for x in jax.tree.leaves(b)]
    return f"{max(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30) for x, y in zip(la, lb)):.1e}"


def decode_case(B, k, S, rng):
    """A full cache of S slots (the window's clean block fills the last k of them) and the window's
    2k queries: (cache part, window part, q, q_meta) and the K/V bytes a kernel must read."""
    T = 2 * k
    q_meta, cache_meta, win_meta = decode_meta(np.full((B,), S - T), S, k)
    q, kk, vv, _ = random_qkv(jax.random.PRNGKey(int(rng.integers(1 << 30))), B, T, S + T, H, K, D, DTYPE)
    cache, win = (kk[:, :S], vv[:, :S]), (kk[:, S:], vv[:, S:])
    read_bytes = 2 * B * S * K * D * jnp.dtype(DTYPE).itemsize
    return (cache, cache_meta), (win, win_meta), q, q_meta, read_bytes


def train_case(L, k, B=1):
    """One document of L tokens per row, doubled: q, k, v [B, 2L, ...] and the metadata."""
    q, kc, vc, _ = random_qkv(jax.random.PRNGKey(L), B, 2 * L, 2 * L, H, K, D, DTYPE)
    return q, kc, vc, training_meta([[L]] * B, L, k)


def sdpa(q, k, v, qm, km):
    """jax.nn.dot_product_attention with the dense SBD mask (O(T*S) mask in memory)."""
    mask = dense_mask(qm, km)[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask)


IMPLS = {
    "pallas": lambda q, k, v, qm, km: pallas_attention(q, k, v, qm, km),
    "xla_ref": reference_attention,
    "sdpa": sdpa,
}


def pallas_decode_fn(blocks=None):
    """Jitted Pallas decode attention over (cache ; window keys), reading the cache in place."""
    return jax.jit(lambda q, ck, cv, cm, wk, wv, wm, qm: pallas_attention_parts(
        q, [(ck, cv, cm), (wk, wv, wm)], qm, blocks=blocks))


def fmt_ms(t, err):
    return f"{t * 1e3:.3f}" if t is not None else f"n/a ({err})"


def ratio(a, b):
    return f"{a / b:.2f}" if a is not None and b is not None else "n/a"


def bench_decode(batches, ks, caches, reps, copy_gib=4.0):
    """pallas: `pallas_attention_parts` on (cache ; window keys), reading the cache in place.
    xla_ref / sdpa: on the concatenated K/V (the concatenation itself is NOT timed)."""
    rng = np.random.default_rng(0)
    bw = copy_bandwidth(copy_gib)
    print(f"\ndevice copy bandwidth: {bw / 1e9:.0f} GB/s\n")
    print("| batch | k | cache | pallas ms | xla_ref ms | sdpa ms | pallas/xla | pallas/sdpa "
          "| pallas GB/s | % of copy bw | rel err vs xla |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    parts_fn = pallas_decode_fn()
    for B in batches:
        for k in ks:
            for S in caches:
                ((ck, cv), cm), ((wk, wv), wm), q, qm, read_bytes = decode_case(B, k, S, rng)
                t = {"pallas": timeit(parts_fn, q, ck, cv, cm, wk, wv, wm, qm, reps=reps,
                                      name="pallas")}
                kc, vc = jnp.concatenate([ck, wk], 1), jnp.concatenate([cv, wv], 1)
                km = concat_meta(cm, wm)
                for name in ("xla_ref", "sdpa"):
                    t[name] = timeit(jax.jit(IMPLS[name]), q, kc, vc, qm, km, reps=reps, name=name)
                del kc, vc
                tp = t["pallas"][0]
                gbs = f"{read_bytes / tp / 1e9:.0f}" if tp else "n/a"
                pct = f"{100 * read_bytes / tp / bw:.0f}%" if tp else "n/a"
                print(f"| {B} | {k} | {S} | {fmt_ms(*t['pallas'])} | {fmt_ms(*t['xla_ref'])} | "
                      f"{fmt_ms(*t['sdpa'])} | {ratio(tp, t['xla_ref'][0])} | "
                      f"{ratio(tp, t['sdpa'][0])} | {gbs} | {pct} | "
                      f"{rel_err(LAST.get('pallas'), LAST.get('xla_ref'))} |", flush=True)
                LAST.clear()


def bench_train(lengths, k, reps):
    print("\n| L (T = 2L) | pass | pallas ms | xla_ref ms | sdpa ms | pallas/xla | pallas/sdpa "
          "| tiles computed | rel err vs xla |")
    print("|---|---|---|---|---|---|---|---|---|")
    for L in lengths:
        q, kc, vc, meta = train_case(L, k)
        frac = float(jnp.mean(tile_visibility(meta, meta, 64, 64)))
        for pass_ in ("fwd", "fwd+bwd"):
            t = {}
            for name, fn in IMPLS.items():
                if pass_ == "fwd":
                    f = jax.jit(lambda q, k, v, m, fn=fn: fn(q, k, v, m, m))
                else:
                    f = jax.jit(jax.grad(lambda q, k, v, m, fn=fn: jnp.sum(
                        fn(q, k, v, m, m).astype(jnp.float32)), argnums=(0, 1, 2)))
                t[name] = timeit(f, q, kc, vc, meta, reps=reps, name=name)
            tp = t["pallas"][0]
            print(f"| {L} | {pass_} | {fmt_ms(*t['pallas'])} | {fmt_ms(*t['xla_ref'])} | "
                  f"{fmt_ms(*t['sdpa'])} | {ratio(tp, t['xla_ref'][0])} | "
                  f"{ratio(tp, t['sdpa'][0])} | {100 * frac:.1f}% | "
                  f"{rel_err(LAST.get('pallas'), LAST.get('xla_ref'))} |", flush=True)
            LAST.clear()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--only", choices=("decode", "train"), default=None)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batches", help="comma list overriding the decode batch sizes")
    ap.add_argument("--ks", help="comma list overriding the decode block sizes")
    ap.add_argument("--caches", help="comma list overriding the decode cache lengths")
    ap.add_argument("--lengths", help="comma list overriding the training lengths L")
    ap.add_argument("--allow-cpu", action="store_true",
                    help="run tiny shapes in interpret mode to check the script (timings meaningless)")
    args = ap.parse_args(argv)

    backend = jax.default_backend()
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"jax {jax.__version__}, backend {backend}, devices {jax.devices()}")
    if backend == "cpu":
        if not args.allow_cpu:
            print("REFUSED: no GPU/TPU. Pallas runs only in interpret mode on CPU, so kernel timings "
                  "would be meaningless. Run this on a GPU (or pass --allow-cpu to smoke-test the "
                  "script on tiny shapes).", file=sys.stderr)
            return 2
        global H, K, D
        H, K, D = 4, 2, 16
        print("\nWARNING: CPU interpret mode, tiny shapes: these numbers are NOT kernel timings.")
        if args.only in (None, "decode"):
            bench_decode([1], [4], [64], reps=1, copy_gib=0.01)
        if args.only in (None, "train"):
            bench_train([32], 4, reps=1)
        return 0

    if args.quick:
        batches, ks, caches, lengths = [1, 8], [16], [4096, 8192], [2048]
    else:
        batches, ks, caches, lengths = [1, 8, 32], [16, 32], [4096, 8192, 16384, 32768], [2048, 4096, 8192]
    ints = lambda s: [int(x) for x in s.split(",")]
    batches = ints(args.batches) if args.batches else batches
    ks = ints(args.ks) if args.ks else ks
    caches = ints(args.caches) if args.caches else caches
    lengths = ints(args.lengths) if args.lengths else lengths
    if args.only in (None, "decode"):
        bench_decode(batches, ks, caches, args.reps)
    if args.only in (None, "train"):
        bench_train(lengths, 16, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
