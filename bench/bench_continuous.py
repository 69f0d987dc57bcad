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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from sbd_jax.config import ModelConfig  # noqa: E402
from sbd_jax.decoding import DecodeSpec  # noqa: E402
from sbd_jax.decoding.prompts import Prompt  # noqa: E402
from sbd_jax.decoding.runner import DecodeOptions, decode_prompts  # noqa: E402
from sbd_jax.models import init_params  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-new", default="16,512", help="per-row max_new_tokens drawn uniformly from [lo, hi]")
    ap.add_argument("--slots", default="16", help="comma list of batch sizes (slots)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per variant (median reported)")
    ap.add_argument("--gamma", type=float, default=20.0, help="EB gamma of the SBD rows (random weights: high)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    args = ap.parse_args(argv)
    lo, hi = map(int, args.max_new.split(","))
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                      max_position_embeddings=1024, mask_token_id=args.vocab - 1)
    params = jax.jit(lambda k: init_params(cfg, k, std=0.1))(jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [Prompt(i, i + 1, tuple(int(t) for t in rng.integers(0, args.vocab - 1, rng.integers(16, 129))),
                      int(rng.integers(lo, hi + 1))) for i in range(args.prompts)]
    print(f"{args.prompts} prompts of 16-128 tokens, max_new_tokens ~ U[{lo}, {hi}], EOS off; model hidden "
          f"{args.hidden}, {args.layers} layers, vocab {args.vocab}; SBD block {args.block_size}, EB gamma {args.gamma}; "
          f"{jax.default_backend()}")
    print("| slots | mode | static tok/s | continuous tok/s | continuous / static | tokens per forward |")
    print("|---:|---|---:|---:|---:|---:|")
    for slots in map(int, args.slots.split(",")):
        for mode in ("ar", "sbd"):
            spec = DecodeSpec(mode=mode, block_size=args.block_size, max_new_tokens=hi, eos_ids=())
            rate = {False: [], True: []}
            for _ in range(args.rounds):  # interleaved rounds, median: first executions and load drift hit both
                for continuous in (False, True):
                    opts = DecodeOptions(spec=spec, gamma=args.gamma, batch_size=slots, pad_multiple=16,
                                         continuous=continuous)
                    s = decode_prompts(params, cfg, prompts, opts)
                    rate[continuous].append(s["tokens_per_s"])
            rate = {k: float(np.median(v)) for k, v in rate.items()}
            print(f"| {slots} | {mode} | {rate[False]:.0f} | {rate[True]:.0f} | {rate[True] / rate[False]:.2f}x | "
                  f"{s['tokens_per_forward']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
