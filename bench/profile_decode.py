"""Where a decode step's time goes: one `generate` call per decoder (AR, and SBD at forced tokens per forward)
under the JAX profiler; the device's kernels summed by name, and the device's busy time against the wall-clock
(the gap is time the device waits: launches, host work, synchronisation).

    python3 bench/profile_decode.py --shape llama3-8b --dtype bfloat16 --attention pallas --batch 1 --prompt 1024 \
        --new 64 --out-dir $OUT/profile

Prints one table per decoder (top kernels by total device time) and keeps the Perfetto trace
(perfetto_trace.json.gz, open it at ui.perfetto.dev) under --out-dir.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import sbd_jax  # noqa: E402
from sbd_jax.decoding import GenerateCall  # noqa: E402
from sbd_jax.models import unstack_layers  # noqa: E402
from sbd_jax.runtime import use_decode_xla_flags  # noqa: E402
from shapes import add_model_args, describe, model_config  # noqa: E402


def device_events(trace_file: Path) -> list[dict]:
    """Complete events ('X') of the device processes (GPU/TPU streams) of a Perfetto/Chrome trace; on CPU, of
    the XLA worker threads."""
    ev = json.load(gzip.open(trace_file))["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    dev = {p for p, n in procs.items() if "/device:" in n and "CPU" not in n}
    if not dev:  # CPU: the XLA threads of the host process
        threads = {(e["pid"], e["tid"]) for e in ev if e.get("ph") == "M" and e.get("name") == "thread_name"
                   and "XLA" in e["args"]["name"]}
        return [e for e in ev if e.get("ph") == "X" and (e["pid"], e.get("tid")) in threads]
    return [e for e in ev if e.get("ph") == "X" and e["pid"] in dev]


def busy_us(events: list[dict]) -> float:
    """Microseconds during which at least one event runs (the union of the intervals)."""
    total, end = 0.0, -math.inf
    for s, d in sorted((e["ts"], e.get("dur", 0)) for e in events):
        if s + d > end:
            total += s + d - max(s, end)
            end = s + d
    return total


def newest_trace(log_dir: Path) -> Path:
    """The Perfetto trace `jax.profiler.trace(log_dir, create_perfetto_trace=True)` wrote last."""
    return max(Path(log_dir).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)


def by_name(events: list[dict]) -> dict[str, list]:
    """{event name: [total microseconds, count]}, largest total first."""
    by = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        by[e["name"]][0] += e.get("dur", 0)
        by[e["name"]][1] += 1
    return dict(sorted(by.items(), key=lambda kv: -kv[1][0]))


def summarize(events: list[dict], wall_s: float, calls: int, top: int) -> str:
    by = by_name(events)
    kernel_us = sum(v[0] for v in by.values())
    busy = busy_us(events)
    lines = [f"wall {1e3 * wall_s:.1f} ms for {calls} model calls = {1e3 * wall_s / calls:.3f} ms/call; device busy "
             f"{busy / 1e3:.1f} ms ({100 * busy / 1e6 / wall_s:.0f}% of wall) = {busy / 1e3 / calls:.3f} ms/call; "
             f"{len(events)} kernels ({len(events) / calls:.0f} per call)", "",
             "| kernel | total ms | share of kernel time | count | per call us | mean us |", "|---|---:|---:|---:|---:|---:|"]
    for name, (us, n) in list(by.items())[:top]:
        lines.append(f"| `{name[:90]}` | {us / 1e3:.2f} | {100 * us / kernel_us:.1f}% | {n} | {us / calls:.1f} | "
                     f"{us / n:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    use_decode_xla_flags()  # what decode.py runs with; XLA reads it when jax creates its backend
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--tpf", default="4", help="SBD tokens per forward to force (comma list)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--layout", choices=("per-layer", "stacked"), default="per-layer",
                    help="weights as decoders use them (unstack_layers) or as training stacks them")
    ap.add_argument("--out-dir", default="/tmp/profile_decode")
    a = ap.parse_args(argv)
    cfg = model_config(a, a.prompt + a.new)
    params = jax.jit(lambda key: sbd_jax.init_params(cfg, key))(jax.random.key(0))
    if a.layout == "per-layer":
        params = unstack_layers(params, delete=True)
    B, P, N, k = a.batch, a.prompt, a.new, a.block
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size - 1, (B, P)).astype(np.int32)
    lens = np.full((B,), P, np.int32)
    logv = math.log(cfg.vocab_size)
    n = sum(x.size for x in jax.tree.leaves(params))
    dev = jax.devices()[0]
    print(f"model {describe(cfg, n)}, layout {a.layout}; batch {B}, prompt {P}, {N} new tokens; "
          f"{dev.platform} {dev.device_kind}; "
          f"XLA_FLAGS `{os.environ.get('XLA_FLAGS', '')}`; "
          f"jax {jax.__version__}")
    runs = [("AR", "ar", 0.0)] + [(f"SBD k={k}, {t} tokens/forward", "sbd", 1e9 if t >= k else logv * (t - 1) + 1)
                                  for t in map(int, a.tpf.split(","))]
    out_dir = Path(a.out_dir)
    for title, mode, gamma in runs:
        call = GenerateCall.build(params, cfg, ids, lens, max_new_tokens=N, block_size=k, gamma=gamma, mode=mode,
                                  eos_ids=())
        args = call.args
        t = time.perf_counter()
        fn = call.lower().compile()
        compile_s = time.perf_counter() - t
        for _ in range(2):
            out = jax.block_until_ready(fn(*args))
        log_dir = out_dir / title.split(",")[0].replace(" ", "_").replace("=", "")
        with jax.profiler.trace(str(log_dir), create_perfetto_trace=True):
            t = time.perf_counter()
            out = jax.block_until_ready(fn(*args))
            wall = time.perf_counter() - t
        trace = newest_trace(log_dir)
        calls = int(out.iterations)
        print(f"\n## {title}: {int(np.asarray(out.lengths).sum())} tokens in {calls} model calls "
              f"(compiled in {compile_s:.1f} s; trace: {trace})\n")
        print(summarize(device_events(trace), wall, calls, a.top), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
