"""Benchmark: continuous batching vs static batches, AR and SBD, through decode.py's runner, in one run.

256 prompts (16-128 tokens) whose max_new_tokens are spread uniformly over [16, 512], a random-weight model,
EOS off (so every row generates what it asked for). Static: batches of `slots` rows cut from the prompts sorted
by length, each running until its longest request is done. Continuous: `slots` rows, a finished row's slot
taking the next prompt at once. Tokens/s = generated tokens / decoding seconds (compilation apart), the median
of interleaved rounds (each round decodes the whole set once per variant).

    .venv/bin/python bench/bench_continuous.py                           # demo-shaped model, 16 slots
    .venv/bin/python bench/bench_continuous.py --slots 1,100 --prompts 100 --max-new 16,64   # the demo's sizes
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from sbd_jax.decoding import DecodeSpec  # noqa: E402
from sbd_jax.decoding.prompts import Prompt  # noqa: E402
from sbd_jax.decoding.runner import DecodeOptions, decode_prompts  # noqa: E402
from sbd_jax.models import init_params, unstack_layers  # noqa: E402
from sbd_jax.runtime import use_decode_xla_flags  # noqa: E402
from shapes import add_model_args, describe, model_config  # noqa: E402


def main(argv=None) -> int:
    use_decode_xla_flags()  # what decode.py runs with; XLA reads it when jax creates its backend
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-new", default="16,512", help="per-row max_new_tokens drawn uniformly from [lo, hi]")
    ap.add_argument("--slots", default="16", help="comma list of batch sizes (slots)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per variant (median reported)")
    ap.add_argument("--gamma", type=float, default=20.0, help="EB gamma of the SBD rows (random weights: high)")
    ap.add_argument("--pad-multiple", type=int, default=16, help="prompt width rounding of the static batches")
    ap.add_argument("--modes", default="ar,sbd")
    add_model_args(ap, hidden=128, layers=4, heads=4, kv_heads=2, vocab=1024)
    args = ap.parse_args(argv)
    lo, hi = map(int, args.max_new.split(","))
    if not args.shape and args.intermediate is None:
        args.intermediate = 3 * args.hidden
    cfg = model_config(args, 128 + hi)
    std = 0.02 if args.shape else 0.1  # the small model: less uniform entropies
    params = unstack_layers(jax.jit(lambda k: init_params(cfg, k, std=std))(jax.random.key(0)), delete=True)
    V = cfg.vocab_size
    rng = np.random.default_rng(0)
    prompts = [Prompt(i, i + 1, tuple(int(t) for t in rng.integers(0, V - 1, rng.integers(16, 129))),
                      int(rng.integers(lo, hi + 1))) for i in range(args.prompts)]
    n = sum(x.size for x in jax.tree.leaves(params))
    dev = jax.devices()[0]
    print(f"{args.prompts} prompts of 16-128 tokens, max_new_tokens ~ U[{lo}, {hi}], EOS off; model {describe(cfg, n)}; "
          f"SBD block {args.block_size}, EB gamma {args.gamma}; {dev.platform} {dev.device_kind}; "
          f"XLA_FLAGS `{os.environ.get('XLA_FLAGS', '')}`")
    print("| slots | mode | static tok/s | continuous tok/s | continuous / static | tokens per forward | "
          "static model calls | continuous model calls | compile s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for slots in map(int, args.slots.split(",")):
        for mode in args.modes.split(","):
            spec = DecodeSpec(mode=mode, block_size=args.block_size, max_new_tokens=hi, eos_ids=())
            rate, calls, compile_s = {False: [], True: []}, {}, 0.0
            for _ in range(args.rounds):  # interleaved rounds, median: first executions and load drift hit both
                for continuous in (False, True):
                    opts = DecodeOptions(spec=spec, gamma=args.gamma, batch_size=slots,
                                         pad_multiple=args.pad_multiple, continuous=continuous)
                    s = decode_prompts(params, cfg, prompts, opts).to_json()
                    rate[continuous].append(s["tokens_per_s"])
                    calls[continuous] = s["model_calls"]
                    compile_s += s["compile_seconds"]
            rate = {k: float(np.median(v)) for k, v in rate.items()}
            print(f"| {slots} | {mode} | {rate[False]:.0f} | {rate[True]:.0f} | {rate[True] / rate[False]:.2f}x | "
                  f"{s['tokens_per_forward']:.2f} | {calls[False]} | {calls[True]} | {compile_s:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
