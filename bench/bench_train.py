"""Benchmark: the SBD dual-loss train step vs the NTP-only train step on the same data, in one run.

Both steps see the same packed batches of L-token rows. The dual step runs the doubled input
[x ; x_hat] (2L tokens: NTP on the clean half + MATP on the masked copy), the NTP step runs the L
clean tokens only. Throughput is counted in *data* tokens (non-padding tokens of the L-token rows)
per second for both, so the cost ratio = dual step time / NTP step time (goal: <= 2.2x with the
reference XLA attention; the dense reference attention's cost grows with (2L)^2, the rest with 2L).

    .venv/bin/python bench/bench_train.py                       # CPU default sizes, writes bench/results/train_cpu.md
    .venv/bin/python bench/bench_train.py --hidden 1024 --layers 8 --seq-len 2048 --batch 8 \\
        --dtype bfloat16 --attention pallas --out bench/results/train_gpu.md   # on a GPU
    .venv/bin/python bench/bench_train.py --vocab 192 --hidden 128 --intermediate 384 --layers 4 --seq-len 128 \
        --prompt-share 0.44 --copy-len 80 --out bench/results/train_cpu_copy_len.md  # the demo's shapes + data.copy_len
    (add --scan-unroll 4 for the demo's unrolled layer loop: bench/results/train_cpu_unroll.md)

Block size k is drawn in [2, k_max] per step as in training (one compiled step for every k).
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np

from sbd_jax.models.config import ModelConfig
from sbd_jax.models import init_params, param_shapes
from sbd_jax.sharding import MeshConfig, make_mesh
from sbd_jax.training.config import OptimConfig
from sbd_jax.training.data import Documents, PackedIterator
from sbd_jax.training.optim import make_optimizer
from sbd_jax.training.step import StepOptions, create_state, jit_train_step, make_train_step, put_batch, state_shardings


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--seq-len", default="64,256", help="L, or a comma list of L values (the dual step runs 2L)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k-max", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="compute dtype (params stay float32)")
    ap.add_argument("--attention", default="xla", choices=["xla", "pallas"])
    ap.add_argument("--loss-chunk", type=int, default=0)
    ap.add_argument("--scan-unroll", type=int, default=1, help="layers per iteration of the layer scan (ModelConfig)")
    ap.add_argument("--prompt-share", type=float, default=0.0,
                    help="> 0: prompt/response documents (this share of each is prompt), response-aligned blocks")
    ap.add_argument("--copy-len", type=int, default=None,
                    help="adds a variant with a compact copy stream of C slots (data.copy_len; needs --prompt-share); "
                         "every variant's rows are packed under that budget, so all see the same rows")
    ap.add_argument("--allow-cpu-pallas", action="store_true", help="Pallas on CPU is interpret mode: meaningless")
    ap.add_argument("--out", default=None, help="markdown file (default bench/results/train_<platform>.md)")
    return ap.parse_args(argv)


def batches(args, n):
    rng = np.random.default_rng(0)
    if args.prompt_share > 0:  # prompt/response pairs up to a row long
        lens = rng.integers(max(2, args.seq_len // 8), args.seq_len // 2, 400)
        n_prompt = [max(1, int(round(args.prompt_share * n_))) for n_ in lens]
    else:
        lens, n_prompt = rng.integers(args.seq_len // 4, 2 * args.seq_len, 400), None
    docs = Documents.from_lists([list(rng.integers(4, args.vocab, n_)) for n_ in lens], n_prompt=n_prompt)
    it = PackedIterator(docs, args.seq_len, args.batch, seed=0, copy_len=args.copy_len)
    return [it.next_batch() for _ in range(n)]


def build_variant(cfg, args, ntp_only: bool, data, copy_len: int | None = None):
    """A compiled step + its state; returns (run(i) -> seconds of step i, info)."""
    mesh = make_mesh(MeshConfig())
    tx, sched = make_optimizer(OptimConfig(warmup_steps=10), 1000)
    sh = state_shardings(cfg, tx, mesh)
    params = jax.jit(lambda k: init_params(cfg, k))(jax.random.PRNGKey(0))
    box = {"state": create_state(params, tx, jax.random.PRNGKey(1), sh)}
    opts = StepOptions(cfg.mask_token_id, k_max=args.k_max, ntp_only=ntp_only,
                       block_align="response" if args.prompt_share > 0 else "document", copy_len=copy_len,
                       loss_chunk=args.loss_chunk)
    step = jit_train_step(make_train_step(cfg, opts, tx, sched, mesh), mesh, sh, args.batch)
    dev = [put_batch(b, mesh, args.batch) for b in data]

    def run(i):
        t = time.perf_counter()
        box["state"], m = step(box["state"], dev[i % len(dev)])
        jax.block_until_ready(m)
        box["m"] = m
        return time.perf_counter() - t

    compile_s = run(0)
    for i in range(args.warmup):
        run(i + 1)
    return run, {"compile_s": compile_s, "input_len": args.seq_len + (0 if ntp_only else copy_len or args.seq_len)}


def measure(cfg, args, L: int) -> dict:
    """Both variants at row length L, timed interleaved (load drift on a shared machine hits both)."""
    args = argparse.Namespace(**{**vars(args), "seq_len": L})
    data = batches(args, max(args.steps, args.warmup + 1))
    variants = {"NTP-only": build_variant(cfg, args, True, data), "SBD dual": build_variant(cfg, args, False, data)}
    if args.copy_len:
        variants[f"SBD dual, copy_len {args.copy_len}"] = build_variant(cfg, args, False, data, args.copy_len)
    times = {name: [] for name in variants}
    for i in range(args.steps):
        for name, (run, _) in variants.items():
            times[name].append(run(i))
    tokens = float(np.mean([np.sum(np.asarray(b.segment) > 0) for b in data]))
    res = {}
    for name, (_, info) in variants.items():
        med = statistics.median(times[name])
        res[name] = dict(info, step_s=med, tokens_per_s=tokens / med)
    return res


def main(argv=None):
    args = parse(argv)
    if args.copy_len and args.prompt_share <= 0:
        print("--copy-len needs --prompt-share > 0 (a compact copy stream drops the prompts)")
        return 2
    backend = jax.default_backend()
    if args.attention == "pallas" and backend == "cpu" and not args.allow_cpu_pallas:
        print("Pallas on CPU runs in interpret mode; its timings mean nothing (pass --allow-cpu-pallas to run anyway)")
        return 2
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      rope_theta=500000.0, mask_token_id=3, dtype=args.dtype, param_dtype="float32",
                      attention_impl=args.attention, scan_unroll=args.scan_unroll)
    seq_lens = [int(x) for x in str(args.seq_len).split(",")]
    dev = jax.devices()[0]
    n_params = sum(int(np.prod(s)) for s in jax.tree.leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)))
    cmd = "python bench/bench_train.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        "# Train step: SBD dual loss vs NTP-only",
        "",
        f"Command: `{cmd.strip()}`  ",
        (f"Date: {datetime.date.today()}; device: {dev.platform} ({dev.device_kind}) x{jax.device_count()}; "
         f"host: {platform.machine()}, jax {jax.__version__}  "),
        (f"Model: Llama-style, {n_params / 1e6:.1f}M params (hidden {args.hidden}, {args.layers} layers, "
         f"{args.heads}/{args.kv_heads} heads, vocab {args.vocab}), params float32, compute {args.dtype}, "
         f"attention `{args.attention}`, layer scan unroll {args.scan_unroll}; batch {args.batch} rows of L tokens; "
         f"k ~ U[2, {args.k_max}]; "
         f"AdamW + clipping; median of {args.steps} interleaved steps after {args.warmup} warmup.  "),
        (f"Data: prompt/response pairs, prompt share {args.prompt_share:g}, response-aligned blocks"
         + (f", rows packed under copy_len {args.copy_len}" if args.copy_len else "") + ".  "
         if args.prompt_share > 0 else "Data: text documents.  "),
        "Data tokens/s counts the non-padding tokens of the L-token rows for both steps.",
        "",
        "| L | step | input tokens / row | step time (ms) | data tokens/s | cost vs NTP | compile (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for L in seq_lens:
        res = measure(cfg, args, L)
        ntp = res["NTP-only"]["step_s"]
        for name, r in res.items():
            lines.append(f"| {L} | {name} | {r['input_len']} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | "
                         f"**{r['step_s'] / ntp:.2f}x** | {r['compile_s']:.1f} |")
        print(lines[-2] + "\n" + lines[-1], flush=True)
    lines += ["", "Goal: dual / NTP <= 2.2x with the reference attention (the dual step processes 2L tokens).", ""]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / f"train_{backend}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
