"""Model FLOPs utilisation of the SBD dual-loss train step (the step train.py runs: [x ; x_hat], 2L tokens per row,
AdamW with f32 master weights, bf16 compute, random weights, random tokens in full rows of one L-token document).

    .venv/bin/python bench/bench_mfu.py --steps 5                          # one H100/H200: all four configs
    .venv/bin/python bench/bench_mfu.py --configs 135m-full --batch 135m=8  # one config, another batch
    JAX_PLATFORMS=cpu .venv/bin/python bench/bench_mfu.py --tiny --out /tmp/mfu_tiny.md   # CPU dry run (~1 min)

Configs (--configs, in this order by default): 1b-full, 1b-save_dots (llama3.2-1b, L=4096), 135m-full,
135m-save_dots (smollm2-135m, L=2048, vocabulary grown by the <m> row as the real run does); the suffix is
ModelConfig.remat. --tiny keeps the code path and shrinks both shapes (hidden 64, 2 layers, vocab 256, L=64).

Model FLOPs per step (MFU counts the model's FLOPs only: remat's recomputed forward is not counted):
    6 * N * 2L * rows  +  12 * layers * heads * head_dim * P * rows
N = the matmul parameters: every weight but the input embedding, plus the lm_head (= the embedding when tied);
P = the (query, key) pairs the SBD mask lets through in one 2L-token row of one document, averaged over
k ~ U[2, k_max]: L(L+1)/2 clean-causal + sum_q block_start(q) copy -> earlier clean blocks + sum_blocks size^2
copy <-> copy, about L^2 = (2L)^2 / 4, i.e. half the causal-over-2L count 12 * ... * (2L)^2 / 2 (which the JSON
gives too, as attn_flops_causal_2L and mfu_causal_2L). MFU = model FLOPs / median step time / the card's dense
bf16 peak (H100 SXM and H200: 989 TFLOP/s; --peak-tflops for others; n/a on CPU).

Memory: the device's peak_bytes_in_use (a process-wide high-water mark that never resets: a config that stays
below an earlier one's shows "<= X"), next to XLA's plan for this program: compiled.memory_analysis() arguments +
temporaries + outputs - aliased (donated) bytes, what bench/plan_memory.py reports for one device.
A row is appended to --out (markdown) and its JSON twin (.json) as each config finishes.

--profile DIR: after the first config's timing, its step is compiled again without CUDA graphs
(compiler option xla_gpu_enable_command_buffer="": the profiler does not see kernels inside a graph; the timed
program is used if that compile fails) and 3 more steps (1 with --tiny; after one untraced warm-up) run under
jax.profiler.trace(DIR). The top 25 device ops by total time (share of the device's busy time: the union of
their intervals) and the busy / wall-clock ratio are printed and written to <out>_profile.md and the JSON
("profile"). On CPU the trace holds host threads only (XLA's worker threads are taken as the device).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from profile_decode import busy_us, by_name, device_events, newest_trace  # noqa: E402
from shapes import SHAPES  # noqa: E402

from sbd_jax.models import init_params, param_shapes  # noqa: E402
from sbd_jax.sharding import MeshConfig, make_mesh  # noqa: E402
from sbd_jax.training.config import OptimConfig  # noqa: E402
from sbd_jax.training.examples import PackedBatch  # noqa: E402
from sbd_jax.training.model_source import add_mask_row  # noqa: E402
from sbd_jax.training.optim import make_optimizer  # noqa: E402
from sbd_jax.training.step import StepOptions, create_state, jit_train_step, make_train_step, put_batch, state_shardings  # noqa: E402,E501

SIZES = {"1b": ("llama3.2-1b", 4096, 1), "135m": ("smollm2-135m", 2048, 4)}  # shape, L, default rows
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}  # dense bf16 FLOP/s (SXM)
GiB = 1024 ** 3


def per_size(text: str, cast=int) -> dict:
    """"1b=2,135m=8" -> {"1b": 2, "135m": 8}; a bare "2" applies to every size."""
    if "=" not in text:
        return {s: cast(text) for s in SIZES} if text else {}
    return {k: cast(v) for k, v in (kv.split("=") for kv in text.split(","))}


def model_config(size: str, remat: str, attention: str, tiny: bool):
    cfg = SHAPES[SIZES[size][0]]
    if tiny:
        cfg = dataclasses.replace(cfg, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, vocab_size=256, mask_token_id=None)
    cfg = dataclasses.replace(cfg, dtype="bfloat16", param_dtype="float32", attention_impl=attention, remat=remat)
    return add_mask_row(cfg, None)[0] if cfg.mask_token_id is None else cfg  # the real run's add_mask_token


def mask_pairs(L: int, k_max: int) -> float:
    """(query, key) pairs the SBD mask allows in one row [x ; x_hat] of one L-token document, mean over k."""
    q = np.arange(L, dtype=np.int64)
    pairs = [L * (L + 1) // 2 + int(np.sum(q // k * k)) + (L // k) * k * k + (L % k) ** 2 for k in range(2, k_max + 1)]
    return float(np.mean(pairs))


def model_flops(cfg, L: int, rows: int, k_max: int) -> dict:
    n_all = sum(int(np.prod(s)) for s in jax.tree.leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)))
    n_mm = n_all - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)  # the embedding is a gather
    per_pair = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * rows
    dense, attn = 6 * n_mm * 2 * L * rows, per_pair * mask_pairs(L, k_max)
    return {"params": n_all, "matmul_params": n_mm, "dense_flops": dense, "attn_flops": attn,
            "attn_flops_causal_2L": per_pair * (2 * L) ** 2 / 2, "model_flops": dense + attn}


def random_batch(cfg, L: int, rows: int) -> PackedBatch:
    """Full rows, one document each, every token counted; tokens avoid the <m> id."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size - 1, (rows, L))
    tokens = np.where(tokens >= cfg.mask_token_id, tokens + 1, tokens)
    ones = np.ones((rows, L), np.int32)
    return PackedBatch(tokens.astype(np.int32), ones, np.broadcast_to(np.arange(L, dtype=np.int32), (rows, L)), ones)


def peak_bytes():
    stats = jax.devices()[0].memory_stats()
    return None if not stats or "peak_bytes_in_use" not in stats else stats["peak_bytes_in_use"]


def profile_steps(lowered, timed, state, batch, log_dir: Path, steps: int = 3, top: int = 25):
    """Run `steps` train steps under the JAX profiler (the program compiled again without command buffers,
    else `timed`) -> (state, {"text": the printed summary, ...}). Never raises for the trace's sake: a missing or
    empty trace is reported in the text."""
    try:
        prog, how = lowered.compile(compiler_options={"xla_gpu_enable_command_buffer": ""}), "no command buffers"
    except Exception as e:  # an XLA that does not take the option: profile the timed program
        prog, how = timed, f"the timed program (recompiling without command buffers failed: {type(e).__name__})"
    state, metrics = prog(state, batch)  # warm-up, untraced (first-execution work stays out of the trace)
    jax.block_until_ready((state, metrics))
    log_dir.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(log_dir), create_perfetto_trace=True):
        t0 = time.perf_counter()
        for _ in range(steps):
            state, metrics = prog(state, batch)
            jax.block_until_ready((state, metrics))
        wall = time.perf_counter() - t0
    rec = {"program": how, "steps": steps, "wall_s": wall, "dir": str(log_dir)}
    lines = [f"{steps} steps profiled ({how}): wall {1e3 * wall:.1f} ms = {1e3 * wall / steps:.1f} ms/step"]
    try:
        trace = newest_trace(log_dir)
        events = device_events(trace)
    except Exception as e:  # no trace written, or one this reader does not understand
        lines.append(f"no trace to read under {log_dir}: {type(e).__name__}: {e}")
        return state, rec | {"text": "\n".join(lines)}
    busy, ops = busy_us(events), by_name(events)
    summed = sum(us for us, _ in ops.values())
    rec |= {"trace": str(trace), "busy_s": busy / 1e6, "busy_over_wall": busy / 1e6 / wall, "events": len(events),
            "op_time_s": summed / 1e6, "top_ops": [{"name": n, "total_s": us / 1e6, "count": c}
                                                   for n, (us, c) in list(ops.items())[:top]]}
    if not events:
        lines.append(f"the trace ({trace}) has no device events (on CPU: no XLA worker-thread events)")
        return state, rec | {"text": "\n".join(lines)}
    lines += [f"device busy {busy / 1e3:.1f} ms = {100 * busy / 1e6 / wall:.0f}% of wall ({busy / 1e3 / steps:.1f} "
              f"ms/step); {len(events)} ops ({len(events) / steps:.0f} per step); the ops' summed time "
              f"{summed / 1e3:.1f} ms ({summed / max(busy, 1e-9):.2f}x busy: > 1 where ops overlap or nest); trace {trace}", "",
              f"| op (top {top} by total time) | total ms | share of busy time | count | per step ms | mean us |",
              "|---|---:|---:|---:|---:|---:|"]
    for name, (us, n) in list(ops.items())[:top]:
        lines.append(f"| `{name[:90]}` | {us / 1e3:.2f} | {100 * us / busy:.1f}% | {n} | {us / 1e3 / steps:.2f} | "
                     f"{us / n:.1f} |")
    return state, rec | {"text": "\n".join(lines)}


def run_config(cfg, L: int, rows: int, args, profile_dir: Path | None = None) -> dict:
    """Build and compile the train step as training does, then time it: {compile_s, step_s, memory...}; with
    `profile_dir`, then profile a few more steps (`profile_steps`)."""
    mesh = make_mesh(MeshConfig())
    tx, sched = make_optimizer(OptimConfig(), 1000)
    sh = state_shardings(cfg, tx, mesh)
    params = jax.jit(lambda k: init_params(cfg, k))(jax.random.PRNGKey(0))
    state = create_state(params, tx, jax.random.PRNGKey(1), sh)  # params donated
    opts = StepOptions(cfg.mask_token_id, k_max=args.k_max, block_align="document")  # loss_chunk: train.py's auto
    step = jit_train_step(make_train_step(cfg, opts, tx, sched, mesh), mesh, sh, rows)
    batch = put_batch(random_batch(cfg, L, rows), mesh, rows)
    t0 = time.perf_counter()
    lowered = step.lower(state, batch)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    times = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    loss = float(metrics["loss"])
    prof = None
    if profile_dir is not None:
        try:  # a failed profile (the profiler, the second compile's memory) keeps the timed row
            state, prof = profile_steps(lowered, compiled, state, batch, profile_dir, steps=1 if args.tiny else 3)
        except Exception as e:
            prof = {"text": f"profiling failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"}
    del state, metrics, compiled, lowered, step, batch
    gc.collect()
    plan = {"args": ma.argument_size_in_bytes, "temp": ma.temp_size_in_bytes, "out": ma.output_size_in_bytes,
            "alias": ma.alias_size_in_bytes} if ma is not None else None
    return {"compile_s": compile_s, "step_s": statistics.median(times[args.warmup:]), "step_times_s_incl_warmup": times,
            "loss": loss, "xla_plan_bytes": plan} | ({"profile": prof} if prof is not None else {})


def gib(x) -> str:
    return "n/a" if x is None else f"{x / GiB:.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="1b-full,1b-save_dots,135m-full,135m-save_dots")
    ap.add_argument("--batch", default="1b=1,135m=4", help="rows of L per step: '1b=1,135m=4' or one number")
    ap.add_argument("--seq-len", default=None, help="L per size, e.g. '1b=4096,135m=2048' (default: those)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 2 with --tiny)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--k-max", type=int, default=16)
    ap.add_argument("--attention", default="pallas", choices=["pallas", "xla"], help="pallas: interpret mode on CPU")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of a card not in PEAK_BF16")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU dry run of the same code path)")
    ap.add_argument("--out", default=None, help="markdown file (default $OUT/mfu.md, else bench/results/mfu.md)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="profile 3 more steps (--tiny: 1) of the first config into DIR (see above); summary in <out>_profile.md")
    args = ap.parse_args(argv)
    args.steps = args.steps or (2 if args.tiny else 10)
    rows = {s: r for s, (_, _, r) in SIZES.items()} | per_size(args.batch)
    seq = {s: (64 if args.tiny else L) for s, (_, L, _) in SIZES.items()} | per_size(args.seq_len or "")
    dev = jax.devices()[0]
    peak = args.peak_tflops * 1e12 if args.peak_tflops else next(
        (v for k, v in PEAK_BF16.items() if dev.platform == "gpu" and k in dev.device_kind), None)
    out = Path(args.out or (Path(os.environ["OUT"]) / "mfu.md" if os.environ.get("OUT") else
                            Path(__file__).resolve().parent / "results" / "mfu.md"))
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = "python bench/bench_mfu.py " + " ".join(sys.argv[1:] if argv is None else argv)
    header = [
        "# SBD train step: model FLOPs utilisation", "",
        f"Command: `{cmd.strip()}`  ",
        f"Date: {datetime.date.today()}; device: {dev.platform} ({dev.device_kind}); jax {jax.__version__}; "
        f"peak {'n/a' if peak is None else f'{peak / 1e12:.0f} TFLOP/s dense bf16'}; "
        f"XLA_FLAGS `{os.environ.get('XLA_FLAGS', '')}`  ",
        f"Dual loss ([x ; x_hat], 2L tokens/row), f32 params + AdamW, bf16 compute, attention {args.attention}, "
        f"k ~ U[2, {args.k_max}]; median of {args.steps} steps after {args.warmup} warmup.  ",
        "Model FLOPs = 6 N (2L rows) + 12 layers heads head_dim P rows (N: matmul params incl. lm_head; P: the pairs "
        "the SBD mask lets through, ~L^2 per row); remat recomputation not counted. Peak mem: device high-water "
        "mark (`<=`: set by an earlier config); XLA plan: args + temp + out - alias of this program.", "",
        "| config | shape | L | rows | remat | compile s | step ms | data tok/s | TFLOP/step | TFLOP/s | MFU | "
        "peak mem GiB | XLA plan GiB |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    out.write_text("\n".join(header) + "\n")
    print("\n".join(header), flush=True)
    records = []
    for i, name in enumerate(args.configs.split(",")):
        size, remat = name.split("-", 1)
        cfg, L, B = model_config(size, remat, args.attention, args.tiny), seq[size], rows[size]
        rec = {"config": name, "shape": SIZES[size][0] + (" (tiny)" if args.tiny else ""), "L": L, "rows": B,
               "remat": remat, "vocab": cfg.vocab_size, **model_flops(cfg, L, B, args.k_max)}
        before = peak_bytes()
        try:
            rec |= run_config(cfg, L, B, args, Path(args.profile) if args.profile and i == 0 else None)
        except Exception as e:  # e.g. out of memory: record it and go on with the next config
            rec["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        gc.collect()  # after the except clause, which holds the failed config's frames
        rec["peak_bytes"], rec["peak_is_this_config"] = peak_bytes(), None
        if rec["peak_bytes"] is not None:
            rec["peak_is_this_config"] = before is None or rec["peak_bytes"] > before
        if "error" in rec:
            row = f"| {name} | {rec['shape']} | {L} | {B} | {remat} | failed: {rec['error']} |||||||||"
        else:
            s = rec["step_s"]
            rec["tokens_per_s"], rec["tflops_per_s"] = B * L / s, rec["model_flops"] / s / 1e12
            rec["mfu"] = None if peak is None else rec["model_flops"] / s / peak
            rec["mfu_causal_2L"] = None if peak is None else (
                rec["dense_flops"] + rec["attn_flops_causal_2L"]) / s / peak
            plan = rec["xla_plan_bytes"]
            mem = ("<=" if rec["peak_is_this_config"] is False else "") + gib(rec["peak_bytes"])
            mfu = "n/a" if rec["mfu"] is None else f"{rec['mfu'] * 100:.1f}%"
            row = (f"| {name} | {rec['shape']} | {L} | {B} | {remat} | {rec['compile_s']:.1f} | {s * 1e3:.1f} | "
                   f"{rec['tokens_per_s']:,.0f} | {rec['model_flops'] / 1e12:.3g} | {rec['tflops_per_s']:.3g} | "
                   f"{mfu} | {mem} | "
                   f"{gib(None if plan is None else plan['args'] + plan['temp'] + plan['out'] - plan['alias'])} |")
        records.append(rec)
        text = rec.get("profile", {}).pop("text", None)
        with out.open("a") as f:
            f.write(row + "\n")
        out.with_suffix(".json").write_text(json.dumps({"command": cmd.strip(), "device": dev.device_kind,
                                                        "peak_flops": peak, "configs": records}, indent=1))
        print(row, flush=True)
        if text is not None:
            text = f"## Profile: {name}, step {rec['step_s'] * 1e3:.1f} ms timed\n\n{text}\n"
            out.with_name(out.stem + "_profile.md").write_text(f"Command: `{cmd.strip()}`\n\n{text}")
            print("\n" + text, flush=True)
    print(f"written to {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
