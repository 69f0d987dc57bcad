"""Sweep the decode kernel's tile options on a GPU (Llama-3.1-8B attention shapes, bf16, k = 16,
cache 8192) and print device time per call and achieved bandwidth for each; used to pick
DEFAULT_BLOCKS["triton"]. Timing as bench_attention.py (device loops).

    python3 bench/tune_decode.py
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from bench_attention import copy_bandwidth, decode_case, pallas_decode_fn, timeit

from sbd_jax.attention.pallas import BlockSizes


def main():
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    print("| batch | block_k | rows | warps | stages | splits | ms | GB/s | % bw |")
    print("|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for B in (1, 8):
        ((ck, cv), cm), ((wk, wv), wm), q, qm, read_bytes = decode_case(B, 16, 8192, rng)
        best = None
        # splits: None = auto_num_splits, or a fixed count (about twice auto's choice)
        for bk, rows, warps, stages, ns in itertools.product((64, 128), (64, 128), (4, 8), (2,),
                                                             (None, {1: 64, 8: 16}[B])):
            blocks = BlockSizes(decode_block_k=bk, decode_block_rows=rows, num_warps=warps, num_stages=stages,
                                num_splits=ns)
            t, err = timeit(pallas_decode_fn(blocks), q, ck, cv, cm, wk, wv, wm, qm, reps=5)
            if t is None:
                print(f"| {B} | {bk} | {rows} | {warps} | {stages} | {ns} | failed: {err} | | |", flush=True)
                continue
            print(f"| {B} | {bk} | {rows} | {warps} | {stages} | {ns or 'auto'} | {t * 1e3:.3f} | "
                  f"{read_bytes / t / 1e9:.0f} | {100 * read_bytes / t / bw:.0f}% |", flush=True)
            if best is None or t < best[0]:
                best = (t, bk, rows, warps, stages, ns)
        print(f"BEST batch {B}: {best[0] * 1e3:.3f} ms, block_k {best[1]}, rows {best[2]}, warps {best[3]}, "
              f"stages {best[4]}, splits {best[5] or 'auto'}: {100 * read_bytes / best[0] / bw:.0f}% of copy bw",
              flush=True)


if __name__ == "__main__":
    main()
