"""Per-kernel breakdown of one SBD decode attention call (run under Nsight Compute on a GPU):

    XLA_FLAGS=--xla_gpu_autotune_level=0 ncu --csv --metrics gpu__time_duration.sum \\
        python3 bench/profile_decode.py --batch 8 --cache 8192

Builds the same case as bench_attention.py's decode grid, compiles the Pallas path
(`pallas_attention_parts` over cache ; window) and the XLA reference, then calls each `--calls`
times; ncu lists every kernel launched (the Pallas kernels are named sbd_flash_decode).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from bench_attention import decode_case

from sbd_jax.attention import concat_meta, reference_attention
from sbd_jax.attention.pallas import pallas_attention_parts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--cache", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=2)
    a = ap.parse_args()
    ((ck, cv), cm), ((wk, wv), wm), q, qm, _ = decode_case(a.batch, a.k, a.cache, np.random.default_rng(0))
    parts = jax.jit(lambda q, ck, cv, cm, wk, wv, wm, qm: pallas_attention_parts(q, [(ck, cv, cm), (wk, wv, wm)], qm))
    kc, vc, km = jnp.concatenate([ck, wk], 1), jnp.concatenate([cv, wv], 1), concat_meta(cm, wm)
    ref = jax.jit(reference_attention)
    for _ in range(a.calls):
        print("pallas", float(jnp.sum(parts(q, ck, cv, cm, wk, wv, wm, qm).astype(jnp.float32))))
    for _ in range(a.calls):
        print("xla", float(jnp.sum(ref(q, kc, vc, qm, km).astype(jnp.float32))))


if __name__ == "__main__":
    main()
