"""Benchmark: SBD vs AR decoding throughput on the same model and prompts in one run, and the
overhead of the jitted `lax.while_loop` decoder over bare model forwards of the same window shapes.

    .venv/bin/python bench/bench_decode.py                  # 20M-param Llama-style model, CPU-friendly
    .venv/bin/python bench/bench_decode.py --hidden 1024 --layers 8 --vocab 32000 --batch 16   # GPU

What is measured (medians over --reps runs, compilation excluded):
  * tokens/s of `generate(mode="ar")` and `generate(mode="sbd")` at several gammas, NFE and tokens
    per forward, and the wall-clock speedup of SBD over AR;
  * loop overhead: the decoder's time against the same sequence of bare forwards. A bare forward is
    timed inside a jitted `fori_loop` of 16 (no Python dispatch per call; logits reduced so nothing
    is dead code; cache donated and carried) for each window shape the decoder uses: [prompt ; k copy]
    once, 2k (finished block + next block) for `wide_steps` iterations, k for the rest; AR: the
    prompt prefill once, then 1-token steps. overhead = decoder time / sum of bare forwards - 1
    (goal <= 10%), from the medians; the range of the per-run ratios (each run times the decoder
    and the bare shapes back to back) shows the noise. It covers everything the loop adds: entropies, acceptance, sampling,
    bookkeeping, the `lax.cond` between window shapes and the while-loop itself.

The weights are random (no trained model here): entropies are near log(V) everywhere, so the EB rule
accepts about 1 + gamma / log(V) tokens per step. The gammas are therefore chosen to force
acceptance rates (1 token/step, about k/4, and the whole block) - they measure the speed mechanics of
SBD, not its quality. Results go to bench/results/decode_<backend>.md.

The V-sized per-step work (entropies, argmax over [B, k, V]) is the bulk of the loop overhead on CPU;
relative to the lm_head it scales as 1 / hidden, so it is largest for small models (hidden 256 here)
and small for real ones (Llama-3-8B: hidden 4096 with V / hidden ~ 32, as in these configs).
"""
from __future__ import annotations

import argparse
import functools
import math
import statistics
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

import sbd_jax
from sbd_jax.attention import clean_meta, concat_meta, copy_meta
from sbd_jax.decoding import GenerateCall
from sbd_jax.decoding.roofline import copy_bandwidth
from sbd_jax.models import causal_meta, forward, init_cache, unstack_layers
from sbd_jax.runtime import use_decode_xla_flags
from shapes import add_model_args, describe, model_config


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--gammas", type=float, nargs="*", default=None,
                    help="default: from --tpf (EB gammas that force those tokens per forward on random weights)")
    ap.add_argument("--tpf", default="1,4,16", help="tokens per forward to force (default gammas)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layout", choices=("per-layer", "stacked"), default="per-layer",
                    help="weights as decoders use them (unstack_layers) or as training stacks them")
    ap.add_argument("--out", default=None, help="markdown results file (default bench/results/decode_<backend>.md)")
    ap.add_argument("--append", action="store_true", help="add a section to --out instead of replacing it")
    return ap.parse_args(argv)


def timed(fn):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t


def bare_forward(params, cfg, B, S, tokens_BT, meta, n):
    """A zero-arg callable running n forwards of one window shape in a jitted fori_loop (cache
    donated and carried, logits reduced so nothing is dead code); compiled and warmed up."""
    @functools.partial(jax.jit, donate_argnums=(1,))
    def loop(params, cache, tokens, meta):
        def body(i, carry):
            cache, acc = carry
            logits, cache = forward(params, cfg, tokens, meta, cache)
            return cache, acc + jnp.max(logits)
        return jax.lax.fori_loop(0, n, body, (cache, jnp.float32(0)))

    holder = {"c": init_cache(cfg, B, S)}
    tokens_BT = jnp.asarray(tokens_BT)
    meta = jax.tree.map(jnp.asarray, meta)
    compiled = loop.lower(params, holder["c"], tokens_BT, meta).compile()  # once, whatever the cache's commitment

    def run():
        holder["c"], acc = compiled(params, holder["c"], tokens_BT, meta)
        return acc
    jax.block_until_ready(run())
    return run


def main(argv=None):
    use_decode_xla_flags()  # what decode.py runs with; XLA reads it when jax creates its backend
    a = parse(argv)
    cfg = model_config(a, a.prompt + a.new)
    params = jax.jit(lambda key: sbd_jax.init_params(cfg, key))(jax.random.key(0))
    if a.layout == "per-layer":
        params = unstack_layers(params, delete=True)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    B, P, N, k = a.batch, a.prompt, a.new, a.block
    rng = np.random.default_rng(0)
    lens = rng.integers(P // 2, P + 1, B).astype(np.int32)  # ragged prompts
    ids = rng.integers(0, cfg.vocab_size - 1, (B, P)).astype(np.int32)
    logv = math.log(cfg.vocab_size)
    # EB on near-uniform entropies accepts ~1 + gamma / log V tokens; the whole block at t = k
    gammas = a.gammas if a.gammas is not None else [
        0.0 if t <= 1 else 1e9 if t >= k else round(logv * (t - 1) + 1, 1) for t in map(int, a.tpf.split(","))]
    S = P + N

    runs, compile_s = [], []  # (name, gamma, compiled, args)
    for mode, g in [("ar", None)] + [("sbd", g) for g in gammas]:
        call = GenerateCall.build(params, cfg, ids, lens, max_new_tokens=N, block_size=k, gamma=g or 0.0, mode=mode,
                                  eos_ids=())
        t = time.perf_counter()
        compiled = call.lower().compile()
        compile_s.append(time.perf_counter() - t)
        out = jax.block_until_ready(compiled(*call.args))
        runs.append(("AR" if mode == "ar" else "SBD", g, out, functools.partial(compiled, *call.args)))

    # bare forwards of each window shape (copy windows at the end of the prompt, ragged rows)
    nb, nb_prefill = 16, 2  # prefill-shaped windows take long: fewer of them
    pos_k = (lens[:, None] + np.arange(k)[None]).astype(np.int32)
    copy_k = copy_meta(np.ones((B, k), np.int32), pos_k, np.repeat(lens[:, None], k, 1))
    clean_k = clean_meta(np.ones((B, k), np.int32), pos_k - k)
    toks_k = np.full((B, k), cfg.mask_token_id, np.int32)
    bare = {
        "first": bare_forward(params, cfg, B, S, np.concatenate([ids, toks_k], 1),
                              concat_meta(causal_meta(jnp.asarray(lens), P), copy_k), nb_prefill),
        "wide": bare_forward(params, cfg, B, S, np.concatenate([toks_k, toks_k], 1), concat_meta(clean_k, copy_k), nb),
        "k": bare_forward(params, cfg, B, S, toks_k, copy_k, nb),
        "prefill": bare_forward(params, cfg, B, S, ids, causal_meta(jnp.asarray(lens), P), nb_prefill),
        "one": bare_forward(params, cfg, B, S, toks_k[:, :1], clean_meta(np.ones((B, 1), np.int32), lens[:, None]), nb),
    }

    # interleaved repetitions (the machine may be shared: each rep times every bare shape and every
    # decoder back to back; per-rep ratios give the spread)
    times = {i: [] for i in range(len(runs))}
    bare_t = {name: [] for name in bare}
    overheads = {i: [] for i in range(len(runs))}
    for _ in range(a.reps):
        for name, fn in bare.items():
            bare_t[name].append(timed(fn) / (nb_prefill if name in ("first", "prefill") else nb))
        for i, (name, _g, out, fn) in enumerate(runs):
            secs = timed(fn)
            times[i].append(secs)
            overheads[i].append(secs / _bare_sum(name, out, {n: v[-1] for n, v in bare_t.items()}) - 1)
    med = statistics.median
    bare_med = {n: med(v) for n, v in bare_t.items()}
    rows = [(name, g, out, med(times[i]), (min(overheads[i]), max(overheads[i]))) for i, (name, g, out, _)
            in enumerate(runs)]

    # bytes one call must read: every weight, and each row's cache up to its mean context over the run
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    kv_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
    call_bytes = weight_bytes + kv_token * float(np.sum(lens + N / 2))
    copy_bw = copy_bandwidth(1.0 if jax.default_backend() != "cpu" else 0.25)
    table = []
    ar_tps = None
    for name, g, out, secs, spread in rows:
        iters, wide = int(out.iterations), int(out.wide_steps)
        tokens = int(np.asarray(out.lengths).sum())
        nfe = int(np.asarray(out.nfe).sum())
        tps = tokens / secs
        ar_tps = ar_tps or tps
        bare_s = _bare_sum(name, out, bare_med)
        table.append({"decoder": name if g is None else f"SBD k={k} gamma={g:g}", "tokens": tokens,
                      "tpf": tokens / nfe, "iters": iters, "wide": wide if name == "SBD" else "-", "secs": secs,
                      "tps": tps, "speedup": tps / ar_tps, "per_iter_ms": 1e3 * secs / iters,
                      "bare_ms": 1e3 * bare_s / iters, "overhead": secs / bare_s - 1, "spread": spread,
                      "gbs": call_bytes * iters / secs / 1e9})
    t_first, t_wide, t_k, t_prefill, t_one = (bare_med[n] for n in ("first", "wide", "k", "prefill", "one"))

    dev = jax.devices()[0]
    head = (f"model: Llama-style, random weights, {describe(cfg, n_params)}; batch {B}, ragged prompts "
            f"{int(lens.min())}-{int(lens.max())} tokens (width {P}), {N} new tokens, no EOS; device: "
            f"{dev.platform} {dev.device_kind} x{jax.device_count()}; jax {jax.__version__}; "
            f"XLA_FLAGS `{os.environ.get('XLA_FLAGS', '')}`; "
            f"medians of {a.reps} interleaved runs; weights {a.layout}; generate compiled in "
            f"{', '.join(f'{c:.0f}' for c in compile_s)} s")
    cmd = "python bench/bench_decode.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [f"command: `{cmd.strip()}`", "", head, "",
             ("| decoder | tokens | tokens/forward | loop iterations | 2k-window iterations | time (s) | tokens/s "
              "| speedup vs AR (tokens/s) | ms / iteration | bare forwards ms / iteration | loop overhead "
              "| overhead range over runs | achieved GB/s (weights + KV) | % of copy bw |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['decoder']} | {r['tokens']} | {r['tpf']:.2f} | {r['iters']} | {r['wide']} | "
                     f"{r['secs']:.4f} | {r['tps']:.0f} | {r['speedup']:.2f}x | {r['per_iter_ms']:.3f} | "
                     f"{r['bare_ms']:.3f} | {100 * r['overhead']:+.1f}% | "
                     f"{100 * r['spread'][0]:+.0f}% .. {100 * r['spread'][1]:+.0f}% | {r['gbs']:.0f} | "
                     f"{100 * r['gbs'] * 1e9 / copy_bw:.0f}% |")
    lines += ["", ("bare forward per window shape (ms, inside a jitted fori_loop): "
                   f"prompt+k {1e3 * t_first:.3f}, 2k {1e3 * t_wide:.3f}, k {1e3 * t_k:.3f}, "
                   f"prompt prefill {1e3 * t_prefill:.3f}, 1 token {1e3 * t_one:.3f}"),
              "", (f"bytes per call: weights {weight_bytes / 1e9:.2f} GB + KV at the mean context "
                   f"{(call_bytes - weight_bytes) / 1e9:.2f} GB; measured copy bandwidth {copy_bw / 1e9:.0f} GB/s "
                   "(bytes read + written)"),
              "", ("gamma is chosen to force acceptance on a random-weight model (entropies ~ log V = "
                   f"{logv:.2f} nats): these rows measure SBD's speed mechanics at a given tokens/forward, "
                   "not quality.")]
    text = "\n".join(lines)
    print(text)
    out = Path(a.out) if a.out else Path(__file__).with_name("results") / f"decode_{jax.default_backend()}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.append and out.exists():
        out.write_text(out.read_text() + "\n---\n\n" + text + "\n")
    else:
        out.write_text("# bench_decode\n\n" + text + "\n")
    print(f"\nwritten to {out}")


def _bare_sum(name, out, t):
    """Seconds of the bare forwards the decoder's run consists of."""
    iters, wide = int(out.iterations), int(out.wide_steps)
    if name == "AR":
        return t["prefill"] + (iters - 1) * t["one"]
    return t["first"] + wide * t["wide"] + (iters - 1 - wide) * t["k"]


if __name__ == "__main__":
    main()
